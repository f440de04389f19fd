"""Request logs as `swarmkv serve --log-requests` writes them: one JSON object a line, read and written back.

A line is `{"time": unix seconds, "session_id": str | null, "route": "/v1/chat/completions" |
"/v1/completions", "body": {...}}`, or a bare request body (no "body" key), whose route follows from its
fields ("messages": chat, "prompt": completions). A line with a "status" is a request the server refused
(`{"time", "session_id", "route", "status", "error", "body"}`): not replayed, counted per route. A line's
`"capped"` lists the body's strings the server cut to their head (`{"path", "chars", "kept_chars", "sha256"}`):
such a request is replayed from what was kept, and lint says so. A line with a "request_id" and "cached_tokens"
but no body is a request's end (`{"time", "request_id", "prompt_tokens", "cached_tokens", "pin_computed_tokens"}`):
what the server's prefix cache served it, read as `LogFile.ended` and never replayed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from swarmkv.api.layout import Api
from swarmkv.api.paths import CHAT_ROUTE, COMPLETIONS_ROUTE
from swarmkv.errors import SwarmkvError

ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE)


API_NAMES: tuple[Api, ...] = ("chat", "messages", "responses")


class LintInputError(SwarmkvError, ValueError):
    """The request log cannot be linted: missing, empty, or malformed where `--strict` refuses it."""


@dataclass(frozen=True)
class LoggedRequest:
    """One request of the log, in log order."""

    index: int  # among the log's requests, from 0
    line: int  # in the file, from 1
    route: str
    body: dict[str, Any]
    session_id: str | None = None
    time: float | None = None
    bare: bool = False  # the line was the body alone
    api: Api = "chat"  # the API it came in on: a Messages or Responses request is logged as its chat body
    tenant: str | None = None  # the key's tenant (`--api-keys`): tenants share no cache, sessions or salts
    # The strings the server's log cut to their head, as the line lists them ({"path", "chars", ...}).
    capped: tuple[dict[str, Any], ...] = ()

    def capped_note(self) -> str | None:
        """What the log cut of this request, in words; None when nothing was."""
        if not self.capped:
            return None
        fields = ", ".join(
            f"{c.get('path')} ({c.get('chars')} characters, {c.get('kept_chars')} kept)"
            for c in self.capped[:3]
        )
        more = f" and {len(self.capped) - 3} more" if len(self.capped) > 3 else ""
        return f"the server's log cut {fields}{more}: its prompt is replayed from what was kept"

    @property
    def is_chat(self) -> bool:
        """Whether it went to /v1/chat/completions."""
        return self.route == CHAT_ROUTE

    def with_body(self, body: dict[str, Any]) -> LoggedRequest:
        """The same request with another body (a rewrite of it)."""
        return replace(self, body=body)

    def to_json(self) -> dict[str, Any]:
        """The line as the server writes it (the body alone when it was read so)."""
        if self.bare:
            return self.body
        record: dict[str, Any] = {
            "time": self.time,
            "session_id": self.session_id,
            "route": self.route,
            "body": self.body,
        }
        if self.api != "chat":
            record["api"] = self.api
        if self.tenant is not None:
            record["tenant"] = self.tenant
        if self.capped:
            record["capped"] = list(self.capped)
        return record


@dataclass(frozen=True)
class RefusedRequest:
    """A request the server refused, as it logged it: where it went, its status and its error."""

    line: int  # in the file, from 1
    route: str
    status: int
    error: str


@dataclass(frozen=True)
class EndedRequest:
    """A request's end, as the server logged it: its prompt's tokens and those its prefix cache served it."""

    line: int  # in the file, from 1
    request_id: str
    prompt_tokens: int
    cached_tokens: int  # served by the prefix cache at admission
    pin_computed_tokens: int = 0  # of those, computed by the request's own pins just before it

    @property
    def read_tokens(self) -> int:
        """The prompt tokens it found cached that its own pins did not compute: what was there before it."""
        return self.cached_tokens - self.pin_computed_tokens


@dataclass(frozen=True)
class LogFile:
    """A read log: its requests in log order, its malformed lines, the requests the server refused, and the
    ends of those it ran."""

    requests: list[LoggedRequest]
    problems: list[LogProblem]
    refused: list[RefusedRequest]
    ended: list[EndedRequest] = field(default_factory=list)


@dataclass(frozen=True)
class LogProblem:
    """A line that was skipped, and why."""

    line: int
    message: str


def read_log(path: str | Path, strict: bool = False) -> tuple[list[LoggedRequest], list[LogProblem]]:
    """The log's requests and its malformed lines; with `strict` the first malformed line raises."""
    log = read_log_file(path, strict)
    return log.requests, log.problems


def read_log_file(path: str | Path, strict: bool = False) -> LogFile:
    """The log's requests, malformed lines and refused requests; with `strict` a malformed line raises."""
    requests: list[LoggedRequest] = []
    problems: list[LogProblem] = []
    refused: list[RefusedRequest] = []
    ended: list[EndedRequest] = []
    with Path(path).open(encoding="utf-8", errors="replace") as file:
        for number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            try:
                parsed = _parse_line(raw, len(requests), number)
            except ValueError as exc:
                if strict:
                    raise LintInputError(f"{path}:{number}: {exc}") from exc
                problems.append(LogProblem(number, str(exc)))
                continue
            if isinstance(parsed, RefusedRequest):
                refused.append(parsed)
            elif isinstance(parsed, EndedRequest):
                ended.append(parsed)
            else:
                requests.append(parsed)
    return LogFile(requests, problems, refused, ended)


def write_log(path: str | Path, requests: list[LoggedRequest]) -> None:
    """Write requests in the log's line format."""
    with Path(path).open("w", encoding="utf-8") as file:
        for request in requests:
            # ASCII, as the server writes it: a lone surrogate in a logged body stays escaped.
            file.write(json.dumps(request.to_json(), separators=(",", ":")) + "\n")


def _parse_line(raw: str, index: int, line: int) -> LoggedRequest | RefusedRequest | EndedRequest:
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    if "status" in record:
        return _refused(record, line)
    if "body" not in record and "request_id" in record and "cached_tokens" in record:
        return _ended(record, line)
    if "body" not in record:
        return LoggedRequest(index, line, _route_of(record), record, bare=True)
    body, route, session_id = record["body"], record.get("route"), record.get("session_id")
    if not isinstance(body, dict):
        raise ValueError("'body' must be a JSON object")
    route = _route_of(body) if route is None else route
    if route not in ROUTES:
        raise ValueError(f"'route' must be one of {', '.join(ROUTES)}, got {route!r}")
    if session_id is not None and not isinstance(session_id, str):
        raise ValueError("'session_id' must be a string or null")
    when = record.get("time")
    if when is not None and (not isinstance(when, int | float) or isinstance(when, bool)):
        raise ValueError("'time' must be a number")
    api = record.get("api", "chat")
    if api not in API_NAMES:
        raise ValueError(f"'api' must be one of {', '.join(API_NAMES)}, got {api!r}")
    tenant = record.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError("'tenant' must be a string or null")
    capped = record.get("capped", [])
    if not isinstance(capped, list) or not all(isinstance(c, dict) for c in capped):
        raise ValueError("'capped' must be an array of objects")
    when_s = None if when is None else float(when)
    return LoggedRequest(
        index, line, route, body, session_id, when_s, api=api, tenant=tenant, capped=tuple(capped)
    )


def _refused(record: dict[str, Any], line: int) -> RefusedRequest:
    status, route, error = record["status"], record.get("route"), record.get("error")
    if not isinstance(status, int) or isinstance(status, bool):
        raise ValueError("'status' must be an integer")
    if not isinstance(route, str):
        raise ValueError("a refused request's 'route' must be a string")
    return RefusedRequest(line, route, status, error if isinstance(error, str) else "")


def _ended(record: dict[str, Any], line: int) -> EndedRequest:
    request_id = record["request_id"]
    counts = [record.get(key, 0) for key in ("prompt_tokens", "cached_tokens", "pin_computed_tokens")]
    if not isinstance(request_id, str):
        raise ValueError("'request_id' must be a string")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise ValueError("an end line's token counts must be integers >= 0")
    return EndedRequest(line, request_id, *counts)


def _route_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return CHAT_ROUTE
    if "prompt" in body:
        return COMPLETIONS_ROUTE
    raise ValueError("a request body needs 'messages' (chat) or 'prompt' (completions)")
