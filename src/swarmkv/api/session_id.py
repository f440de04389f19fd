"""Session ids: the body's `session_id` (or Messages' `metadata.user_id`) and the `X-Session-Id` header, checked once."""

from __future__ import annotations

from typing import Any

from swarmkv.api.errors import bad_request, type_name
from swarmkv.core.config import EngineConfig

# The header a client (or a proxy in front of a swarm) may name a session with instead of the body field.
SESSION_HEADER = "x-session-id"
# Claude Code names its session here too (the same id as its metadata.user_id's session_id).
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
# The engine's default limit, written once in EngineConfig; an engine configured otherwise checks its own.
MAX_SESSION_ID_CHARS: int = EngineConfig.max_session_id_chars


def check_session_id(value: Any, where: str) -> str | None:
    """A session id: None when absent, else a non-empty string of at most MAX_SESSION_ID_CHARS, or a 400."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SESSION_ID_CHARS:
        got = f"{len(value)} characters" if isinstance(value, str) else type_name(value)
        raise bad_request(
            f"{where} must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters, got {got}",
            param="session_id",
        )
    return value


def resolve_session_id(
    body_value: str | None, header_value: str | None, client_header_value: str | None = None
) -> str | None:
    """The request's session: the body's `session_id` wins over the `X-Session-Id` header; both are checked.

    The body names the request itself, while a header may be set for a whole connection by a proxy or
    client default, so the more specific one wins. A client's own session header (`client_header_value`,
    Claude Code's X-Claude-Code-Session-Id) comes last: swarmkv's own header is set on purpose.
    """
    header = _header_session_id(header_value, "the X-Session-Id header")
    client = _header_session_id(client_header_value, "the X-Claude-Code-Session-Id header")
    return next((value for value in (body_value, header, client) if value is not None), None)


def _header_session_id(value: str | None, where: str) -> str | None:
    """A session id from a header: checked as the body's are, and printable ASCII, since a header's other
    bytes arrive as Latin-1 characters (mojibake of UTF-8, or control characters), never as meant."""
    session_id = check_session_id(value, where)
    if session_id is not None and not (session_id.isascii() and session_id.isprintable()):
        raise bad_request(f"{where} must be printable ASCII", param="session_id")
    return session_id
