"""PromptHistory: the latest rendered prompts of each session and each cache salt, in bounded memory.

The server compares a chat request's prompt with the earlier prompts of its session and its salt to say
where, and why, the prefix cache stopped helping (`cache_breaks.py`). Each key keeps its newest
`max_per_key` prompts; past `max_keys` keys or `max_tokens` stored tokens, the least recently used key is
forgotten whole. Token ids are kept as 4-byte arrays, so the default bound is about 32 MiB of ids (plus
the prompts' text and messages).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredPrompt:
    """One earlier prompt: its token ids (compact), rendered text, messages and tools."""

    token_ids: array
    text: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class PromptHistory:
    """Key (a session or a salt) -> its newest prompts, least recently used keys forgotten first."""

    def __init__(self, max_per_key: int = 64, max_keys: int = 4096, max_tokens: int = 8_000_000) -> None:
        self.max_per_key = max_per_key
        self.max_keys = max_keys
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[Hashable, deque[StoredPrompt]] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        """Token ids stored, counted once per key that holds the prompt."""
        return self._num_tokens

    def earlier(self, keys: list[Hashable]) -> list[StoredPrompt]:
        """The stored prompts of these keys, newest first per key (a prompt under two keys comes twice)."""
        with self._lock:
            return [p for key in keys for p in reversed(self._prompts.get(key, ()))]

    def add(self, keys: list[Hashable], prompt: StoredPrompt) -> None:
        """Remember `prompt` under each key, then forget old prompts and keys past the bounds."""
        with self._lock:
            for key in keys:
                prompts = self._prompts.get(key)
                if prompts is None:
                    prompts = self._prompts[key] = deque()
                self._prompts.move_to_end(key)
                prompts.append(prompt)
                self._num_tokens += len(prompt.token_ids)
                if len(prompts) > self.max_per_key:
                    self._num_tokens -= len(prompts.popleft().token_ids)
            while self._prompts and (
                len(self._prompts) > self.max_keys or self._num_tokens > self.max_tokens
            ):
                _, dropped = self._prompts.popitem(last=False)
                self._num_tokens -= sum(len(p.token_ids) for p in dropped)
