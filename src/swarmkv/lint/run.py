"""One lint of a request log: render, group into families, find breaks, replay today's prompts and the
fixed ones (`projection.py`), sum up per family and for the log."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from swarmkv.breaks.causes import CAUSES, Break, divergence
from swarmkv.choices import PromptLayout
from swarmkv.lint.analyze import BreakFinder, Finding
from swarmkv.lint.families import Families, Family
from swarmkv.lint.log_file import LoggedRequest, LogProblem, RefusedRequest
from swarmkv.lint.projection import FamilyProjection, Fix, project
from swarmkv.lint.render import RenderedRequest, Renderer, RenderError
from swarmkv.lint.replay import ReplayRequest, ReplayResult, replay
from swarmkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestResult:
    """One request's line of the report."""

    index: int
    line: int
    family: str
    session: str
    prompt_tokens: int
    cached_tokens: int | None  # None: the KV pool cannot hold the prompt
    brk: Break | None
    hidden: tuple[Break, ...]  # the breaks behind a volatile value's, were the values equal


@dataclass(frozen=True)
class SessionResult:
    """One session's (agent's) line of the report."""

    session: str
    family: str  # its first request's
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    num_breaks: int
    kv_bytes: int
    private_kv_bytes: int


@dataclass(frozen=True)
class FamilyResult:
    """One family's (harness's, system prompt's) part of the report: today, each fix, the one chosen."""

    family: Family
    num_requests: int
    sessions: list[str]
    prompt_tokens: int
    cached_tokens: int
    shared_head_tokens: int  # tokens every prompt of the family starts with
    causes: dict[str, int]  # the causes its breaks have, hidden ones too (only those found)
    hit_rate: float
    candidates: dict[Fix, float]  # the hit rate with each fix that changes its prompts
    fix: Fix | None  # the fix that helps most; None: none helps
    projected_hit_rate: float  # never below hit_rate


@dataclass(frozen=True)
class LintResult:
    """Everything the report shows, and the fixed log."""

    requests: list[RequestResult]
    sessions: list[SessionResult]
    families: list[FamilyResult]
    skipped: list[LogProblem]  # malformed lines and requests that did not render
    hit_rate: float
    projected_hit_rate: float
    shared_head_tokens: int
    kv_bytes: int
    projected_kv_bytes: int
    peak_kv_bytes: int
    projected_peak_kv_bytes: int
    page_bytes: int
    causes: dict[str, int]
    fixed: list[LoggedRequest]
    refused: list[RefusedRequest] = field(default_factory=list)  # requests the server refused, in log order


def lint_log(
    requests: list[LoggedRequest],
    tokenizer: Tokenizer,
    page_size: int,
    page_bytes: int,
    kv_cache_bytes: int | None = None,
    problems: list[LogProblem] | None = None,
    max_model_len: int | None = None,
    check: bool = False,
    prompt_layout: PromptLayout = "auto",
    refused: list[RefusedRequest] | None = None,
) -> LintResult:
    """Lint `requests` (in log order) for a model with this tokenizer and KV page size in bytes. `problems`
    are the log's malformed lines, reported with the rest; prompts the server refuses for `max_model_len`
    are skipped like them; `check` asserts the replays' KV books; `refused` (the requests the server
    refused) are reported, never replayed."""
    renderer = Renderer(tokenizer, max_model_len, prompt_layout)
    rendered, skipped = _render_all(renderer, requests)
    families = Families()
    finder = BreakFinder(tokenizer, renderer.encode)
    findings = [finder.add(r, families.assign(r)) for r in rendered]
    session_of = {f.rendered.request.index: f.session for f in findings}
    family_of = {f.rendered.request.index: f.family.name for f in findings}

    def run_replay(prompts: list[RenderedRequest]) -> ReplayResult:
        return replay(_replayed(prompts, session_of), page_size, page_bytes, kv_cache_bytes, check)

    today = run_replay(rendered)
    causes = Counter(b.cause for f in findings for b in _breaks(f))
    strip = {f.family.name for f in findings for b in _breaks(f) if b.cause == "history_rewrite"}
    projection = project(requests, rendered, today, family_of, session_of, strip, renderer, run_replay)
    results = [
        RequestResult(
            f.rendered.request.index,
            f.rendered.request.line,
            f.family.name,
            f.session,
            len(f.rendered.prompt.token_ids),
            cached,
            f.brk,
            f.hidden,
        )
        for f, cached in zip(findings, today.cached_tokens, strict=True)
    ]
    return LintResult(
        requests=results,
        sessions=_sessions(results, today),
        families=_families(families.families, findings, results, projection.families),
        skipped=sorted([*(problems or []), *skipped], key=lambda p: p.line),
        hit_rate=_hit_rate([len(r.prompt.token_ids) for r in rendered], today),
        projected_hit_rate=_hit_rate(
            [len(r.prompt.token_ids) for r in projection.rendered], projection.replayed
        ),
        shared_head_tokens=_shared_head([r.prompt.token_ids for r in rendered]),
        kv_bytes=today.kv_bytes,
        projected_kv_bytes=projection.replayed.kv_bytes,
        peak_kv_bytes=today.peak_kv_bytes,
        projected_peak_kv_bytes=projection.replayed.peak_kv_bytes,
        page_bytes=page_bytes,
        causes={cause: causes[cause] for cause in CAUSES},
        fixed=projection.fixed,
        refused=list(refused or []),
    )


def _breaks(finding: Finding) -> list[Break]:
    return [b for b in (finding.brk, *finding.hidden) if b is not None]


def _families(
    families: list[Family],
    findings: list[Finding],
    results: list[RequestResult],
    projections: list[FamilyProjection],
) -> list[FamilyResult]:
    projected = {p.family: p for p in projections}
    rows = []
    for family in families:
        mine = [(f, r) for f, r in zip(findings, results, strict=True) if f.family.name == family.name]
        if not mine:
            continue
        p = projected[family.name]
        causes = Counter(b.cause for f, _ in mine for b in _breaks(f))
        rows.append(
            FamilyResult(
                family=family,
                num_requests=len(mine),
                sessions=list(dict.fromkeys(r.session for _, r in mine)),
                prompt_tokens=sum(r.prompt_tokens for _, r in mine),
                cached_tokens=sum(r.cached_tokens or 0 for _, r in mine),
                shared_head_tokens=_shared_head([f.rendered.prompt.token_ids for f, _ in mine]),
                causes={cause: causes[cause] for cause in CAUSES if causes[cause]},
                hit_rate=p.hit_rate,
                candidates=p.candidates,
                fix=p.fix,
                projected_hit_rate=p.projected_hit_rate,
            )
        )
    return rows


def _render_all(
    renderer: Renderer, requests: list[LoggedRequest]
) -> tuple[list[RenderedRequest], list[LogProblem]]:
    rendered, skipped = [], []
    for request in requests:
        try:
            rendered.append(renderer.render(request))
        except RenderError as exc:
            skipped.append(LogProblem(request.line, f"the server would refuse it: {exc}"))
    return rendered, skipped


def _replayed(requests: list[RenderedRequest], session_of: dict[int, str]) -> list[ReplayRequest]:
    return [
        ReplayRequest(r.prompt.token_ids, r.cache_salt, r.session_id, session_of[r.request.index])
        for r in requests
    ]


def _hit_rate(prompt_tokens: list[int], result: ReplayResult) -> float:
    ran = [(n, c) for n, c in zip(prompt_tokens, result.cached_tokens, strict=True) if c is not None]
    total = sum(n for n, _ in ran)
    return sum(c for _, c in ran) / total if total else 0.0


def _shared_head(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with."""
    if not prompts:
        return 0
    first, shared = prompts[0], len(prompts[0])
    for tokens in prompts[1:]:
        shared = min(shared, divergence(first[:shared], tokens))
    return shared


def _sessions(results: list[RequestResult], replayed: ReplayResult) -> list[SessionResult]:
    rows: dict[str, list[RequestResult]] = {}
    for r in results:
        rows.setdefault(r.session, []).append(r)
    return [
        SessionResult(
            session,
            rs[0].family,
            len(rs),
            sum(r.prompt_tokens for r in rs),
            sum(r.cached_tokens or 0 for r in rs),
            sum(r.brk is not None for r in rs),
            replayed.group_kv_bytes.get(session, 0),
            replayed.group_private_kv_bytes.get(session, 0),
        )
        for session, rs in rows.items()
    ]
