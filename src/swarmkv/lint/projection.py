"""What fixing a log's breaks would give: each fix replayed, and each family's fix kept only where it helps.

The fixes a family (`families.py`) can take:
- `rewrite`: its requests rewritten (`fix.py`): what the harness would change, and what `--fix` writes;
- `tools-first`: the server's `--prompt-layout tools-first` (the tool block before the system text), where
  the server renders the template's order and the template's tool block can be moved;
- `rewrite+tools-first`: both.
Each fix is replayed for every family it changes at once, as the server would serve the whole log. A family
takes the fix with the highest hit rate at least MIN_GAIN above its rate today (on a tie the first in the
order above: a server flag before both), or none: then its requests stay as they are. The chosen fixes are replayed
together; where a family's hit rate, or the log's, is then below today's (the families share one KV pool),
the fix that gains least is dropped, until none is: a replay with no fix left is today's, so the projection
is never below today.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from swarmkv.api.layout import Layout, find_tool_block
from swarmkv.lint.fix import fix_log
from swarmkv.lint.log_file import LoggedRequest
from swarmkv.lint.render import RenderedRequest, Renderer, RenderError
from swarmkv.lint.replay import ReplayResult

Fix = Literal["rewrite", "tools-first", "rewrite+tools-first"]
FIXES: tuple[Fix, ...] = ("tools-first", "rewrite", "rewrite+tools-first")  # preference order on a tie
Replay = Callable[[list[RenderedRequest]], ReplayResult]
MIN_GAIN = 0.01  # of hit rate, for a fix to count as one: less is a template's opening shared by chance


def rewrites(fix: Fix | None) -> bool:
    """Whether the fix rewrites the requests (else it is the server's layout alone, or nothing)."""
    return fix in ("rewrite", "rewrite+tools-first")


def tools_first(fix: Fix | None) -> bool:
    """Whether the fix serves the requests with `--prompt-layout tools-first`."""
    return fix in ("tools-first", "rewrite+tools-first")


@dataclass(frozen=True)
class FamilyProjection:
    """One family's rate today, under each fix that changes it, and the fix chosen (None: none helps)."""

    family: str
    hit_rate: float
    candidates: dict[Fix, float]  # each applicable fix's hit rate, replayed for every family at once
    fix: Fix | None
    projected_hit_rate: float  # with every family's chosen fix, replayed together


@dataclass(frozen=True)
class Projection:
    """The log with every family's chosen fix: its prompts, its replay, the rewritten log, per family."""

    rendered: list[RenderedRequest]
    replayed: ReplayResult
    fixed: list[LoggedRequest]  # the log with the chosen rewrites (the tools-first layout is the server's)
    families: list[FamilyProjection]


def project(
    requests: list[LoggedRequest],
    today: list[RenderedRequest],
    today_replay: ReplayResult,
    family_of: dict[int, str],
    session_of: dict[int, str],
    strip_reasoning: set[str],
    renderer: Renderer,
    replay: Replay,
) -> Projection:
    """The best fix per family for the requests `today` rendered (`family_of`, `session_of`: by request
    index), replayed by `replay`; `strip_reasoning`: the families where reasoning dropped from history
    broke a prompt."""
    names = list(dict.fromkeys(family_of[r.request.index] for r in today))
    rewritten = _rewrites(requests, today, family_of, session_of, strip_reasoning)
    plans = _Plans(today, rewritten, renderer, family_of)
    base = _rates(today, today_replay, family_of)
    candidates: dict[str, dict[Fix, float]] = {name: {} for name in names}
    results: dict[tuple[tuple[str, Fix | None], ...], tuple[list[RenderedRequest], ReplayResult]] = {}
    for fix in FIXES:
        choice = {name: fix if plans.changes(name, fix) else None for name in names}
        if not any(choice.values()):
            continue
        rendered = plans.render(choice)
        results[_key(choice)] = rendered, replay(rendered)
        rates = _rates(rendered, results[_key(choice)][1], family_of)
        for name, chosen in choice.items():
            if chosen is not None:
                candidates[name][chosen] = rates[name]
    chosen_fixes: dict[str, Fix | None] = {}
    for name in names:
        chosen_fixes[name] = _choose(candidates[name], base[name])
    rendered, replayed = today, today_replay
    while any(chosen_fixes.values()):
        key = _key(chosen_fixes)
        if key not in results:
            fixed = plans.render(chosen_fixes)
            results[key] = fixed, replay(fixed)
        rendered, replayed = results[key]
        rates = _rates(rendered, replayed, family_of)
        worse = [name for name, fix in chosen_fixes.items() if fix is not None and rates[name] < base[name]]
        if not worse:
            below = any(rates[name] < base[name] for name in names)
            if not below and _total_rate(rendered, replayed) >= _total_rate(today, today_replay):
                break
            # Another family's rate, or the log's (its prompts' lengths changed), fell: drop the least gain.
            worse = [min((n for n, f in chosen_fixes.items() if f), key=lambda n: rates[n] - base[n])]
        for name in worse:
            chosen_fixes[name] = None
        rendered, replayed = today, today_replay
    final = _rates(rendered, replayed, family_of)
    fixed_log = [
        rewritten.get(r.index, r) if rewrites(chosen_fixes.get(family_of.get(r.index, ""))) else r
        for r in requests
    ]
    families = [
        FamilyProjection(name, base[name], candidates[name], chosen_fixes[name], final[name])
        for name in names
    ]
    return Projection(rendered, replayed, fixed_log, families)


class _Plans:
    """Renders the log with a fix per family, knowing which fixes change which family."""

    def __init__(
        self,
        today: list[RenderedRequest],
        rewritten: dict[int, LoggedRequest],
        renderer: Renderer,
        family_of: dict[int, str],
    ) -> None:
        self._today = today
        self._rewritten = rewritten
        self._renderer = renderer
        self._family_of = family_of
        self._changes: dict[tuple[str, Fix], bool] = {}
        self._blocks: dict[str, bool] = {}

    def changes(self, family: str, fix: Fix) -> bool:
        """Whether `fix` changes any prompt of `family` (and every one still renders)."""
        key = (family, fix)
        if key not in self._changes:
            self._changes[key] = self._try(family, fix)
        return self._changes[key]

    def render(self, choice: dict[str, Fix | None]) -> list[RenderedRequest]:
        """The log's prompts with each family's fix (None: as today)."""
        return [self._one(r, choice[self._family_of[r.request.index]]) for r in self._today]

    def _try(self, family: str, fix: Fix) -> bool:
        members = [r for r in self._today if self._family_of[r.request.index] == family]
        if rewrites(fix) and not any(r.request.index in self._rewritten for r in members):
            return False
        if tools_first(fix) and not self._movable(members):
            return False
        try:
            return any(self._one(r, fix).prompt.token_ids != r.prompt.token_ids for r in members)
        except RenderError:
            return False  # a rewrite the server would refuse is no fix

    def _movable(self, members: list[RenderedRequest]) -> bool:
        """Whether tools-first would move a tool block: the server renders the template's order, and the
        template renders a block for some member's tools."""
        return any(
            self._renderer.layout_of(r.request) != "tools-first" and self._has_block(r) for r in members
        )

    def _has_block(self, request: RenderedRequest) -> bool:
        """Whether the template renders a tool block tools-first can move, for this request's tools."""
        tools = request.prompt.tools
        if not tools:
            return False
        key = json.dumps(tools, sort_keys=True, ensure_ascii=False)
        if key not in self._blocks:
            self._blocks[key] = find_tool_block(self._renderer.tokenizer, tools) is not None
        return self._blocks[key]

    def _one(self, request: RenderedRequest, fix: Fix | None) -> RenderedRequest:
        if fix is None:
            return request
        logged = request.request
        if rewrites(fix):
            logged = self._rewritten.get(logged.index, logged)
        served = self._renderer.layout_of(request.request)
        layout: Layout = "tools-first" if tools_first(fix) else served
        if logged is request.request and layout == served:
            return request
        return self._renderer.render(logged, layout)


def _rewrites(
    requests: list[LoggedRequest],
    today: list[RenderedRequest],
    family_of: dict[int, str],
    session_of: dict[int, str],
    strip_reasoning: set[str],
) -> dict[int, LoggedRequest]:
    """The requests each family's rewrite changes, by index (lines count as shared within a family)."""
    rendered = {r.request.index for r in today}
    members: dict[str, list[LoggedRequest]] = {}
    for request in requests:
        if request.index in rendered:
            members.setdefault(family_of[request.index], []).append(request)
    changed: dict[int, LoggedRequest] = {}
    for family, family_requests in members.items():
        fixed = fix_log(family_requests, session_of, strip_reasoning=family in strip_reasoning)
        for before, after in zip(family_requests, fixed, strict=True):
            if after.body != before.body:
                changed[before.index] = after
    return changed


def _choose(candidates: dict[Fix, float], today: float) -> Fix | None:
    """The first fix (in FIXES' order) within MIN_GAIN of the best, if the best gains MIN_GAIN."""
    best = max(candidates.values(), default=today)
    if best < today + MIN_GAIN:
        return None
    return next(fix for fix in FIXES if fix in candidates and candidates[fix] > best - MIN_GAIN)


def _key(choice: dict[str, Fix | None]) -> tuple[tuple[str, Fix | None], ...]:
    return tuple(sorted(choice.items(), key=lambda item: item[0]))


def _rates(
    rendered: Sequence[RenderedRequest], replayed: ReplayResult, family_of: dict[int, str]
) -> dict[str, float]:
    """Each family's hit rate (requests the pool could not hold do not count)."""
    totals: dict[str, list[int]] = {}
    for request, cached in zip(rendered, replayed.cached_tokens, strict=True):
        total = totals.setdefault(family_of[request.request.index], [0, 0])
        if cached is not None:
            total[0] += cached
            total[1] += len(request.prompt.token_ids)
    return {name: cached / prompt if prompt else 0.0 for name, (cached, prompt) in totals.items()}


def _total_rate(rendered: Sequence[RenderedRequest], replayed: ReplayResult) -> float:
    ran = [
        (len(r.prompt.token_ids), c)
        for r, c in zip(rendered, replayed.cached_tokens, strict=True)
        if c is not None
    ]
    total = sum(n for n, _ in ran)
    return sum(c for _, c in ran) / total if total else 0.0
