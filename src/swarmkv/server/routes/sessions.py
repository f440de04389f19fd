"""POST /v1/sessions/{session_id}/release: the client's agent is done, so its session's KV may go first.

A generation request names its session with `session_id` in the body or an `X-Session-Id` header (see
`api/session_id.py`). Under the "session" retention the engine evicts a paused session's pages
late (its agent is expected back); once released, its private pages are the first to be evicted. A session
is its tenant's (`tenants.py`): another tenant's session of the same name is a different one.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.api.errors import APIError
from swarmkv.api.session_id import check_session_id
from swarmkv.server.context import request_context


async def release_session(request: Request) -> Response:
    """End a session so its private pages go first; 404 if its tenant has no such open session."""
    ctx = request_context(request)
    session_id = check_session_id(request.path_params["session_id"], "the session id")
    assert session_id is not None  # a path parameter is a string, if an empty one
    engine_id = ctx.tenant.scope(session_id)  # another tenant's session of that name is not this one
    assert engine_id is not None
    released = await asyncio.wrap_future(ctx.engine.call(lambda engine: engine.release_session(engine_id)))
    if not released:
        raise APIError(
            404,
            f"no open session {session_id!r}: it was never used or is already released",
            code="session_not_found",
        )
    return JSONResponse({"id": session_id, "object": "session", "released": True})
