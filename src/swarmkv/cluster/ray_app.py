"""The Ray Serve application: N engine replicas (each one swarmkv engine and its own Starlette app, called
in-process) behind one ingress that serves the same HTTP API, routes with SwarmkvRequestRouter and
aggregates /metrics.

`build_app(config)` returns the bound application; `swarmkv serve --replicas N` (cluster/cli.py), the tests
and bench/cluster.py run it with `serve.run`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any, cast

from ray import serve
from ray.serve import Deployment
from ray.serve.config import RequestRouterConfig

from swarmkv.cluster.asgi_call import call_asgi
from swarmkv.cluster.config import RAY_PREFIX_ROUTER, ClusterConfig
from swarmkv.cluster.forward import REPLICA_HEADER, ROUTE_HEADER, ForwardedRequest, ReplicaInfo, ResponseHead
from swarmkv.cluster.ingress import Ingress
from swarmkv.cluster.ray_router import SwarmkvRequestRouter

APP_NAME = "swarmkv"


class EngineReplica:
    """One swarmkv engine serving its app in-process; `serve_http` streams an HTTP exchange back."""

    def __init__(self, config: ClusterConfig) -> None:
        import torch

        from swarmkv.engine.llm import LLM
        from swarmkv.server.app import create_app

        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        llm = LLM(**config.model_kwargs, **config.engine_kwargs)
        # Replicas are reached through the ingress only (no socket), which checks the key, the Host and
        # /metrics itself; its /metrics fan-out carries no key.
        self._app = create_app(llm, dataclasses.replace(config.server, metrics_public=True))
        self._engine = self._app.state.ctx.engine
        self._engine.start()  # the app's lifespan is not run: nothing serves it over a socket
        replica = serve.get_replica_context().replica_id.unique_id
        pages = llm.engine.snapshot().kv_pages_total
        engine_config = llm.engine.config
        self._info = ReplicaInfo(
            replica, os.getpid(), pages, engine_config.block_size, engine_config.retention
        )

    def info(self, target: str | None = None) -> ReplicaInfo:
        """Who this replica is and how large its KV pool is (`target`: a replica id the router honours)."""
        return self._info

    async def serve_http(self, req: ForwardedRequest, note: Any = None) -> AsyncIterator[Any]:
        """Yield this replica's id at once, then the ResponseHead, then the body's chunks."""
        yield self._info.replica
        stream = call_asgi(self._app, req.method, req.path, req.query, req.headers, req.body)
        async for item in stream:
            if isinstance(item, tuple):
                status, headers = item
                reason = getattr(note, "reason", "none")
                ours = ((REPLICA_HEADER, self._info.replica), (ROUTE_HEADER, reason))
                yield ResponseHead(status, headers + ours, self._info.replica, note)
            else:
                yield item

    def check_health(self) -> None:
        """Ray Serve's health check: a stopped engine loop restarts the replica."""
        if not self._engine.is_running:
            raise RuntimeError("the engine loop stopped")

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)  # None if the model failed to load
        if engine is not None:
            engine.shutdown()


def router_config(config: ClusterConfig) -> RequestRouterConfig:
    """Our router with its policy, or Ray's PrefixCacheAffinityRouter for the comparison."""
    if config.router == "ray-prefix":
        import importlib

        # Imported from its module: `ray.serve.llm` pulls in pyarrow and vllm-era extras we do not need.
        router_cls = importlib.import_module(RAY_PREFIX_ROUTER).PrefixCacheAffinityRouter
        return RequestRouterConfig(request_router_class=router_cls, request_router_kwargs={})
    kwargs = {"policy": config.router, "min_match": config.min_match, "imbalance": config.imbalance}
    ours: dict[str, Any] = {"request_router_class": SwarmkvRequestRouter, "request_router_kwargs": kwargs}
    return RequestRouterConfig(**ours)


def build_app(config: ClusterConfig) -> Any:
    """The bound application: the Engine deployment (N replicas) and the Ingress in front of it."""
    engine = cast(Deployment, serve.deployment(EngineReplica)).options(
        name="Engine",
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        max_ongoing_requests=1024,  # the engine queues and batches; Ray should not hold requests back
        request_router_config=router_config(config),
        health_check_period_s=1.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
    )
    ingress = cast(Deployment, serve.deployment(Ingress)).options(
        name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=4096
    )
    return ingress.bind(engine.bind(config), config)
