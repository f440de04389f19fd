"""The URL paths of the generation routes, which the request log records and lint and the cluster read."""

from __future__ import annotations

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
MESSAGES_ROUTE = "/v1/messages"
RESPONSES_ROUTE = "/v1/responses"


def is_messages_route(path: str) -> bool:
    """Whether `path` is an Anthropic route, whose errors take Anthropic's shape."""
    return path == MESSAGES_ROUTE or path.startswith(MESSAGES_ROUTE + "/")
