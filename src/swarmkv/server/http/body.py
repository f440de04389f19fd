"""Reading a request body under the server's size cap, as a JSON object or a 400; a large one decoded in the
JSON worker's process (`json_worker.py`), so that decoding it never holds the event loop's lock for long."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from starlette.requests import Request

from swarmkv.api.errors import bad_request, parse_json_body
from swarmkv.server.http.json_worker import JsonWorker

LARGE_BODY_BYTES = 1 << 20


async def read_json_body(
    request: Request, max_request_bytes: int, worker: JsonWorker, counted: Collection[str] = ()
) -> dict[str, Any]:
    """The body as a JSON object; a 400 once it passes `max_request_bytes`, before all of it is read. One over
    `LARGE_BODY_BYTES` is decoded by `worker`, from a thread, and its top-level arrays `counted` (the route's
    parser's, `limits.check_array_counts`) are counted there: one refused on a count is not handed over."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_request_bytes:
        raise _too_large(max_request_bytes)
    chunks: list[bytes] = []
    num_bytes = 0
    # Streamed and counted, so a chunked body without a Content-Length cannot grow past the cap in memory.
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_request_bytes:
            raise _too_large(max_request_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    request.state.raw_body = raw  # for the request log, should the request be refused
    if len(raw) > LARGE_BODY_BYTES:
        # Decoding megabytes holds the GIL for up to seconds, on any thread of this process: another's.
        body = await asyncio.to_thread(worker.decode, raw, counted)
    else:
        body = parse_json_body(raw)
    request.state.json_body = body  # the log of a refusal reads it, rather than decoding the body again
    return body


def _too_large(max_request_bytes: int) -> Exception:
    return bad_request(
        f"the request body is larger than this server's limit of {max_request_bytes} bytes "
        f"(swarmkv serve --max-request-bytes)",
        code="request_too_large",
    )
