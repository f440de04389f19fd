"""Prefix breaks in a request log: each request against the earlier ones of its family, in log order.

A request is compared with the earlier prompt of its family (`families.py`: one harness, one system prompt)
and cache salt that it shares the most tokens with, its own session's newest prompt on a tie; never with
another family's. It breaks when it does not continue that prompt, and either belongs to a session it should
continue, or (a session's first request: a new instance) parts from it inside the shared head (system
messages and tools), at a date, time or random id, or at per-instance environment text (a working directory
on a line that says so, say). A first request that parts after the head elsewhere is a new agent with its
own task: no break.

When the break is at a value (a date, an id, a path, a git hash), the request is matched again as if the
heads' values were equal (`hidden.py`), and compared with that prompt given its values one by one: this
shows the breaks the first one hides (more values, then one agent's reordered tools, say), up to the first
that is not a value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from swarmkv.breaks.causes import (
    Break,
    RenderedPrompt,
    classify,
    common_chars,
    divergence,
    head_chars,
    is_env_break,
)
from swarmkv.breaks.patterns import volatile_at
from swarmkv.lint.families import Family
from swarmkv.lint.hidden import MaskedHead, ValueScanner, align, mask
from swarmkv.lint.prefix_index import Match, PrefixIndex
from swarmkv.lint.render import RenderedRequest
from swarmkv.lint.sessions import Sessions
from swarmkv.tokenizer import Tokenizer

VALUE_CAUSES = ("timestamp", "random_id", "per_instance_env")


@dataclass(frozen=True)
class Finding:
    """A request's family and session, its break, and the breaks behind it if the first is at a value."""

    rendered: RenderedRequest
    family: Family
    session: str
    brk: Break | None
    hidden: tuple[Break, ...] = ()


@dataclass(frozen=True)
class _Seen:
    request: RenderedRequest
    family: str
    session: str
    masked: MaskedHead
    masked_ids: list[int]


class BreakFinder:
    """Feeds requests in log order; each `add` returns the request's finding."""

    def __init__(self, tokenizer: Tokenizer, encode: Callable[[str], list[int]] | None = None) -> None:
        self.tokenizer = tokenizer
        self._encode = encode or tokenizer.encode
        # Per family and cache salt (salts never share KV): the prompts' tokens, and their tokens with
        # values masked.
        self._indexes: dict[tuple[str, str | None], tuple[PrefixIndex, PrefixIndex]] = {}
        self._seen: list[_Seen] = []
        self._sessions = Sessions()
        self._heads: dict[str, int] = {}
        self._scanner = ValueScanner()

    def add(self, request: RenderedRequest, family: Family) -> Finding:
        """The request's finding; it then counts as seen for its family's later requests."""
        prompt = request.prompt
        where = (family.name, request.cache_salt)
        raw, masked_index = self._indexes.setdefault(where, (PrefixIndex(), PrefixIndex()))
        masked = mask(prompt.text, self._head(prompt) if prompt.messages else 0, self._scanner)
        masked_ids = self._encode(masked.text) if masked.values else prompt.token_ids
        match = raw.match(prompt.token_ids)
        extends = match.extends
        if extends is not None and len(self._seen[extends].request.prompt.token_ids) == len(prompt.token_ids):
            extends = None  # the same prompt again says nothing about whose it is
        session = self._sessions.assign(
            request.session_id,
            request.user,
            prompt.messages,
            None if extends is None else self._seen[extends].session,
        )
        previous = self._sessions.newest(session)
        if previous is not None and self._where(self._seen[previous]) != where:
            previous = None  # the session's side request (another family) or another salt
        brk: Break | None = None
        hidden: tuple[Break, ...] = ()
        if match.key is not None:
            earlier = self._reference(match, previous, prompt.token_ids, masked=False)
            brk = self._break(earlier.request.prompt, prompt, match.num_tokens, previous is not None)
        seen = _Seen(request, family.name, session, masked, masked_ids)
        if brk is not None and brk.cause in VALUE_CAUSES and masked.values:
            hidden = self._hidden(masked_index.match(masked_ids), seen, previous, brk)
        number = len(self._seen)
        raw.add(number, prompt.token_ids)
        masked_index.add(number, masked_ids)
        self._seen.append(seen)
        self._sessions.remember(number, session, prompt.messages)
        return Finding(request, family, session, brk, hidden)

    @staticmethod
    def _where(seen: _Seen) -> tuple[str, str | None]:
        return seen.family, seen.request.cache_salt

    def _reference(self, match: Match, previous: int | None, tokens: list[int], masked: bool) -> _Seen:
        """The earlier prompt to compare with: the session's newest if it shares the most, else the newest
        that does."""
        assert match.key is not None
        if previous is not None:
            seen = self._seen[previous]
            theirs = seen.masked_ids if masked else seen.request.prompt.token_ids
            if divergence(theirs, tokens) == match.num_tokens:
                return seen
        return self._seen[match.key]

    def _break(
        self, earlier: RenderedPrompt, later: RenderedPrompt, offset: int, continues_session: bool
    ) -> Break | None:
        if offset >= len(earlier.token_ids):
            return None  # it continues the earlier prompt
        if not continues_session and not self._parts_in_head(earlier, later):
            return None
        return classify(earlier, later, offset, self.tokenizer, first_request=not continues_session)

    def _hidden(self, match: Match, later: _Seen, previous: int | None, first: Break) -> tuple[Break, ...]:
        """The breaks behind `first` (at a value): against the most similar earlier prompt with values
        masked, given the later prompt's values one by one."""
        if match.key is None:
            return ()
        earlier = self._reference(match, previous, later.masked_ids, masked=True)
        prompt, found = later.request.prompt, [first]
        values = (earlier.masked.values, later.masked.values)
        for num_values in range(1, len(later.masked.values) + 1):
            aligned = align(earlier.request.prompt, values[0], prompt, values[1], num_values, self._encode)
            if aligned is None:
                break
            offset = divergence(aligned.token_ids, prompt.token_ids)
            if offset >= len(aligned.token_ids):
                break  # with these values equal it continues the earlier prompt
            if offset <= found[-1].offset:
                continue  # this value was equal already
            brk = self._break(aligned, prompt, offset, previous is not None)
            if brk is None:
                break
            found.append(brk)
            if brk.cause not in VALUE_CAUSES:
                break
        return tuple(found[1:])

    def _parts_in_head(self, earlier: RenderedPrompt, later: RenderedPrompt) -> bool:
        """Whether two prompts differ inside the head, at a volatile value, or at environment text."""
        differ = common_chars(earlier.text, later.text)
        if volatile_at(later.text, differ) or volatile_at(earlier.text, differ):
            return True
        if not earlier.messages or not later.messages:
            return is_env_break(earlier, later, differ, 0)
        head_end = max(self._head(earlier), self._head(later))
        return differ < head_end or is_env_break(earlier, later, differ, head_end)

    def _head(self, prompt: RenderedPrompt) -> int:
        # Keyed by what the head is rendered from; later system messages only make the key longer.
        system = [m for m in prompt.messages if m.get("role") == "system"]
        key = json.dumps([system, prompt.tools], sort_keys=True, ensure_ascii=False)
        if key not in self._heads:
            self._heads[key] = head_chars(prompt, self.tokenizer)
        return self._heads[key]
