"""Short, stable session names for the report: a harness's session id is a UUID, or, in logs written before
the server read it, Claude Code's whole `metadata.user_id` JSON (about 150 characters)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable

from swarmkv.api.messages_request import json_session_id

MAX_NAME_CHARS = 12
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_PREFIX = "user:"  # the lint's name for a session known by the body's `user` field
_DIGEST_CHARS = 4


def short_name(session: str) -> str:
    """A session's name within MAX_NAME_CHARS: the `session_id` inside a JSON id, a UUID's first 8 hex
    digits, else the name itself, or its start and a digest of the whole when it is longer."""
    prefix, value = (_PREFIX, session[len(_PREFIX) :]) if session.startswith(_PREFIX) else ("", session)
    value = _inner_session(value)
    if _UUID.fullmatch(value):
        value = value[:8]
    room = MAX_NAME_CHARS - len(prefix)
    if len(value) > room:
        value = value[: room - _DIGEST_CHARS - 1] + "~" + _digest(value)
    return prefix + value


def short_names(sessions: Iterable[str]) -> dict[str, str]:
    """Each session's short name, made unique: two that would share one both get their digest."""
    names = {session: short_name(session) for session in dict.fromkeys(sessions)}
    counts = Counter(names.values())
    for session, name in names.items():
        if counts[name] > 1:
            names[session] = name[: MAX_NAME_CHARS - _DIGEST_CHARS - 1] + "~" + _digest(session)
    return names


def _inner_session(value: str) -> str:
    """The `session_id` of a JSON object (Claude Code's `user_id`), else `value`."""
    return json_session_id(value) or value


def _digest(value: str) -> str:
    return hashlib.sha1(value.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
