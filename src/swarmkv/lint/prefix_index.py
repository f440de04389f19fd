"""Earlier prompts indexed by token prefix, to find the one a new prompt shares the most tokens with.

A tree of fixed-size token chunks (a dict per node, keyed by the next chunk's tuple); a prompt's partial
last chunk is kept at the node it ends under. Finding a prompt's longest common prefix walks its full
chunks, then compares the next chunk with the few distinct chunks seen there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarmkv.prefix import common_prefix_length

CHUNK_TOKENS = 16


class _Node:
    __slots__ = ("children", "ends", "latest")

    def __init__(self, latest: int) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.ends: dict[tuple[int, ...], int] = {}  # partial last chunk (maybe empty) -> latest prompt
        self.latest = latest  # the newest prompt through this node


@dataclass(frozen=True)
class Match:
    """How a new prompt relates to the earlier ones."""

    num_tokens: int  # the longest common prefix with any earlier prompt
    key: int | None  # the newest earlier prompt sharing that many tokens
    extends: int | None  # the newest of the longest earlier prompts the new one continues whole


class PrefixIndex:
    """Earlier prompts by token prefix; keys are the caller's (increasing, e.g. request indexes)."""

    def __init__(self) -> None:
        self._root = _Node(-1)

    def add(self, key: int, tokens: Sequence[int]) -> None:
        """Index a prompt under `key` (newer prompts have larger keys)."""
        node = self._root
        node.latest = key
        full = len(tokens) // CHUNK_TOKENS * CHUNK_TOKENS
        for start in range(0, full, CHUNK_TOKENS):
            chunk = tuple(tokens[start : start + CHUNK_TOKENS])
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node(key)
            child.latest = key
            node = child
        node.ends[tuple(tokens[full:])] = key

    def match(self, tokens: Sequence[int]) -> Match:
        """The longest common prefix of `tokens` with the indexed prompts, and which prompts give it."""
        node, depth = self._root, 0
        contained: tuple[int, int] | None = None  # (length, key) of the best prompt `tokens` continues
        while True:
            rest = tuple(tokens[depth : depth + CHUNK_TOKENS])
            for end, key in node.ends.items():
                if rest[: len(end)] == end and (contained is None or (depth + len(end), key) > contained):
                    contained = (depth + len(end), key)
            child = node.children.get(rest) if len(rest) == CHUNK_TOKENS else None
            if child is None:
                break
            node, depth = child, depth + CHUNK_TOKENS
        extends = None if contained is None else contained[1]
        if node.latest < 0:
            return Match(0, None, None)
        best_len, best_key = 0, node.latest
        for chunk, child in node.children.items():
            shared = common_prefix_length(chunk, rest)
            if shared > best_len or (shared == best_len and child.latest > best_key):
                best_len, best_key = shared, child.latest
        for end, key in node.ends.items():
            shared = common_prefix_length(end, rest)
            if shared > best_len or (shared == best_len and key > best_key):
                best_len, best_key = shared, key
        return Match(depth + best_len, best_key, extends)
