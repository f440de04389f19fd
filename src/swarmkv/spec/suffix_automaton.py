"""A suffix automaton over a growing token list, and a matcher that follows another text through one.

The automaton is built online, one token at a time in amortised O(1) (Blumer et al.; the classic construction
with clones), and stores for each state the end of its substrings' first occurrence. Two questions then cost
O(1): where the text's longest suffix that occurred before last ended (`repeat`), and, through a `Matcher` fed
another text token by token, where the longest suffix of that text occurs in this one. What follows that
occurrence is a draft. Nothing is ever rescanned: drafting stays O(1) a token however long the context.
"""

from __future__ import annotations


class SuffixAutomaton:
    """The automaton of `tokens`, extended a token at a time; read-only to everyone but its owner."""

    __slots__ = ("_end", "_last", "_len", "_link", "_next", "tokens")

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._link = [-1]
        self._len = [0]
        self._end = [-1]  # where the state's substrings first end (an index into tokens)
        self._last = 0
        for token in tokens or ():
            self.extend(token)

    def extend(self, token: int) -> None:
        """Append one token."""
        nxt, link, length, end = self._next, self._link, self._len, self._end
        position = len(self.tokens)
        self.tokens.append(token)
        cur = len(length)
        nxt.append({})
        length.append(length[self._last] + 1)
        link.append(0)
        end.append(position)
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                length.append(length[p] + 1)
                link.append(link[q])
                end.append(end[q])  # the clone's first occurrence is q's: the new one ends later
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur

    def repeat(self) -> tuple[int, int]:
        """(length, end) of the text's longest suffix that also occurred earlier, its first occurrence ending
        at index `end` < the text's last; (0, -1) when even the last token is new."""
        state = self._link[self._last] if self.tokens else 0
        return (self._len[state], self._end[state]) if state > 0 else (0, -1)

    def following(self, end: int, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens after index `end`: the continuation of an occurrence ending there."""
        return self.tokens[end + 1 : end + 1 + num_tokens]

    def continuing(self, end: int, num_tokens: int) -> list[int]:
        """`num_tokens` tokens predicted after the text's end from an earlier occurrence of its suffix ending
        at `end`: copied from after that occurrence, and where the copy reaches the text's end, from the
        copy itself (an overlapping copy, as LZ77 does: a repeating pattern goes on repeating)."""
        tokens, out = self.tokens, list[int]()
        for i in range(end + 1, end + 1 + num_tokens):
            out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
        return out


class Matcher:
    """The longest suffix of a text fed to it token by token that occurs in `automaton`'s text, kept as the
    automaton grows (it only grows, so a match found stays a substring of it)."""

    __slots__ = ("automaton", "length", "state")

    def __init__(self, automaton: SuffixAutomaton) -> None:
        self.automaton = automaton
        self.state = 0
        self.length = 0

    def feed(self, token: int) -> None:
        """The fed text gained `token`."""
        sam = self.automaton
        nxt, link, length = sam._next, sam._link, sam._len
        state, matched = self.state, self.length
        while state and token not in nxt[state]:
            state = link[state]
            # Not simply length[state]: a clone made since the match may have left it shorter than that.
            matched = min(matched, length[state])
        target = nxt[state].get(token)
        if target is None:
            self.state, self.length = 0, 0
        else:
            self.state, self.length = target, matched + 1

    def match(self) -> tuple[int, int]:
        """(length, end): the matched suffix's length and where its first occurrence in the automaton's text
        ends; (0, -1) with no match."""
        if not self.length:
            return 0, -1
        return self.length, self.automaton._end[self.state]
