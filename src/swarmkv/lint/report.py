"""The lint's output: a `rich` report for people, or one JSON object for tools."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from swarmkv.breaks.causes import Break
from swarmkv.lint.run import LintResult

MAX_ROWS_PER_CAUSE = 8


def to_json(result: LintResult) -> dict[str, Any]:
    """The `--json` object: per request, per session, skipped lines, and the summary."""
    prompt_tokens = sum(r.prompt_tokens for r in result.requests)
    cached_tokens = sum(r.cached_tokens or 0 for r in result.requests)
    return {
        "requests": [
            {
                "index": r.index,
                "line": r.line,
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
                "requests": s.num_requests,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "breaks": s.num_breaks,
                "kv_bytes": s.kv_bytes,
                "private_kv_bytes": s.private_kv_bytes,
            }
            for s in result.sessions
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
    return None if found is None else {"offset": found.offset, "cause": found.cause, "text": found.text}


def print_report(result: LintResult, title: str, console: Console | None = None) -> None:
    """The human report: sessions, breaks with their evidence, skipped lines, the summary."""
    console = console or Console()
    console.print(Text(title, style="bold"))
    sessions = Table(title="sessions", title_justify="left")
    for name in ("session", "reqs", "prompt", "cached", "hit", "breaks", "KV", "private"):
        sessions.add_column(name, justify="left" if name == "session" else "right", no_wrap=True)
    for s in result.sessions:
        rate = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        sessions.add_row(
            s.session,
            str(s.num_requests),
            f"{s.prompt_tokens:,}",
            f"{s.cached_tokens:,}",
            f"{rate:.1%}",
            str(s.num_breaks),
            _size(s.kv_bytes),
            _size(s.private_kv_bytes),
        )
    console.print(sessions)
    _print_breaks(result, console)
    for problem in result.skipped:
        console.print(Text(f"skipped line {problem.line}: {problem.message}", style="yellow"))
    _print_refused(result, console)
    found = ", ".join(f"{cause} {n}" for cause, n in result.causes.items() if n) or "none"
    console.print(
        Text.assemble(
            ("hit rate ", "bold"),
            f"{result.hit_rate:.1%} today, {result.projected_hit_rate:.1%} with the fix; ",
            ("shared head ", "bold"),
            f"{result.shared_head_tokens:,} tokens\n",
            ("KV held ", "bold"),
            f"{_size(result.kv_bytes)} today (peak {_size(result.peak_kv_bytes)}), "
            f"{_size(result.projected_kv_bytes)} with the fix (peak {_size(result.projected_peak_kv_bytes)})\n",
            ("causes ", "bold"),
            found,
        )
    )


def _print_breaks(result: LintResult, console: Console) -> None:
    """The breaks table, at most MAX_ROWS_PER_CAUSE of each cause (the JSON lists them all)."""
    rows = [(r, b, b is not r.brk) for r in result.requests for b in (r.brk, *r.hidden) if b is not None]
    if not rows:
        console.print("no prefix breaks: every prompt continues what it should share")
        return
    table = Table(
        title="prefix breaks (hidden: behind the first, were its values equal)", title_justify="left"
    )
    for name in ("request", "line", "session", "offset", "cause", "evidence"):
        right = name in ("request", "line", "offset")
        table.add_column(name, justify="right" if right else "left", no_wrap=name != "evidence")
    shown: Counter[str] = Counter()
    for r, b, hidden in rows:
        shown[b.cause] += 1
        if shown[b.cause] <= MAX_ROWS_PER_CAUSE:
            cause = f"{b.cause} (hidden)" if hidden else b.cause
            table.add_row(str(r.index), str(r.line), r.session, str(b.offset), cause, Text(repr(b.text)))
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


def _size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
