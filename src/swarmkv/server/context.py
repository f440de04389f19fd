"""ServerContext: what every route of one app shares (engine loop, tokenizer, model name, metrics, logs).

A route takes its request's copy, `request_context(request)`, which also carries the request's tenant
(`tenants.py`): every name the route hands the engine (salt, session, pin id) goes through `ctx.tenant`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from swarmkv.api.errors import APIError
from swarmkv.api.outputs import StepOutput
from swarmkv.choices import HostedToolsPolicy, MaxTokensPolicy, PromptLayout, ToolCallGrammar
from swarmkv.server.engine_loop.async_engine import AsyncEngine
from swarmkv.server.engine_loop.request_stream import RequestStream
from swarmkv.server.http.body import read_json_body
from swarmkv.server.http.disconnect import submitted
from swarmkv.server.http.json_worker import JsonWorker
from swarmkv.server.observability.cache_breaks import CacheBreaks
from swarmkv.server.observability.cache_snapshot import TreeSnapshots
from swarmkv.server.observability.log_entry import MIN_LOGGED_FIELD_CHARS
from swarmkv.server.observability.metrics import ServerMetrics
from swarmkv.server.observability.request_log import RequestLog
from swarmkv.server.responses_store import ResponseStore
from swarmkv.server.tenants import TENANT_SCOPE_KEY, Tenant
from swarmkv.tokenizer import Tokenizer

log = logging.getLogger(__name__)
ANY_MODEL = "*"  # as a served model name: answer whatever `model` a request names


@dataclass(frozen=True)
class ServerContext:
    """What the routes of one app share."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str  # the name replies carry: the first served name
    max_model_len: int
    metrics: ServerMetrics
    breaks: CacheBreaks
    request_log: RequestLog | None  # `--log-requests`
    max_request_bytes: int  # `--max-request-bytes`
    # Stored Responses API responses (`--responses-store-max`); mutable, shared by the routes of one app.
    responses: ResponseStore
    # Every name `model` may be (`--served-model-name`'s aliases), `model_name` first; "*" answers any name.
    model_names: tuple[str, ...] = ()
    # Decodes large bodies in a child process, started on the first; stopped with the app.
    json_worker: JsonWorker = field(default_factory=JsonWorker)
    # The cache view's last snapshot, reused while the tree is unchanged; used on the engine's thread only.
    tree_snapshots: TreeSnapshots = field(default_factory=TreeSnapshots)
    hosted_tools: HostedToolsPolicy = "drop"  # `--hosted-tools`
    max_tokens_policy: MaxTokensPolicy = "clamp"  # `--max-tokens-policy`
    prompt_layout: PromptLayout = "auto"  # `--prompt-layout`
    tool_call_grammar: ToolCallGrammar = "always"  # `--tool-call-grammar`
    num_tenants: int = 1  # the tenants the keys name; each gets this share of the pinned memory
    # Set on a request's copy only (`request_context`), so that no route can act for no one by mistake.
    request_tenant: Tenant | None = None
    # The engine requests this request submitted, aborted when it ends (`http/disconnect.py`); its copy only.
    submitted: list[str] | None = None

    @property
    def tenant(self) -> Tenant:
        """The tenant of the request this context serves."""
        assert self.request_tenant is not None, "a route must take its context from request_context()"
        return self.request_tenant

    async def read_body(self, request: Request, counted: Collection[str] = ()) -> dict[str, Any]:
        """The request's body as a JSON object, under the size cap, or a 400; a large one is refused as soon
        as it is decoded when one of its top-level arrays `counted` (its parser's) passes its bound."""
        return await read_json_body(request, self.max_request_bytes, self.json_worker, counted)

    async def log_request(
        self,
        route: str,
        session_id: str | None,
        body: dict[str, Any],
        prompt_text: str,
        request_id: str,
        api: str | None = None,
    ) -> None:
        """Append a request the server runs to the request log, when there is one, under its engine
        `request_id`, its strings cut at the length of the `prompt_text` it rendered into (none longer is in
        it whole); encoding and writing a large body takes a while, so it runs on a worker thread, never on
        the event loop."""
        if self.request_log is not None:
            tenant = self.request_tenant.name if self.request_tenant is not None else None
            max_chars = max(len(prompt_text), MIN_LOGGED_FIELD_CHARS)
            try:
                await asyncio.to_thread(
                    self.request_log.write, route, session_id, body, api, tenant, max_chars, request_id
                )
            except OSError:  # the request is queued by now: a full disk loses its line, not its answer
                log.exception("the request log could not record a request to %s", route)

    def log_ended(self, stream: RequestStream, last: StepOutput) -> None:
        """Append a request's end to the request log, when there is one: its prompt, the prompt tokens the
        prefix cache served it, and those of them its own pins computed. Called on the event loop, so the line
        is written on a worker thread: the log's lock may be held by a long line or a rotation."""
        if self.request_log is not None:
            counts = (
                last.num_prompt_tokens,
                last.num_cached_tokens,
                min(stream.num_pin_created_tokens, last.num_cached_tokens),
            )
            asyncio.get_running_loop().run_in_executor(None, self._write_ended, stream.request_id, counts)

    def _write_ended(self, request_id: str, counts: tuple[int, int, int]) -> None:
        assert self.request_log is not None
        try:
            self.request_log.write_ended(request_id, *counts)
        except Exception:  # on a thread nobody awaits: a full disk loses the line, and says so
            log.exception("the request log could not record the end of %s", request_id)

    @property
    def listed_model_names(self) -> tuple[str, ...]:
        """The names /v1/models lists: the served names but "*", which names no model."""
        names = [name for name in (self.model_name, *self.model_names) if name != ANY_MODEL]
        return tuple(dict.fromkeys(names))

    @property
    def answers_any_name(self) -> bool:
        """Whether any `model` a request names gets this server's model: by default, or with '*' among the
        `--served-model-name` names (as llama-server answers)."""
        return not self.model_names or ANY_MODEL in self.model_names

    def reply_model(self, model: str | None) -> str:
        """The model name a reply carries: the one the request asked for where any name is answered, else the
        served name (an alias's first name)."""
        return model if model is not None and self.answers_any_name else self.model_name

    def check_model(self, model: str | None) -> None:
        """A 404 unless `model` is one this server serves (or omitted, or the server answers any name)."""
        if model is None or self.answers_any_name or model == self.model_name or model in self.model_names:
            return
        served = ", ".join(repr(name) for name in self.listed_model_names)
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )


def request_context(request: Request) -> ServerContext:
    """The app's context for one request, carrying the tenant the gate found for its key."""
    ctx: ServerContext = request.app.state.ctx
    return dataclasses.replace(
        ctx, request_tenant=request.scope[TENANT_SCOPE_KEY], submitted=submitted(request.scope)
    )
