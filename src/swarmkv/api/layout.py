"""The prompt layout: where the tool block goes in a chat prompt (`--prompt-layout auto|template|tools-first`).

`template` is the model's chat template as written. `tools-first` moves the tool block the template renders
to the front of the system turn, before the system text (Anthropic's cache order: tools, system, messages),
so agents whose system prompts differ by per-instance text (paths, a git hash, the date) still share the
tool schemas' KV. The block is found by rendering the template itself, not by knowing its format: a probe
with a sentinel system text, once with the tools and once without, shows the text the tools add and where;
the request's own prompt must hold that same text at that same place, else the layout stays `template`, so
a prompt is never corrupted. `auto` is `tools-first` on Messages and `template` elsewhere. The layout is a
pure function of the request and the setting, so it is the same on every turn of a session. Where a prompt
opens with the tools (`tools_lead`), a cache mark on the last tool pins them alone, `ToolBlock.tools_head`,
which every prompt with those tools shares whatever its system text, as on Anthropic.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import swarmkv.resolve as resolve
from swarmkv.choices import PromptLayout
from swarmkv.errors import InvalidRequestError
from swarmkv.resolve import Api, Layout
from swarmkv.tokenizer import Tokenizer

# Texts that no real conversation holds, for the tool-block probe.
_PROBE_SYSTEM, _PROBE_USER = "swarmkv-layout-probe-system", "swarmkv-layout-probe-user"
_MAX_SPLITS = (
    64  # places the block could sit in a prompt; more is ambiguous text, left as the template wrote it
)


def resolve_layout(setting: PromptLayout, api: Api) -> Layout:
    """The layout a request on `api` gets under `--prompt-layout setting` (`swarmkv.resolve.prompt_layout`)."""
    return resolve.prompt_layout(setting, api)


@dataclass(frozen=True)
class ToolBlock:
    """The text a template adds for the tools, right after the system text and inside the system turn."""

    head: str  # what the template writes before the system text (the system turn's opening)
    separator: str  # the whitespace it writes between the system text and the tools
    body: str  # the tool block itself

    @property
    def tools_head(self) -> str:
        """The prompt's opening under tools-first, up to the end of the tools: what a mark on the last tool pins."""
        return self.head + self.body

    def first_in(self, head_text: str, system: str) -> str | None:
        """`head_text` (a rendering without tools that opens with the system text `system`) with this block
        before the system text; None where it does not open with this block's head and that text."""
        rest = head_text[len(self.head) :]
        if not head_text.startswith(self.head) or not rest.startswith((system, system.strip())):
            return None
        return self.head + self.body + self.separator + rest


@dataclass(frozen=True)
class PlacedBlock:
    """A tool block found in one prompt's own template-order text, and where it sits there."""

    block: ToolBlock
    start: int  # where the block's separator starts: the end of the system text
    end: int  # where the system turn goes on after the block

    def moved(self, text: str) -> str:
        """`text`, the prompt the block was found in, with the block moved before the system text."""
        b = self.block
        return b.head + b.body + b.separator + text[len(b.head) : self.start] + text[self.end :]


def place_tool_block(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    template_kwargs: Mapping[str, Any] | None = None,
    head_texts: Sequence[str] = (),
) -> PlacedBlock | None:
    """The tool block in `text` (the template's rendering of `messages` with `tools`), found from one more
    rendering: a head of the same conversation without the tools (one of `head_texts`, renderings a caller
    has already made, such as its pins'; else the system turn alone, rendered here). The block is the text
    between the system text and what the head renders after it; None where that text is not there exactly,
    is empty, or leaves the system turn (a special token or a second opening in it)."""
    template = tokenizer.template
    if template is None or not template.supports_tools or not tools or not messages:
        return None
    system = messages[0].get("content")
    if messages[0].get("role") != "system" or not isinstance(system, str) or not system:
        return None
    for head_text in head_texts:
        placed = _place(tokenizer, text, system, head_text)
        if placed is not None:
            return placed
    try:
        head_text = tokenizer.apply_chat_template(
            messages[:1], tools=None, add_generation_prompt=False, **dict(template_kwargs or {})
        )
    except InvalidRequestError:
        return None
    return _place(tokenizer, text, system, head_text)


def _place(tokenizer: Tokenizer, text: str, system: str, head_text: str) -> PlacedBlock | None:
    """The block `text` holds right after `system`, where `head_text` (without tools) goes on instead."""
    assert tokenizer.template is not None
    specials = [special for _, special in tokenizer.template.special_tokens if special]
    for rendered in dict.fromkeys((system, system.strip())):
        at = head_text.find(rendered)
        if at < 0:
            continue
        start = at + len(rendered)
        closing = head_text[start:]
        # A closing with no special token could recur inside the tool block, so it cannot mark the block's end.
        if not text.startswith(head_text[:start]) or not any(special in closing for special in specials):
            return None
        end = text.find(closing, start)
        inserted = text[start:end] if end >= 0 else ""
        body = inserted.lstrip()
        opening = head_text[:at].strip()
        if not body or any(special in inserted for special in specials) or (opening and opening in inserted):
            return None
        return PlacedBlock(ToolBlock(head_text[:at], inserted[: len(inserted) - len(body)], body), start, end)
    return None


def find_tool_block(
    tokenizer: Tokenizer, tools: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None = None
) -> ToolBlock | None:
    """The block the model's own template renders for `tools`; None where it renders none that can be found
    exactly after the system text, inside the system turn (or where the tools are ours, for a template
    without tool support: then there is no template order to improve on)."""
    template = tokenizer.template
    if template is None or not template.supports_tools or not tools:
        return None
    probe = [{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_USER}]
    kwargs = dict(template_kwargs or {})
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=tools, **kwargs)
        without = tokenizer.apply_chat_template(probe, tools=None, **kwargs)
    except InvalidRequestError:
        return None
    if with_tools.count(_PROBE_SYSTEM) != 1 or without.count(_PROBE_SYSTEM) != 1:
        return None
    head, tail = with_tools.split(_PROBE_SYSTEM)
    head_without, tail_without = without.split(_PROBE_SYSTEM)
    if head != head_without or len(tail) <= len(tail_without) or not tail.endswith(tail_without):
        return None
    inserted = tail[: len(tail) - len(tail_without)]
    body = inserted.lstrip()
    # The block must stay in the system turn: no end-of-turn or other special token text, no second opening.
    specials = [text for _, text in template.special_tokens if text]
    opening = head.strip()
    if not body or any(text in inserted for text in specials) or (opening and opening in inserted):
        return None
    return ToolBlock(head, inserted[: len(inserted) - len(body)], body)


def tools_first(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str | None:
    """`text` (the template's rendering of `messages` with `tools`) with the tool block moved before the
    system text; None when there is nothing to move or the block cannot be found exactly."""
    if not tools or not messages or messages[0].get("role") != "system":
        return None
    system = messages[0].get("content")
    if not isinstance(system, str) or not system:
        return None
    block = find_tool_block(tokenizer, tools, template_kwargs)
    if block is None:
        return None
    try:
        without = tokenizer.apply_chat_template(
            messages, tools=None, add_generation_prompt=add_generation_prompt, **dict(template_kwargs or {})
        )
    except InvalidRequestError:
        return None
    split = _insertion(text, without, block.separator + block.body)
    if split is None or not without.startswith(block.head):
        return None
    rendered_system = without[len(block.head) : split]
    if rendered_system not in (system, system.strip()):
        return None
    return block.head + block.body + block.separator + rendered_system + without[split:]


def tools_lead(
    tokenizer: Tokenizer,
    system_turn: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> bool:
    """Whether a tools-first prompt opening with `system_turn` (its leading system message) opens with the tool
    block, so that `find_tool_block(...).tools_head` is its prefix; False where it keeps the template's order."""
    if not tools or not system_turn:
        return False
    kwargs = dict(template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(system_turn, tools=tools, add_generation_prompt=False, **kwargs)
    except InvalidRequestError:
        return False
    moved = tools_first(
        tokenizer, system_turn, tools, text, add_generation_prompt=False, template_kwargs=template_kwargs
    )
    return moved is not None


def _insertion(text: str, without: str, inserted: str) -> int | None:
    """The one index k with text == without[:k] + inserted + without[k:]; None if there is none or several."""
    if len(text) != len(without) + len(inserted):
        return None
    prefix = len(os.path.commonprefix([text, without]))
    suffix = len(os.path.commonprefix([text[::-1], without[::-1]]))
    low, high = max(0, len(without) - suffix), min(prefix, len(without))
    if high - low >= _MAX_SPLITS:
        return None
    splits = [k for k in range(low, high + 1) if text[k : k + len(inserted)] == inserted]
    return splits[0] if len(splits) == 1 else None
