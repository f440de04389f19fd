"""The protocol layer's error and field checks: every client mistake becomes an APIError with OpenAI's error shape."""

from __future__ import annotations

import json
import re
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
    if _may_hold_surrogates(raw):
        check_text(body)
    return body


# UTF-16 surrogates: alone they are no character (a `\\ud800` escape decodes to one), and no UTF-8 encodes them.
_SURROGATE = re.compile("[\ud800-\udfff]")
# What a surrogate is in a UTF-8 body: an escape of one (paired ones too), or its encoding, which the decoder
# passes through.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether `raw` may decode to a surrogate: a byte scan, much cheaper than a walk of the decoded body."""
    if not json.detect_encoding(raw).startswith("utf-8"):
        return True  # UTF-16 and UTF-32 bodies, which JSON allows
    # The `in` tests find a byte pair at memchr's speed, the patterns then only run on bodies that have one.
    escaped = b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None
    return escaped or (b"\xed" in raw and _ENCODED_SURROGATE.search(raw) is not None)


def check_text(body: dict[str, Any]) -> None:
    """A 400 naming the first key or string of a decoded body that is not valid text (a lone surrogate), by its
    JSON path (`messages[0].content`), so nothing past the parse (tokenizer, log, replies) ever meets one."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
        return  # the common case, at the encoder's speed: only paired surrogate escapes (an emoji's)
    except (UnicodeEncodeError, RecursionError):  # the encoder recurses, from a frame deeper than the decoder
        pass
    # Iterative, as the decoder's nesting limit allows more levels than a recursive walk could take here;
    # children are pushed last first, so the first bad string in the body's order is the one named.
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise _invalid_text(f"'{path}' is", path)
            continue
        children: list[tuple[Any, str]] = []
        if isinstance(value, dict):
            for key, child in value.items():
                if _SURROGATE.search(key):  # named by its object, so the reply never holds the bad key
                    raise _invalid_text(
                        f"a key of '{path}' is" if path else "a top-level key is", path or None
                    )
                children.append((child, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            children = [(child, f"{path}[{i}]") for i, child in enumerate(value)]
        stack.extend(child for child in reversed(children) if isinstance(child[0], str | dict | list))


def _invalid_text(what: str, param: str | None) -> APIError:
    return bad_request(
        f"{what} not valid text: it holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)",
        param=param,
        code="invalid_text",
    )
