"""Anthropic content blocks -> OpenAI-form chat messages, with a snapshot of the conversation at each cache mark.

Text blocks of one turn join with newlines, tool_use blocks become the assistant turn's `tool_calls`,
thinking blocks its `reasoning_content` (which thinking templates render, or drop from past turns),
redacted_thinking blocks nothing (their text is Anthropic's, encrypted), tool_result blocks become `tool` messages, and a system message inside `messages` stays a system turn where it
stands (the renderer folds it into a user turn for templates that cannot render it there); a block carrying `cache_control` records the conversation up to
and including it, for the Messages route to pin.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from swarmkv.api.chat_request import Message
from swarmkv.api.errors import bad_request, type_name

TTL_S = {"5m": 300.0, "1h": 3600.0}
_THINKING_BLOCKS = ("thinking", "redacted_thinking")  # an assistant turn's reasoning, Anthropic's two forms


def _ttl_s(where: str, block: dict[str, Any]) -> float | None:
    """The block's cache_control TTL in seconds; None when it has no cache_control."""
    control = block.get("cache_control")
    if control is None:
        return None
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise bad_request(
            f"{where}.cache_control must be {{'type': 'ephemeral'}}", param=f"{where}.cache_control"
        )
    ttl = control.get("ttl", "5m")
    if ttl not in TTL_S:
        raise bad_request(
            f"{where}.cache_control.ttl must be '5m' or '1h', got {ttl!r}", param=f"{where}.cache_control"
        )
    return TTL_S[ttl]


class MessagesBuilder:
    """Builds the OpenAI-form messages block by block, snapshotting the conversation at each cache mark."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.pending: Message | None = None  # the message the current blocks go into
        # The pending message's texts ("content", "reasoning_content"), joined when it is taken: joining
        # block by block would copy a turn's text once per block.
        self.parts: dict[str, list[str]] = {}
        self.marks: list[tuple[list[Message], float]] = []
        # Deferred tools (`defer_loading`) by name, as OpenAI function tools, and those a tool_reference loaded.
        self.deferred: dict[str, dict[str, Any]] = {}
        # Deferred tools a tool_reference loaded, in the order they were loaded (a dict as an ordered set).
        self.loaded: dict[str, None] = {}

    def done(self) -> list[Message]:
        """Every message, the pending one included."""
        self._flush()
        return self.messages

    def _result_part(self, where: str, block: Any) -> str:
        """One block of a tool_result's content as text: a text block's text, or a `tool_reference` (what a
        tool search returns, e.g. Claude Code's ToolSearch), which Anthropic's API expands into the named
        deferred tool's definition: here a line naming the tool and, where the request first loads it, its
        definition as JSON. The tool is then callable, and the prompt's tool block stays as it was."""
        part = _block(where, block, ("text", "tool_reference"))
        if part["type"] == "text":
            return str(part.get("text", ""))
        name = part.get("tool_name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.tool_name must be a non-empty string", param=where)
        tool = self.deferred.get(name)
        if tool is None:
            return f"Tool loaded: {name}"  # offered in full already, or unknown: nothing to expand
        if name in self.loaded:
            # Defined where it was first loaded: a body repeating a reference cannot multiply the prompt.
            return f"Tool loaded: {name}"
        self.loaded[name] = None
        return f"Tool loaded: {name}\n{json.dumps(tool['function'], ensure_ascii=False)}"

    def mark(self, where: str, block: dict[str, Any]) -> None:
        """Snapshot the conversation so far if `block` carries cache_control."""
        ttl_s = _ttl_s(where, block)
        if ttl_s is not None:
            pending = [copy.deepcopy(self._joined())] if self.pending is not None else []
            self.marks.append((copy.deepcopy(self.messages) + pending, ttl_s))

    def system(self, system: Any) -> None:
        if system is None:
            return
        if isinstance(system, str):
            self.messages.append({"role": "system", "content": system})
            return
        if not isinstance(system, list):
            raise bad_request(
                f"'system' must be a string or an array of text blocks, got {type_name(system)}",
                param="system",
            )
        self.pending = {"role": "system", "content": ""}
        for j, block in enumerate(system):
            where = f"system[{j}]"
            self._text(where, _block(where, block, ("text",)))
            self.mark(where, block)
        self._flush()

    def message(self, i: int, m: Any) -> None:
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"messages.{i}: Input should be a valid dictionary", param=where)
        role = m.get("role")
        # Worded as Anthropic words them: clients (Claude Code) match these texts to fall back.
        if role == "system":
            self._system_message(i, m)
            return
        if role not in ("user", "assistant"):
            raise bad_request(
                f"messages.{i}.role: Input should be 'user' or 'assistant'", param=f"{where}.role"
            )
        content = m.get("content")
        if isinstance(content, str):
            self._flush()
            self.messages.append({"role": role, "content": content})
            return
        if not isinstance(content, list):
            raise bad_request(
                f"{where}.content must be a string or an array of blocks", param=f"{where}.content"
            )
        allowed = ("text", "tool_result") if role == "user" else ("text", "tool_use", *_THINKING_BLOCKS)
        self._flush()
        for j, raw in enumerate(content):
            bwhere = f"{where}.content[{j}]"
            block = _block(bwhere, raw, allowed)
            if block["type"] == "tool_result":
                self._flush()
                self.messages.append(_tool_result(bwhere, block, self._result_part))
            else:
                self._open(role)
                if block["type"] == "text":
                    self._text(bwhere, block)
                elif block["type"] == "thinking":
                    self._thinking(bwhere, block)
                elif block["type"] == "tool_use":
                    self._tool_use(bwhere, block)
            self.mark(bwhere, block)
        self._flush()

    def _system_message(self, i: int, m: dict[str, Any]) -> None:
        """A system message inside `messages` (Anthropic's mid-conversation system turn), kept where it stands."""
        where = f"messages[{i}]"
        if i == 0:
            raise bad_request(
                "messages.0: use the top-level 'system' parameter for the initial system prompt", param=where
            )
        content = m.get("content")
        self._flush()
        if isinstance(content, str):
            self.messages.append({"role": "system", "content": content})
            return
        if not isinstance(content, list):
            raise bad_request(
                f"{where}.content must be a string or an array of text blocks", param=f"{where}.content"
            )
        self.pending = {"role": "system", "content": ""}
        for j, block in enumerate(content):
            bwhere = f"{where}.content[{j}]"
            self._text(bwhere, _block(bwhere, block, ("text",)))
            self.mark(bwhere, block)
        self._flush()

    def _open(self, role: str) -> None:
        if self.pending is None or self.pending["role"] != role:
            self._flush()
            self.pending = {"role": role, "content": ""}

    def _joined(self) -> Message:
        """The pending message with its texts joined with newlines, as chat completions joins text parts."""
        assert self.pending is not None
        return {**self.pending, **{key: "\n".join(texts) for key, texts in self.parts.items()}}

    def _flush(self) -> None:
        if self.pending is not None:
            pending = self._joined()
            if pending["content"] or pending.get("tool_calls") or pending.get("reasoning_content"):
                self.messages.append(pending)
            self.pending = None
            self.parts = {}

    def _add_text(self, key: str, text: str) -> None:
        """Add a block's text to the pending message's `key`; leading empty texts add nothing (no newline)."""
        texts = self.parts.setdefault(key, [])
        if texts or text:
            texts.append(text)

    def _text(self, where: str, block: dict[str, Any]) -> None:
        assert self.pending is not None
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text must be a string", param=where)
        self._add_text("content", text)

    def _thinking(self, where: str, block: dict[str, Any]) -> None:
        assert self.pending is not None
        thinking = block.get("thinking")
        if not isinstance(thinking, str):
            raise bad_request(f"{where}.thinking: Input should be a valid string", param=where)
        # The signature is not checked: a block sent back is the turn's reasoning (messages_objects.py).
        self._add_text("reasoning_content", thinking)

    def _tool_use(self, where: str, block: dict[str, Any]) -> None:
        assert self.pending is not None
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            raise bad_request(f"{where} must be a tool_use block with a string 'id' and 'name'", param=where)
        arguments = block.get("input", {})
        if not isinstance(arguments, dict):
            raise bad_request(f"{where}.input must be an object", param=where)
        call = {
            "id": block["id"],
            "type": "function",
            "function": {"name": block["name"], "arguments": arguments},
        }
        self.pending.setdefault("tool_calls", []).append(call)


def _block(where: str, block: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A content block of one of the `allowed` types, or a 400 naming what it is."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document"):
        raise bad_request(
            f"{where}: {kind} blocks are not supported: swarmkv runs the text model only", param=where
        )
    if not isinstance(block, dict) or kind not in allowed:
        raise bad_request(
            f"{where}: block type {kind!r} is not supported here (allowed: {', '.join(allowed)})", param=where
        )
    return block


def _tool_result(where: str, block: dict[str, Any], parts: Callable[[str, Any], str]) -> Message:
    """A tool_result block as the OpenAI `tool` message the chat template renders; `parts` reads each block of
    a list content as text."""
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"{where}.tool_use_id must be a string", param=where)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(parts(f"{where}.content[{k}]", b) for k, b in enumerate(content))
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or an array of text blocks", param=where)
    if block.get("is_error"):
        content = f"Error: {content}"  # the template has no error flag, so the model reads it in the text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
