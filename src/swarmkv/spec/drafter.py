"""Drafts without a model: the tokens a request's text suggests come next, from what the swarm has written.

Each request drafting keeps a suffix automaton of its own context (prompt and reply) and one of its reply alone.
Its draft is the continuation of the longest match of its recent tokens among three sources:
- `own`: an earlier occurrence in its own context (a file a tool returned, quoted back in an edit);
- `sibling`: the replies of requests under the same head (same cache salt and opening tokens: the swarm's other
  agents), finished or still running;
- `session`: the replies of its session's earlier turns.
A sibling's or session turn's reply is followed through a `Matcher`, so every source costs O(1) a token. The
sources are scoped by cache salt, which is the tenant's: a draft never comes from another tenant's text, since
acceptance and timing would show it. `EngineConfig.draft_sources` keeps any of the three out.

Draft length adapts per request: doubled after a fully accepted draft, cut to what was accepted plus one after
a partial one, but never shorter than the match it continues (up to the cap), since a long match is a copy under
way. A copy that the reply leaves at one token after following it for a while (an edit renaming a name) resumes
after that token when nothing else matches. A request whose drafts keep failing waits longer and longer between
tries. Under async scheduling (`idle_wait_steps`), a request whose text matched nothing also waits a few steps
before it looks again: a step may then be scheduled before its last token is known.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from swarmkv.choices import DRAFT_SOURCES, DraftOrigin, DraftSource
from swarmkv.spec.suffix_automaton import Matcher, SuffixAutomaton

HEAD_TOKENS = 32  # opening tokens that put requests of one salt under one head (a system prompt's start)
WARM_TOKENS = 32  # own tokens fed to a matcher made mid-reply, so it starts matching at once
MAX_BACKOFF_STEPS = 64
MAX_POOLS = 256  # heads and sessions whose replies are kept, each pool bounded too
RESUME_MIN_ACCEPTED = 3  # tokens of a draft accepted before a rejection for its copy to resume past the token


@dataclass(frozen=True)
class Draft:
    """Tokens proposed after a request's last, where they came from, and the match that proposed them."""

    tokens: tuple[int, ...]
    source: DraftOrigin
    match_tokens: int  # 0 for a model's draft


class Proposer(Protocol):
    """What the scheduler asks for drafts: the text `Drafter`, or a `DraftChooser` over it and an MTP layer."""

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        """A draft of at most `max_tokens` tokens to follow the request's last, or None."""
        ...


@dataclass(frozen=True)
class _Copy:
    """Where a draft is copied from: the text after index `end` of `automaton`, matched (or followed) over
    `length` tokens."""

    automaton: SuffixAutomaton
    end: int
    source: DraftSource
    length: int

    def tokens(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens of the copy. The request's own text may run into itself (`continuing`)."""
        if self.source == "own":
            return self.automaton.continuing(self.end, num_tokens)
        return self.automaton.following(self.end, num_tokens)


@dataclass
class _Request:
    context: SuffixAutomaton
    reply: SuffixAutomaton
    group: tuple[str | None, tuple[int, ...]]
    session: tuple[str | None, str] | None
    matchers: dict[int, tuple[Matcher, DraftSource]] = field(default_factory=dict)
    draft_tokens: int = 4  # the next draft's length cap
    misses: int = 0  # drafts in a row with nothing accepted
    idle: int = 0  # proposals in a row that matched nothing
    wait_steps: int = 0  # proposals skipped before the next try
    pending: _Copy | None = None  # where the latest draft came from, until its acceptance is recorded
    resume: _Copy | None = None  # a copy left at one token, offered to the next proposal only
    resume_at: int = 0  # the context's length it follows: the rejected draft's yield appended


class _Pool:
    """The replies drafts may come from, newest last, at most `capacity` finished ones beside the running."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.replies: OrderedDict[int, SuffixAutomaton] = OrderedDict()
        self.running: set[int] = set()
        self.members: set[str] = set()  # live requests matching against this pool

    def evicted(self) -> list[int]:
        """Drop the oldest finished replies past the capacity; their ids."""
        finished = [sid for sid in self.replies if sid not in self.running]
        gone = finished[: max(0, len(finished) - self.capacity)]
        for sid in gone:
            del self.replies[sid]
        return gone


class Drafter:
    """Proposes drafts for the requests added to it; the scheduler asks, the engine reports acceptance."""

    def __init__(
        self,
        max_draft_tokens: int = 8,
        min_match_tokens: int = 2,
        max_replies: int = 16,
        idle_wait_steps: int = 0,
        vet: Callable[[str, tuple[int, ...]], int] | None = None,
        sources: tuple[DraftSource, ...] = DRAFT_SOURCES,
    ) -> None:
        """`idle_wait_steps`: after k proposals in a row that matched nothing, a request skips the next
        min(k, idle_wait_steps) (0: it looks every step). `vet(request_id, tokens)`: how many of a draft's
        first tokens the request may take (a grammar's or a loop guard's limit); None: all. `sources`: the
        texts drafts may come from."""
        self.max_draft_tokens = max_draft_tokens
        self.sources = frozenset(sources)
        self.vet = vet
        self.idle_wait_steps = idle_wait_steps
        self.min_match_tokens = min_match_tokens
        self.max_replies = max_replies
        self._requests: dict[str, _Request] = {}
        self._ids: dict[str, int] = {}  # request id -> its reply's source id
        self._next_id = 0
        # Both kept newest last and bounded (a server sees heads and sessions come and go): the least
        # recently joined pool without live members goes first.
        self._groups: OrderedDict[tuple[str | None, tuple[int, ...]], _Pool] = OrderedDict()
        self._sessions: OrderedDict[tuple[str | None, str], _Pool] = OrderedDict()
        self.max_groups = MAX_POOLS
        self.max_sessions = MAX_POOLS

    def add(self, request_id: str, prompt: list[int], salt: str | None, session_id: str | None) -> None:
        """Start drafting for a request: its context's automaton, and matchers over its head's and session's
        replies (the same salt's only)."""
        group = (salt, tuple(prompt[:HEAD_TOKENS]))
        session = (salt, session_id) if session_id is not None else None
        req = _Request(SuffixAutomaton(prompt), SuffixAutomaton(), group, session)
        req.draft_tokens = min(req.draft_tokens, self.max_draft_tokens)
        sid = self._next_id
        self._next_id += 1
        self._requests[request_id], self._ids[request_id] = req, sid
        pools: list[tuple[_Pool, DraftSource]] = []
        if session is not None and "session" in self.sources:
            pools.append((self._session(session), "session"))
        if "sibling" in self.sources:
            pools.append((self._group(group), "sibling"))
        for pool, source in pools:
            for other, reply in pool.replies.items():
                if other not in req.matchers:
                    req.matchers[other] = (self._warm(Matcher(reply), req), source)
        for pool, source in pools:
            self._share(pool, source, sid, req.reply, request_id)

    def extend(self, request_id: str, tokens: list[int]) -> None:
        """The request's reply gained `tokens`."""
        req = self._requests.get(request_id)
        if req is None:
            return
        for token in tokens:
            req.context.extend(token)
            req.reply.extend(token)
            for matcher, _ in req.matchers.values():
                matcher.feed(token)

    def finish(self, request_id: str) -> None:
        """The request ended: its reply stays a source for its head and session; its context goes."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        sid = self._ids.pop(request_id)
        pools = [self._groups.get(req.group)]
        if req.session is not None:
            pools.append(self._sessions.get(req.session))
        for pool in pools:
            if pool is None:
                continue
            pool.running.discard(sid)
            pool.members.discard(request_id)
            self._evict(pool)

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        """A draft of at most `max_tokens` tokens to follow the request's last, or None (nothing matches well
        enough, or it is backing off after failed drafts)."""
        req = self._requests.get(request_id)
        if req is None or max_tokens <= 0:
            return None
        if req.wait_steps:
            req.wait_steps -= 1
            return None
        resume = req.resume if len(req.context.tokens) == req.resume_at else None  # a plain step stales it
        copy = self._longest_match(req) or resume
        req.resume = None
        best: Draft | None = None
        vetoed = False  # the text matched, but the request may not take its draft now: not a miss
        if copy is not None:
            # A long match is evidence of a copy: the draft is at least as long as the match (up to the cap),
            # as SuffixDecoding sizes its drafts, however short a partial acceptance has cut `draft_tokens`.
            num_tokens = min(max(req.draft_tokens, min(copy.length, self.max_draft_tokens)), max_tokens)
            tokens = copy.tokens(num_tokens)
            if self.vet is not None and tokens:
                vetoed = not (tokens := tokens[: self.vet(request_id, tuple(tokens))])
            best = Draft(tuple(tokens), copy.source, copy.length) if tokens else None
        req.pending = copy if best is not None else None
        if best is None and not vetoed:
            req.idle += 1
            req.wait_steps = min(req.idle, self.idle_wait_steps)
        elif best is not None:
            req.idle = 0
        return best

    def _longest_match(self, req: _Request) -> _Copy | None:
        """The longest match of the request's recent tokens among its sources (its own context first among
        equals), None below `min_match_tokens`."""
        length, end = req.context.repeat() if "own" in self.sources else (0, -1)
        found = _Copy(req.context, end, "own", length) if length >= self.min_match_tokens else None
        for matcher, source in req.matchers.values():
            length, end = matcher.match()
            followed = end + 1 < len(matcher.automaton.tokens)  # a reply matched at its end lends nothing
            if length >= self.min_match_tokens and followed and (found is None or length > found.length):
                found = _Copy(matcher.automaton, end, source, length)
        return found

    def unused(self, request_id: str) -> None:
        """The request's latest draft was proposed but not taken (another source's was): no outcome to learn."""
        req = self._requests.get(request_id)
        if req is not None:
            req.pending = None

    def backing_off(self, request_id: str) -> bool:
        """Whether the request's next proposal is skipped without reading its tokens (it is waiting out
        failed drafts), so a step may be scheduled before its last token is known."""
        req = self._requests.get(request_id)
        return req is None or req.wait_steps > 0

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> DraftSource | None:
        """How many of the `num_drafted` tokens of the request's latest draft (the scheduler may have cut
        it) were accepted: the next draft's length and back-off follow. The draft's source, None if unknown."""
        req = self._requests.get(request_id)
        if req is None or req.pending is None:
            return None
        copy, req.pending = req.pending, None
        # The reply followed the copy, then put another token in place of its next one: resume past it, in text
        # the copy read (an own copy running into the reply, LZ77-like, has no text past it to resume).
        if RESUME_MIN_ACCEPTED <= num_accepted < num_drafted:
            replaced = copy.end + 1 + num_accepted  # the rejected draft token's index in the copied text
            if replaced < len(copy.automaton.tokens) - 1:
                req.resume = _Copy(copy.automaton, replaced, copy.source, copy.length + num_accepted)
                req.resume_at = len(req.context.tokens) + num_accepted + 1
        if num_accepted == num_drafted:
            req.draft_tokens = min(2 * req.draft_tokens, self.max_draft_tokens)
        else:
            req.draft_tokens = max(1, num_accepted + 1)
        if num_accepted:
            req.misses = 0
        else:
            req.misses += 1
            req.wait_steps = min(2**req.misses - 1, MAX_BACKOFF_STEPS)
        return copy.source

    # The pools.

    def _group(self, key: tuple[str | None, tuple[int, ...]]) -> _Pool:
        return _joined(self._groups, key, self.max_replies, self.max_groups)

    def _session(self, key: tuple[str | None, str]) -> _Pool:
        return _joined(self._sessions, key, max(1, self.max_replies // 8), self.max_sessions)

    def _share(
        self, pool: _Pool, source: DraftSource, sid: int, reply: SuffixAutomaton, request_id: str
    ) -> None:
        """Offer a new request's reply to the pool's live members, and make it a member."""
        for member in pool.members:
            other = self._requests.get(member)
            if other is not None and sid not in other.matchers:
                other.matchers[sid] = (self._warm(Matcher(reply), other), source)
        pool.replies[sid] = reply
        pool.running.add(sid)
        pool.members.add(request_id)
        self._evict(pool)

    def _evict(self, pool: _Pool) -> None:
        gone = pool.evicted()
        if not gone:
            return
        for member in pool.members:
            req = self._requests.get(member)
            if req is not None:
                for sid in gone:
                    req.matchers.pop(sid, None)

    @staticmethod
    def _warm(matcher: Matcher, req: _Request) -> Matcher:
        for token in req.context.tokens[-WARM_TOKENS:]:
            matcher.feed(token)
        return matcher


def _joined(pools: OrderedDict[Any, _Pool], key: Any, capacity: int, max_pools: int) -> _Pool:
    """The pool under `key` (made if new), now the newest; the oldest pools without live members go past
    `max_pools`."""
    pool = pools.get(key)
    if pool is None:
        pool = pools[key] = _Pool(capacity)
    pools.move_to_end(key)
    idle = [k for k, p in pools.items() if not p.members and not p.running and k != key]
    for old in idle[: max(0, len(pools) - max_pools)]:
        del pools[old]
    return pool
