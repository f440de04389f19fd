"""ServerContext: what every route of one app shares (engine loop, tokenizer, model name, metrics, logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from swarmkv.api.errors import APIError
from swarmkv.choices import HostedToolsPolicy, MaxTokensPolicy
from swarmkv.server.engine_loop.async_engine import AsyncEngine
from swarmkv.server.http.body import read_json_body
from swarmkv.server.observability.cache_breaks import CacheBreaks
from swarmkv.server.observability.cache_snapshot import TreeSnapshots
from swarmkv.server.observability.metrics import ServerMetrics
from swarmkv.server.observability.request_log import RequestLog
from swarmkv.server.responses_store import ResponseStore
from swarmkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServerContext:
    """What the routes of one app share."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    breaks: CacheBreaks
    request_log: RequestLog | None  # `--log-requests`
    max_request_bytes: int  # `--max-request-bytes`
    # Stored Responses API responses (`--responses-store-max`); mutable, shared by the routes of one app.
    responses: ResponseStore
    # The cache view's last snapshot, reused while the tree is unchanged; used on the engine's thread only.
    tree_snapshots: TreeSnapshots = field(default_factory=TreeSnapshots)
    hosted_tools: HostedToolsPolicy = "drop"  # `--hosted-tools`
    max_tokens_policy: MaxTokensPolicy = "clamp"  # `--max-tokens-policy`

    async def read_body(self, request: Request) -> dict[str, Any]:
        """The request's body as a JSON object, under the size cap, or a 400."""
        return await read_json_body(request, self.max_request_bytes)

    def log_request(self, route: str, session_id: str | None, body: dict[str, Any]) -> None:
        """Append the request's body to the request log, when there is one."""
        if self.request_log is not None:
            self.request_log.write(route, session_id, body)

    def check_model(self, model: str | None) -> None:
        """A 404 unless `model` is the one this server serves (or omitted)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
