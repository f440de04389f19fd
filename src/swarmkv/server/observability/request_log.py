"""`swarmkv serve --log-requests FILE.jsonl`: every generation request's body, one JSON line each.

A line is `{"time": unix seconds, "session_id": str | null, "route": "/v1/chat/completions" |
"/v1/completions", "body": the request's JSON object as received}`, plus `"api": "messages" | "responses"`
for a request that came in on those APIs, logged as the chat body it runs as (the server lays out its
prompt by that API: `--prompt-layout auto`), and `"tenant"` under `--api-keys` (tenants share no cache), for each
request the server ran (logged once it was rendered and queued), and its engine request's `"request_id"` (the
`X-Request-Id` header of its answer). When such a request ends, a line `{"time", "request_id", "prompt_tokens",
"cached_tokens", "pin_computed_tokens"}` follows: its prompt's tokens, those the prefix cache served it at
admission (the server's own count), and those of them its own `cache_control` pins computed just before it (a
Messages request's; 0 for others), so `cached_tokens - pin_computed_tokens` is what it read that was there
before it. A request cut short (its client left) has no end line. (`swarmkv_prefix_hit_tokens_total` adds the
same `cached_tokens` for a request of no session; for a session's later turn it adds only the positions its
session had not processed.) A request the server refused (a 4xx) is a line
`{"time", "session_id": null, "route": the path it was sent to, "status": the HTTP status, "error": the
message, "tenant", "body": its JSON as received, its text when it is not JSON, or null}` instead: each request
has one line.

Lines are bounded (`log_entry.py`): a string of a body is cut to its head past a cap (the prompt's length for
a request that ran, 1,024 characters for a refused one), and the line's `"capped"` lists each cut field's
path, whole length and SHA-256; a refused line is at most 64 KiB, its body past that named by `"body_bytes"`
and `"body_sha256"` alone. The file rotates by size: past `max_bytes` it becomes FILE.1 (FILE.1 becomes
FILE.2, ...), and `NUM_FILES_KEPT` files are kept in all.

The file holds prompts in clear, so a new one is created readable by its owner only (0600); an existing
file keeps its mode (its owner's choice: a 0640 for a group that runs lint), with a warning when users
other than its owner can read it. Lines are ASCII (JSON's escapes), so a body holding text that is not
valid Unicode (a lone surrogate) is written escaped, never refused by the encoder. The file is opened in
append mode; each line goes out in one `write` on an `O_APPEND` descriptor, under a lock, so lines from
concurrent requests never interleave. `swarmkv lint` reads these files.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

from swarmkv.server.config import ServerConfig
from swarmkv.server.observability.log_entry import (
    REFUSED_FIELD_CHARS,
    cap_strings,
    refused_line,
    to_line,
    with_cut,
)

log = logging.getLogger(__name__)


# The live file and its rotated copies (FILE.1, FILE.2).
NUM_FILES_KEPT = 3


class RequestLog:
    """An append-only JSON-lines file of request bodies, rotated by size; safe to write from any thread."""

    def __init__(self, path: Path, max_bytes: int = ServerConfig.log_requests_max_bytes) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._fd: int | None = self._open()
        mode = stat.S_IMODE(os.fstat(self._fd).st_mode)
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning(
                "the request log %s holds prompts in clear and other users can read it (mode %04o): "
                "chmod 600 it",
                path,
                mode,
            )
        self._lock = threading.Lock()

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ValueError(f"cannot open the request log {str(self.path)!r}: {exc.strerror}") from exc

    def write(
        self,
        route: str,
        session_id: str | None,
        body: dict[str, Any],
        api: str | None = None,
        tenant: str | None = None,
        max_field_chars: int | None = None,
        request_id: str | None = None,
    ) -> None:
        """Append one request as one whole line; `api` names the API it came in on when its body was
        translated (a Messages or Responses request, logged as the chat request it runs as), `tenant` the
        key's tenant under `--api-keys`, `request_id` its engine request's id; strings past `max_field_chars`
        are cut (None: none is)."""
        record: dict[str, Any] = {"time": time.time(), "session_id": session_id, "route": route}
        if request_id is not None:
            record["request_id"] = request_id
        if api is not None:
            record["api"] = api
        if tenant is not None:
            record["tenant"] = tenant
        capped = cap_strings(body, max_field_chars) if max_field_chars is not None else None
        try:
            line = to_line({**record, **(with_cut(capped) if capped is not None else {"body": body})})
        except RecursionError:  # a field nested deeper than the encoder reaches from here
            line = to_line({**record, "body": None, "unlogged": "the body nests too deeply to log"})
        self._append(line)

    def write_ended(
        self, request_id: str, num_prompt_tokens: int, num_cached_tokens: int, num_pin_computed_tokens: int
    ) -> None:
        """Append a request's end: its prompt's tokens, those the prefix cache served it at admission, and
        those of them its own pins computed just before."""
        record = {"time": time.time(), "request_id": request_id, "prompt_tokens": num_prompt_tokens}
        counts = {"cached_tokens": num_cached_tokens, "pin_computed_tokens": num_pin_computed_tokens}
        self._append(to_line({**record, **counts}))

    def write_refused(
        self,
        route: str,
        status: int,
        error: str,
        body: Any,
        tenant: str | None = None,
        raw: bytes | None = None,
    ) -> None:
        """Append a refused request: where it went, the status and error it got, its tenant, and its body
        capped (`refused_line`; `raw`, the bytes received, names a body too big for the line)."""
        record: dict[str, Any] = {"time": time.time(), "session_id": None, "route": route, "status": status}
        record["error"] = error[:REFUSED_FIELD_CHARS]
        if tenant is not None:
            record["tenant"] = tenant
        self._append(refused_line(record, body, raw))

    def _append(self, line: bytes) -> None:
        with self._lock:
            if self._fd is None:
                return  # closed: the server is shutting down
            if os.fstat(self._fd).st_size + len(line) > self.max_bytes:
                self._rotate()
            view = memoryview(line)
            while view:  # a regular file takes the whole line at once; the loop only guards a short write
                view = view[os.write(self._fd, view) :]

    def _rotate(self) -> None:
        """FILE -> FILE.1 -> FILE.2 ..., the oldest past NUM_FILES_KEPT dropped; a new FILE (under the lock)."""
        assert self._fd is not None
        if os.fstat(self._fd).st_size == 0:
            return  # one line past the cap on its own: it goes in an empty file rather than nowhere
        os.close(self._fd)
        self._fd = None
        for n in range(NUM_FILES_KEPT - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            newer = self.path if n == 1 else self.path.with_name(f"{self.path.name}.{n - 1}")
            if newer.exists():
                os.replace(newer, older)
        self._fd = self._open()

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
