"""The lint's output: a `rich` report for people, or one JSON object for tools."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from swarmkv.breaks.causes import Break
from swarmkv.lint.names import short_names
from swarmkv.lint.projection import MIN_GAIN, rewrites, tools_first
from swarmkv.lint.run import FamilyResult, LintResult, RequestResult

MAX_ROWS_PER_CAUSE = 8


def to_json(result: LintResult) -> dict[str, Any]:
    """The `--json` object: per request, per session, per family, skipped lines, and the summary."""
    prompt_tokens = sum(r.prompt_tokens for r in result.requests)
    cached_tokens = sum(r.cached_tokens or 0 for r in result.requests)
    names = short_names(s.session for s in result.sessions)
    return {
        "requests": [
            {
                "index": r.index,
                "line": r.line,
                "family": r.family,
                "session": r.session,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "break": _break(r.brk),
                "hidden_breaks": [_break(b) for b in r.hidden],
            }
            for r in result.requests
        ],
        "sessions": [
            {
                "session": s.session,
                "name": names[s.session],
                "family": s.family,
                "requests": s.num_requests,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "breaks": s.num_breaks,
                "kv_bytes": s.kv_bytes,
                "private_kv_bytes": s.private_kv_bytes,
            }
            for s in result.sessions
        ],
        "families": [
            {
                "family": f.family.name,
                "route": f.family.route,
                "description": f.family.description,
                "tools": f.family.num_tools,
                "requests": f.num_requests,
                "sessions": f.sessions,
                "prompt_tokens": f.prompt_tokens,
                "cached_tokens": f.cached_tokens,
                "shared_head_tokens": f.shared_head_tokens,
                "causes": f.causes,
                "hit_rate": f.hit_rate,
                "fixes": f.candidates,
                "fix": f.fix,
                "projected_hit_rate": f.projected_hit_rate,
            }
            for f in result.families
        ],
        "skipped": [{"line": p.line, "message": p.message} for p in result.skipped],
        "refused": [
            {"line": r.line, "route": r.route, "status": r.status, "error": r.error} for r in result.refused
        ],
        "summary": {
            "hit_rate": result.hit_rate,
            "projected_hit_rate": result.projected_hit_rate,
            "shared_head_tokens": result.shared_head_tokens,
            "kv_bytes": result.kv_bytes,
            "projected_kv_bytes": result.projected_kv_bytes,
            "causes": result.causes,
            "peak_kv_bytes": result.peak_kv_bytes,
            "projected_peak_kv_bytes": result.projected_peak_kv_bytes,
            "page_bytes": result.page_bytes,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "breaks": sum(result.causes.values()),
            "refused": refused_per_route(result),
        },
    }


def _break(found: Break | None) -> dict[str, Any] | None:
    if found is None:
        return None
    fields = {"offset": found.offset, "cause": found.cause, "text": found.text}
    return {**fields, "detail": found.detail} if found.detail else fields


def print_report(result: LintResult, title: str, console: Console | None = None) -> None:
    """The human report, readable at 80 columns: per family its sessions, its breaks with their evidence
    and its fixes; then skipped lines, refused requests and the summary."""
    console = console or Console()
    console.print(Text(title, style="bold"))
    names = short_names(s.session for s in result.sessions)
    for family in result.families:
        _print_family(result, family, names, console)
    if not any(r.brk is not None for r in result.requests):
        console.print("no prefix breaks: every prompt continues what it should share")
    for problem in result.skipped:
        console.print(Text(f"skipped line {problem.line}: {problem.message}", style="yellow"))
    _print_refused(result, console)
    found = ", ".join(f"{cause} {n}" for cause, n in result.causes.items() if n) or "none"
    fixes = ", ".join(f"{f.family.name} {f.fix or 'none'}" for f in result.families)
    console.print(
        Text.assemble(
            ("\nhit rate ", "bold"),
            f"{result.hit_rate:.1%} today, {result.projected_hit_rate:.1%} with the fix ({fixes}); ",
            ("shared head ", "bold"),
            f"{result.shared_head_tokens:,} tokens\n",
            ("KV held ", "bold"),
            f"{_size(result.kv_bytes)} today (peak {_size(result.peak_kv_bytes)}), "
            f"{_size(result.projected_kv_bytes)} with the fix (peak {_size(result.projected_peak_kv_bytes)})\n",
            ("causes ", "bold"),
            found,
        )
    )


def _print_family(result: LintResult, family: FamilyResult, names: dict[str, str], console: Console) -> None:
    """One family: what it is, its sessions, its breaks, its hit rate today and with each fix."""
    f = family.family
    console.print(
        Text.assemble(
            (f"\nfamily {f.name}", "bold"),
            f": {f.description!r}, {_count(f.num_tools, 'tool')}; {_count(family.num_requests, 'request')}, "
            f"{_count(len(family.sessions), 'session')}, shared head {family.shared_head_tokens:,} tokens",
        )
    )
    sessions = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("session", "reqs", "prompt", "cached", "hit", "breaks", "KV", "private"):
        sessions.add_column(name, justify="left" if name == "session" else "right", no_wrap=True)
    requests = [r for r in result.requests if r.family == f.name]
    held = {s.session: s for s in result.sessions}
    for session in family.sessions:
        mine = [r for r in requests if r.session == session]
        prompt = sum(r.prompt_tokens for r in mine)
        cached = sum(r.cached_tokens or 0 for r in mine)
        sessions.add_row(
            names[session],
            str(len(mine)),
            f"{prompt:,}",
            f"{cached:,}",
            f"{cached / prompt if prompt else 0.0:.1%}",
            str(sum(r.brk is not None for r in mine)),
            _size(held[session].kv_bytes),
            _size(held[session].private_kv_bytes),
        )
    console.print(sessions)
    _print_breaks(requests, names, console)
    console.print(_fix_text(family))


def _fix_text(family: FamilyResult) -> Text:
    """Its hit rate today and with each fix that changes its prompts, and the fix that helps most (with
    the server's tools-first layout alone too, when that helps and the best fix is a rewrite)."""
    rates = ", ".join(f"{_FIX_NAMES[fix]} {rate:.1%}" for fix, rate in family.candidates.items())
    text = Text.assemble(("hit rate ", "bold"), f"{family.hit_rate:.1%} today")
    if rates:
        text.append(f"; with {rates}")
    text.append("\n")
    if family.fix is None:
        if not family.causes:
            reason = "no breaks"
        elif not family.candidates:
            reason = "no fix changes its prompts"
        else:
            reason = f"no fix gains {MIN_GAIN:.0%} of its prompts' tokens"
        return text.append(Text.assemble(("fix: ", "bold"), f"none helps ({reason})"))
    how = []
    if rewrites(family.fix):
        how.append(f"rewrite the prompts ({_rewrite_text(family.causes)}; --fix writes it)")
    if tools_first(family.fix):
        how.append("serve with --prompt-layout tools-first")
    text.append(Text.assemble(("fix: ", "bold"), f"{' and '.join(how)}: {family.projected_hit_rate:.1%}"))
    server_alone = family.candidates.get("tools-first")
    if (
        family.fix != "tools-first"
        and server_alone is not None
        and server_alone >= family.hit_rate + MIN_GAIN
    ):
        text.append(f"\n     or, on the server alone: --prompt-layout tools-first: {server_alone:.1%}")
    return text


_FIX_NAMES = {"rewrite": "the rewrite", "tools-first": "tools-first", "rewrite+tools-first": "both"}


def _rewrite_text(causes: dict[str, int]) -> str:
    """What the rewrite changes, for the causes found."""
    parts = []
    if causes.keys() & {"per_instance_env", "private_before_shared", "system_edit"}:
        parts.append("per-instance lines after the shared head")
    if causes.keys() & {"timestamp", "random_id"}:
        parts.append("dates and ids to the end")
    if causes.keys() & {"tool_order", "tool_set"}:
        parts.append("tools sorted by name")
    if "history_rewrite" in causes:
        parts.append("no reasoning in history")
    return ", ".join(parts) or "a stable head"


def _print_breaks(requests: list[RequestResult], names: dict[str, str], console: Console) -> None:
    """A family's breaks, at most MAX_ROWS_PER_CAUSE of each cause (the JSON lists them all)."""
    rows = [(r, b, b is not r.brk) for r in requests for b in (r.brk, *r.hidden) if b is not None]
    if not rows:
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("line", "session", "offset"):
        table.add_column(name, justify="right" if name != "session" else "left", no_wrap=True)
    table.add_column("break: cause and evidence", overflow="fold")
    shown: Counter[str] = Counter()
    for r, b, hidden in rows:
        shown[b.cause] += 1
        if shown[b.cause] <= MAX_ROWS_PER_CAUSE:
            cause = f"{b.cause} (hidden)" if hidden else b.cause
            evidence = b.detail or repr(b.text)
            table.add_row(str(r.line), names[r.session], f"{b.offset:,}", Text(f"{cause}: {evidence}"))
    console.print(table)
    more = {cause: n - MAX_ROWS_PER_CAUSE for cause, n in shown.items() if n > MAX_ROWS_PER_CAUSE}
    if more:
        listed = ", ".join(f"{cause} {n}" for cause, n in more.items())
        console.print(f"... {sum(more.values())} more breaks not shown ({listed}); --json lists every one")


def refused_per_route(result: LintResult) -> dict[str, int]:
    """How many requests the server refused on each route, in the order the log first names them."""
    return dict(Counter(r.route for r in result.refused))


def _print_refused(result: LintResult, console: Console) -> None:
    """The refused requests per route, then each (at most MAX_ROWS_PER_CAUSE; the JSON lists them all)."""
    if not result.refused:
        return
    per_route = ", ".join(f"{route} {n}" for route, n in refused_per_route(result).items())
    console.print(Text.assemble(("refused ", "bold"), f"{len(result.refused)} requests ({per_route})"))
    for r in result.refused[:MAX_ROWS_PER_CAUSE]:
        console.print(Text(f"refused line {r.line}: {r.route} {r.status}: {r.error}", style="yellow"))
    if len(result.refused) > MAX_ROWS_PER_CAUSE:
        console.print(f"... {len(result.refused) - MAX_ROWS_PER_CAUSE} more refused; --json lists every one")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
