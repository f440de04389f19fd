"""The JSON object the /v1/cache/pin routes answer with."""

from __future__ import annotations

from typing import Any

from swarmkv.core.pins import PinInfo


def pin_json(info: PinInfo) -> dict[str, Any]:
    """The pin object the routes return."""
    return {
        "id": info.pin_id,
        "object": "cache.pin",
        "num_tokens": info.num_tokens,
        "kv_bytes": info.kv_bytes,
        "expires_in_s": info.expires_in_s,
    }
