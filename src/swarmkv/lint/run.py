"""One lint of a request log: render, find breaks, replay today's prompts and the fixed ones, sum up."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from swarmkv.breaks.causes import CAUSES, Break, divergence
from swarmkv.choices import PromptLayout
from swarmkv.lint.analyze import BreakFinder
from swarmkv.lint.fix import fix_log
from swarmkv.lint.log_file import LoggedRequest, LogProblem, RefusedRequest
from swarmkv.lint.render import RenderedRequest, Renderer, RenderError
from swarmkv.lint.replay import ReplayRequest, ReplayResult, replay
from swarmkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestResult:
    """One request's line of the report."""

    index: int
    line: int
    session: str
    prompt_tokens: int
    cached_tokens: int | None  # None: the KV pool cannot hold the prompt
    brk: Break | None
    hidden: tuple[Break, ...]  # the breaks behind a volatile value's, were the values equal


@dataclass(frozen=True)
class SessionResult:
    """One session's (agent's) line of the report."""

    session: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    num_breaks: int
    kv_bytes: int
    private_kv_bytes: int


@dataclass(frozen=True)
class LintResult:
    """Everything the report shows, and the fixed log."""

    requests: list[RequestResult]
    sessions: list[SessionResult]
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
    finder = BreakFinder(tokenizer, renderer.encode)
    findings = [finder.add(r) for r in rendered]
    session_of = {f.rendered.request.index: f.session for f in findings}
    today = replay(_replayed(rendered, session_of), page_size, page_bytes, kv_cache_bytes, check)
    causes = Counter(b.cause for f in findings for b in (f.brk, *f.hidden) if b is not None)
    fixed = fix_log(requests, session_of, strip_reasoning=causes["history_rewrite"] > 0)
    fixed_rendered, _ = _render_all(renderer, [r for r in fixed if r.index in session_of])
    projected = replay(_replayed(fixed_rendered, session_of), page_size, page_bytes, kv_cache_bytes, check)
    results = [
        RequestResult(
            f.rendered.request.index,
            f.rendered.request.line,
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
        skipped=sorted([*(problems or []), *skipped], key=lambda p: p.line),
        hit_rate=_hit_rate([len(r.prompt.token_ids) for r in rendered], today),
        projected_hit_rate=_hit_rate([len(r.prompt.token_ids) for r in fixed_rendered], projected),
        shared_head_tokens=_shared_head([r.prompt.token_ids for r in rendered]),
        kv_bytes=today.kv_bytes,
        projected_kv_bytes=projected.kv_bytes,
        peak_kv_bytes=today.peak_kv_bytes,
        projected_peak_kv_bytes=projected.peak_kv_bytes,
        page_bytes=page_bytes,
        causes={cause: causes[cause] for cause in CAUSES},
        fixed=fixed,
        refused=list(refused or []),
    )


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
            len(rs),
            sum(r.prompt_tokens for r in rs),
            sum(r.cached_tokens or 0 for r in rs),
            sum(r.brk is not None for r in rs),
            replayed.group_kv_bytes.get(session, 0),
            replayed.group_private_kv_bytes.get(session, 0),
        )
        for session, rs in rows.items()
    ]
