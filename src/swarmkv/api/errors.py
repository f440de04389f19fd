"""The protocol layer's error and field checks: every client mistake becomes an APIError with OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    """An error the client gets as `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.details = details  # machine-readable specifics, for APIs whose errors carry them (Anthropic's)

    def to_json(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


_JSON_TYPE_NAMES: dict[type, str] = {dict: "object", list: "array", str: "string", bool: "boolean"}


def type_name(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    return "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def get_field(
    body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str, default: Any = None
) -> Any:
    """`body[name]` if it is present and of `kind` (bool never counts as a number), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad_request(f"'{name}' must be {what}, got {type_name(value)}", param=name)
    return value


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the decoder recurses once per nesting level
        raise bad_request("the request body's JSON is nested too deeply") from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type_name(body)}")
    return body
