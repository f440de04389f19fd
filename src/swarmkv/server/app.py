"""The ASGI app: one engine loop, the routes of every protocol (`routes/`), the gate and the error handlers.

`create_app(llm, config)` builds the context the routes share, the route table (OpenAI chat, completions and
Responses, Anthropic Messages, pins, sessions, the cache view, /health, /metrics), the middleware checking
each request's Host, key, content type and origin and counting the answers (`http/gate.py`, `http/browsers.py`),
CORS when `--cors-origins` names origins, and the handlers answering every failure in its protocol's error shape
(`http/errors.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from swarmkv.api.errors import APIError
from swarmkv.api.paths import CHAT_ROUTE, COMPLETIONS_ROUTE, MESSAGES_ROUTE, RESPONSES_ROUTE
from swarmkv.engine.llm import LLM
from swarmkv.server.config import ServerConfig
from swarmkv.server.context import ANY_MODEL, ServerContext
from swarmkv.server.engine_loop.async_engine import AsyncEngine
from swarmkv.server.engine_loop.request_stream import EngineUnavailableError
from swarmkv.server.http import errors
from swarmkv.server.http.browsers import BrowserChecks
from swarmkv.server.http.disconnect import CancelOnDisconnect
from swarmkv.server.http.gate import Gate
from swarmkv.server.observability.cache_breaks import CacheBreaks
from swarmkv.server.observability.metrics import ServerMetrics
from swarmkv.server.observability.request_log import RequestLog
from swarmkv.server.responses_store import ResponseStore
from swarmkv.server.routes import cache_view, messages, pins, responses, service, sessions
from swarmkv.server.routes.chat import chat_completions
from swarmkv.server.routes.completions import completions
from swarmkv.server.tenants import TenantKeys


def default_model_name(llm: LLM) -> str:
    """The name clients send as `model`: the checkpoint's file stem or folder name."""
    path = llm.loaded.path
    return path.stem if path.is_file() else path.name


def _reply_name(names: tuple[str, ...], default: str) -> str:
    """The name replies carry: the first served name that names a model, else the checkpoint's."""
    return next((name for name in names if name != ANY_MODEL), default)


def create_app(llm: LLM, config: ServerConfig | None = None) -> Starlette:
    """An app serving `llm` as `config` says (None: the defaults); its engine loop runs while the app's lifespan
    does. One app per LLM; `config.host`, `port` and `log_level` are for whoever runs it (`swarmkv serve`)."""
    config = config if config is not None else ServerConfig()
    tenants = TenantKeys.of(config.api_key, config.api_keys)
    engine = AsyncEngine(llm.engine, config.max_step_s or None)
    metrics = ServerMetrics(engine.snapshot, lambda: engine.num_aborted)
    log = config.log_requests
    ctx = ServerContext(
        engine=engine,
        tokenizer=llm.tokenizer,
        model_name=_reply_name(config.model_names, default_model_name(llm)),
        model_names=config.model_names,
        max_model_len=llm.engine.max_model_len,
        metrics=metrics,
        breaks=CacheBreaks(llm.tokenizer, metrics.cache_breaks, log_text=config.log_cache_break_text),
        request_log=RequestLog(log, config.log_requests_max_bytes) if log is not None else None,
        max_request_bytes=config.max_request_bytes,
        responses=ResponseStore(config.responses_store_max, num_tenants=tenants.num_tenants),
        num_tenants=tenants.num_tenants,
        hosted_tools=config.hosted_tools,
        max_tokens_policy=config.max_tokens_policy,
        prompt_layout=config.prompt_layout,
        tool_call_grammar=config.tool_call_grammar,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            ctx.json_worker.close()
            if ctx.request_log is not None:
                ctx.request_log.close()

    routes = [
        Route(CHAT_ROUTE, chat_completions, methods=["POST"]),
        Route(COMPLETIONS_ROUTE, completions, methods=["POST"]),
        Route(MESSAGES_ROUTE, messages.messages, methods=["POST"]),
        Route(MESSAGES_ROUTE + "/count_tokens", messages.count_tokens, methods=["POST"]),
        Route(RESPONSES_ROUTE, responses.create_response, methods=["POST"]),
        Route(RESPONSES_ROUTE + "/input_tokens", responses.count_input_tokens, methods=["POST"]),
        Route(RESPONSES_ROUTE + "/{response_id}", responses.get_response, methods=["GET"]),
        Route(RESPONSES_ROUTE + "/{response_id}", responses.delete_response, methods=["DELETE"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/engine", service.engine_settings, methods=["GET"]),
        # `path`: a session id may hold "/" (sent percent-encoded).
        Route("/v1/sessions/{session_id:path}/release", sessions.release_session, methods=["POST"]),
        Route("/v1/cache/pin", pins.create_pin, methods=["POST"]),
        Route("/v1/cache/pin/{pin_id}", pins.get_pin, methods=["GET"]),
        Route("/v1/cache/pin/{pin_id}", pins.delete_pin, methods=["DELETE"]),
        Route("/v1/cache/tree", cache_view.cache_tree, methods=["GET"]),
        Route("/cache", cache_view.cache_page, methods=["GET"]),
        Route("/", service.root, methods=["GET", "HEAD"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics, methods=["GET"]),
    ]
    browsers = BrowserChecks.of(config)
    gate = Middleware(
        Gate,
        tenants=tenants,
        metrics=metrics,
        routes=routes,
        browsers=browsers,
        metrics_public=config.metrics_public,
    )
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        # CORS outside the gate, so its refusals (a 401, a 415) reach a listed origin's page readable.
        # Inside the gate, so that a route cancelled for its client's leaving is counted as a 499.
        middleware=[*browsers.cors_middleware(), gate, Middleware(CancelOnDisconnect, abort=engine.abort)],
        exception_handlers={
            APIError: errors.api_error,
            HTTPException: errors.http_error,
            EngineUnavailableError: errors.engine_unavailable,
            ClientDisconnect: errors.client_gone,
            Exception: errors.server_error,
        },
    )
    app.state.ctx = ctx
    return app
