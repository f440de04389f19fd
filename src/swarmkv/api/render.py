"""The one renderer: a validated request -> the prompt token ids the engine computes, for every caller.

The server's routes, `swarmkv lint` and the cluster's router all render here, so a prompt is the same tokens
wherever it is rendered. A chat prompt is the model's chat template over the messages and the tools (unless
tool_choice is "none"), then the forced opening of a required tool call, encoded without special tokens
(the template writes them); a completions prompt's text is encoded with them (the tokenizer's BOS); a pin's
messages render as a chat prompt's head, without the generation prompt. Chat prompts and pins are laid out
as `layout` says (`api/layout.py`: the template's order, or the tools first), pins as their chats are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarmkv.api.chat_request import ChatRequest, Message
from swarmkv.api.errors import bad_request
from swarmkv.api.layout import Layout, PlacedBlock, find_tool_block, place_tool_block, tools_first
from swarmkv.api.messages_request import Breakpoint, MessagesRequest
from swarmkv.api.options import context_length_exceeded
from swarmkv.api.pin_request import PinRequest
from swarmkv.api.reasoning import prompt_opens_thinking
from swarmkv.breaks.causes import RenderedPrompt
from swarmkv.errors import InvalidRequestError
from swarmkv.tokenizer import Tokenizer

# Text -> token ids without special tokens: the tokenizer's `encode`, or an equal one that caches (lint's)
# or refuses a text too long to tokenize (`bounded_encode`).
Encode = Callable[[str], list[int]]
# A text longer than this is counted chunk by chunk before it is tokenized whole, so a refused prompt costs
# at most a chunk's tokens in memory (32K characters of emoji: 96K tokens, about 10 MB) and time up to the
# context, whatever its size.
_COUNT_CHUNK_CHARS = 32_768
# A chunk ends at its last whitespace in its last quarter, where a pre-tokenizer splits anyway; a cut inside
# a word can give its two halves more tokens than the word has, so each cut is allowed this many before the
# count refuses.
_CUT_SLACK_TOKENS = 16


def bounded_encode(
    tokenizer: Tokenizer, max_model_len: int, prompt_param: str, text_prompt: bool = False
) -> Encode:
    """The tokenizer's `encode` (`encode_text_prompt` for a `text_prompt`), refusing (400) a text that cannot
    fit `max_model_len` before it tokenizes all of it: at once when its bytes alone need more tokens than
    the context has (`Tokenizer.min_num_tokens`), else once counting it chunk by chunk passes the context.
    Neither refuses a text that fits; what passes is encoded whole, as `encode` would."""

    def encode(text: str) -> list[int]:
        min_tokens = tokenizer.min_num_tokens(text)
        if min_tokens > max_model_len:
            num_tokens = f"at least {min_tokens} (its {len(text)} characters)"
            raise context_length_exceeded(max_model_len, num_tokens, prompt_param)
        if len(text) > _COUNT_CHUNK_CHARS:
            counted = count_up_to(tokenizer, text, max_model_len)
            if counted is not None:
                raise context_length_exceeded(max_model_len, f"more than {counted}", prompt_param)
        return tokenizer.encode_text_prompt(text) if text_prompt else tokenizer.encode(text)

    return encode


def count_up_to(tokenizer: Tokenizer, text: str, max_tokens: int) -> int | None:
    """None when `text` may fit `max_tokens`; else the tokens counted, chunk by chunk, once past them (and past
    the slack its cuts are allowed): a long text is never tokenized further than the bound."""
    num_tokens, num_cuts, start = 0, 0, 0
    while start < len(text):
        end = min(start + _COUNT_CHUNK_CHARS, len(text))
        if end < len(text):
            space = max(
                text.rfind(" ", end - _COUNT_CHUNK_CHARS // 4, end),
                text.rfind("\n", end - _COUNT_CHUNK_CHARS // 4, end),
            )
            end = space if space > start else end
            num_cuts += 1
        num_tokens += len(tokenizer.encode(text[start:end]))
        if num_tokens > max_tokens + num_cuts * _CUT_SLACK_TOKENS:
            return num_tokens
        start = end
    return None


def render_chat(
    tokenizer: Tokenizer,
    req: ChatRequest,
    encode: Encode | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    layout: Layout = "template",
) -> RenderedPrompt:
    """The chat prompt as the engine will see it; a 400 when the template cannot render the messages.

    `template_kwargs` are the template's own switches (Messages' `thinking` as `enable_thinking`).
    """
    text, messages, _ = _template_text(tokenizer, req, layout, template_kwargs)
    return _encoded(tokenizer, req, text + req.forced_prefix(), messages, encode)


def render_request(
    tokenizer: Tokenizer, req: ChatRequest, layout: Layout = "template", encode: Encode | None = None
) -> tuple[ChatRequest, RenderedPrompt]:
    """A chat request as this tokenizer's template takes it, and its prompt: the one rendering the server's
    routes, lint and the cluster router share. The request's template switches (`chat_template_kwargs`,
    Messages' `thinking`) apply; a forced call opens in the template's own tool-call format, and after the
    generation prompt's `<think>` block where the template opens one (Qwen3.5), never inside it."""
    req = req.for_template(tokenizer.chat_template)
    text, messages, _ = _template_text(tokenizer, req, layout, req.template_kwargs)
    req = _closing_thinking(req, text)
    return req, _encoded(tokenizer, req, text + req.forced_prefix(), messages, encode)


def render_messages(
    tokenizer: Tokenizer, req: MessagesRequest, layout: Layout = "template", encode: Encode | None = None
) -> RenderedMessages:
    """A Messages request's prompt (as `render_request` renders it) and its cache marks' pins (as `render_pin`
    renders them), from one rendering of the prompt and one of each mark's head: under tools-first a head
    is rendered without the tools, the block the prompt's rendering holds is moved in, and the first head
    that finds it spares the layout its own rendering; a mark on the tools pins that block's head."""
    chat = req.chat.for_template(tokenizer.chat_template)
    tools = chat.prompt_tools
    moving = layout == "tools-first" and tools is not None
    heads: list[str | None] = []
    for mark in req.breakpoints:
        head_tools = None if moving else tools
        try:
            head = None if mark.on_tools and moving else _head_text(tokenizer, mark.messages, head_tools)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param="messages") from exc
        heads.append(head)
    known = [head for head in heads if head is not None] if moving else []
    text, messages, placed = _template_text(tokenizer, chat, layout, chat.template_kwargs, known)
    chat = _closing_thinking(chat, text)
    prompt = _encoded(tokenizer, chat, text + chat.forced_prefix(), messages, encode)
    pins = []
    for mark, head in zip(req.breakpoints, heads, strict=True):
        pin_text = head if not moving else _moved_pin(mark, head, placed)
        if pin_text is None:  # the tools stay where the template puts them: the pin renders as such
            pins.append(render_pin(tokenizer, req.pin_request(mark, tokenizer, layout), layout, encode))
        else:
            pins.append(encode(pin_text) if encode is not None else tokenizer.encode(pin_text))
    return RenderedMessages(chat, prompt, pins)


@dataclass(frozen=True)
class RenderedMessages:
    """A rendered Messages request: the chat request as rendered, its prompt, and each cache mark's ids to pin."""

    req: ChatRequest
    prompt: RenderedPrompt
    pins: list[list[int]]  # in the order of `MessagesRequest.breakpoints`


def _moved_pin(mark: Breakpoint, head: str | None, placed: PlacedBlock | None) -> str | None:
    """A mark's pin under tools-first from the prompt's placed block: the block's head for a mark on the tools,
    else the mark's head (rendered without the tools) with the block moved in; None where neither fits."""
    if placed is None:
        return None
    if mark.on_tools:
        return placed.block.tools_head
    system = mark.messages[0].get("content") if mark.messages else None
    if head is None or mark.messages[0].get("role") != "system" or not isinstance(system, str) or not system:
        return None
    return placed.block.first_in(head, system)


def _head_text(
    tokenizer: Tokenizer, messages: list[Message], tools: list[dict[str, Any]] | None
) -> str | None:
    """A pin's messages rendered as a chat prompt's head, without the generation prompt; None for no messages."""
    if not messages:
        return None
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False)


def _template_text(
    tokenizer: Tokenizer,
    req: ChatRequest,
    layout: Layout,
    template_kwargs: Mapping[str, Any] | None,
    head_texts: Sequence[str] = (),
) -> tuple[str, list[Message], PlacedBlock | None]:
    """The template's text for the request's messages and tools, laid out as `layout` says (its one rendering,
    and under tools-first one of a head without the tools, unless `head_texts` has one that shows the block)."""
    tools = req.prompt_tools
    messages = system_turns_in_place(tokenizer, req.messages)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, **(template_kwargs or {}))
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param="messages") from exc
    except RecursionError as exc:  # a value nested past what the template's `tojson` reaches
        raise bad_request("the messages are nested too deeply to render", param="messages") from exc
    if layout != "tools-first":
        return text, messages, None
    placed = place_tool_block(tokenizer, messages, tools, text, template_kwargs, head_texts)
    return (placed.moved(text) if placed is not None else text), messages, placed


def _closing_thinking(req: ChatRequest, text: str) -> ChatRequest:
    """The request with a forced call closing the `<think>` block the template's `text` leaves open."""
    return req.closing_thinking() if req.forced_prefix() and prompt_opens_thinking(text) else req


def _encoded(
    tokenizer: Tokenizer, req: ChatRequest, text: str, messages: list[Message], encode: Encode | None
) -> RenderedPrompt:
    token_ids = encode(text) if encode is not None else tokenizer.encode(text, add_special_tokens=False)
    return RenderedPrompt(token_ids, text, messages, req.prompt_tools)


def system_turns_in_place(tokenizer: Tokenizer, messages: list[Message]) -> list[Message]:
    """The messages, each system message after the conversation's start rendered where it stands.

    Where the template renders such a turn in place (Qwen3's does), it stays a system turn; elsewhere its
    text joins the adjacent user turn as a `<system-reminder>`, as Claude Code does for models without
    mid-conversation system turns (templates such as Gemma's or Mistral's raise on one, others drop it).
    """
    start = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if not any(m["role"] == "system" for m in messages[start:]):
        return messages
    template = tokenizer.template
    if template is None or template.renders_system_in_place:
        return messages
    out = list(messages[:start])
    # Texts are joined once each turn is complete: joining them one system message at a time would copy a
    # turn's text once per message.
    joining: list[str] = []  # the texts of out[-1], a user turn that system messages joined
    reminders: list[str] = []  # waiting for the next user turn when none came just before

    def close_joining() -> None:
        if joining:
            out[-1] = {**out[-1], "content": "\n\n".join(joining)}
            joining.clear()

    for m in messages[start:]:
        if m["role"] == "system":
            text = f"<system-reminder>\n{_text_of(m)}\n</system-reminder>"
            if not reminders and out and out[-1]["role"] == "user":
                if not joining:
                    joining.append(_text_of(out[-1]))
                joining.append(text)
            else:
                reminders.append(text)
            continue
        close_joining()
        if reminders and m["role"] == "user":
            out.append({**m, "content": "\n\n".join([*reminders, _text_of(m)])})
        else:
            if reminders:
                out.append({"role": "user", "content": "\n\n".join(reminders)})
            out.append(m)
        reminders.clear()
    close_joining()
    if reminders:
        out.append({"role": "user", "content": "\n\n".join(reminders)})
    return out


def _text_of(message: Message) -> str:
    """A message's text: its string content, or its text parts joined with newlines."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def render_completion(
    tokenizer: Tokenizer, prompt: str | list[int], encode_text_prompt: Encode | None = None
) -> list[int]:
    """A completions prompt's token ids: text encoded with the tokenizer's special tokens (by
    `encode_text_prompt` when given, an equal one), ids as given."""
    if isinstance(prompt, str):
        return (encode_text_prompt or tokenizer.encode_text_prompt)(prompt)
    return prompt


def render_pin(
    tokenizer: Tokenizer, req: PinRequest, layout: Layout = "template", encode: Encode | None = None
) -> list[int]:
    """The token ids to pin: the given ids, or the messages rendered as a chat prompt's head, laid out as the
    chats it is the head of (under tools-first, a pin of the tools alone is the system turn up to the tools)."""
    if req.prompt_token_ids is not None:
        return req.prompt_token_ids
    assert req.messages is not None
    try:
        if req.messages:
            text = tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=False)
            if layout == "tools-first":
                moved = tools_first(tokenizer, req.messages, req.tools, text, add_generation_prompt=False)
                text = moved or text
        else:
            block = find_tool_block(tokenizer, req.tools) if layout == "tools-first" and req.tools else None
            text = block.tools_head if block is not None else _shared_head(tokenizer, req.tools)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param="messages") from exc
    return encode(text) if encode is not None else tokenizer.encode(text, add_special_tokens=False)


def _shared_head(tokenizer: Tokenizer, tools: list[dict[str, Any]] | None) -> str:
    """What every chat opening with a user message starts with: the template's default system prompt, the
    tools, the user turn's header. Two chats whose user text differs from its first character share exactly
    that, whatever the template."""
    a, b = (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], tools=tools, add_generation_prompt=False
        )
        for c in ("A", "B")
    )
    return os.path.commonprefix([a, b])
