"""`swarmkv serve --log-requests FILE.jsonl`: every generation request's body, one JSON line each.

A line is `{"time": unix seconds, "session_id": str | null, "route": "/v1/chat/completions" |
"/v1/completions", "body": the request's JSON object as received}`, plus `"api": "messages" | "responses"`
for a request that came in on those APIs, logged as the chat body it runs as (the server lays out its
prompt by that API: `--prompt-layout auto`), and `"tenant"` under `--api-keys` (tenants share no cache), for each request whose body and
session id are well-formed (it reached the tokenizer). A request the server refused (a 4xx) adds a line
`{"time", "session_id": null, "route": the path it was sent to, "status": the HTTP status, "error": the
message, "body": its JSON as received, its text when it is not JSON, or null}`; a request refused after
its body was logged (a prompt past the context) has both lines.

The file holds prompts in clear, so a new one is created readable by its owner only (0600); an existing
file keeps its mode (its owner's choice: a 0640 for a group that runs lint), with a warning when users
other than its owner can read it. Lines are ASCII (JSON's escapes), so a body holding text that is not
valid Unicode (a lone surrogate) is written escaped, never refused by the encoder. The file is opened in
append mode; each line goes out in one `write` on an `O_APPEND` descriptor, under a lock, so lines from
concurrent requests (or two servers sharing the file) never interleave. `swarmkv lint` reads these files.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RequestLog:
    """An append-only JSON-lines file of request bodies; safe to write from any thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ValueError(f"cannot open the request log {str(path)!r}: {exc.strerror}") from exc
        mode = stat.S_IMODE(os.fstat(self._fd).st_mode)
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning(
                "the request log %s holds prompts in clear and other users can read it (mode %04o): "
                "chmod 600 it",
                path,
                mode,
            )
        self._lock = threading.Lock()

    def write(
        self,
        route: str,
        session_id: str | None,
        body: dict[str, Any],
        api: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Append one request as one whole line; `api` names the API it came in on when its body was
        translated (a Messages or Responses request, logged as the chat request it runs as), `tenant` the
        key's tenant under `--api-keys`."""
        record: dict[str, Any] = {"time": time.time(), "session_id": session_id, "route": route, "body": body}
        if api is not None:
            record["api"] = api
        if tenant is not None:
            record["tenant"] = tenant
        self._append(record)

    def write_refused(self, route: str, status: int, error: str, body: Any) -> None:
        """Append a refused request: where it went, the status and error it got, and its body."""
        record = {"time": time.time(), "session_id": None, "route": route, "status": status}
        self._append({**record, "error": error, "body": body})

    def _append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")
        with self._lock:
            if self._fd is None:
                return  # closed: the server is shutting down
            view = memoryview(line)
            while view:  # a regular file takes the whole line at once; the loop only guards a short write
                view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
