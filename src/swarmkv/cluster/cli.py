"""`swarmkv serve --replicas N`: the engine replicas on Ray Serve behind one ingress, until interrupted.

`register` adds the cluster's flags to the server's `serve` command and imports no Ray, so `swarmkv serve`
without `--replicas` never loads it and runs the one-engine server unchanged; `run_cluster` starts a local
Ray instance (stopped with the command) unless `--ray-address` names a running one.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path

from swarmkv.cluster.config import ClusterConfig
from swarmkv.cluster.routing import DEFAULT_IMBALANCE, DEFAULT_MIN_MATCH, POLICIES
from swarmkv.options import engine_kwargs, model_kwargs
from swarmkv.server import cli as server_cli
from swarmkv.server.config import ServerConfig

CONNECT_TIMEOUT_S = 10.0  # how long an unreachable --ray-address may take to be reported


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand: the server's, with the cluster's flags."""
    parser = server_cli.register(subparsers)
    add_cluster_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """One engine without --replicas, else the cluster."""
    if args.replicas is None:
        return server_cli.run(args)
    return run_cluster(args, server_cli.prepare(args))


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """--replicas, --router, --ray-address, --route-min-match, --route-imbalance."""
    group = parser.add_argument_group("more than one card (Ray Serve)")
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas on Ray Serve (default: one, no Ray)",
    )
    group.add_argument("--router", choices=POLICIES, default="balanced", help="how requests pick a replica")
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="auto|HOST:PORT",
        help="a running Ray cluster to deploy on (default: start a local one for this command)",
    )
    group.add_argument(
        "--route-min-match",
        type=int,
        default=DEFAULT_MIN_MATCH,
        help=f"tokens a replica's cached prefix must match to win a request (default {DEFAULT_MIN_MATCH})",
    )
    group.add_argument(
        "--route-imbalance",
        type=int,
        default=DEFAULT_IMBALANCE,
        help="in-flight requests a prefix match may add over the least loaded replica "
        f"(default {DEFAULT_IMBALANCE})",
    )


def cluster_config(args: argparse.Namespace, server: ServerConfig, num_gpus: float) -> ClusterConfig:
    """The deployment's config from parsed arguments; paths made absolute (replicas run elsewhere)."""
    models = model_kwargs(args)
    if models.get("model") is not None:
        models["model"] = str(Path(models["model"]).expanduser().resolve())
    per_replica_threads = None if num_gpus else max(1, (os.cpu_count() or 1) // args.replicas)
    return ClusterConfig(
        replicas=args.replicas,
        router=args.router,
        min_match=args.route_min_match,
        imbalance=args.route_imbalance,
        model_kwargs=models,
        engine_kwargs=engine_kwargs(args),
        server=server,
        num_gpus=num_gpus,
        torch_threads=per_replica_threads,
    )


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A ValueError naming the address unless its HOST:PORT accepts a connection within `timeout_s`."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address must be 'auto' or HOST:PORT, got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ValueError(f"cannot reach the Ray cluster at {address}: {exc}") from exc


# Ray Serve kills an HTTP proxy that is not ready within 5 s, or whose health check takes over 10 s. A local
# Ray on a small, busy machine (2 cores under load) can take longer to start the proxy's process, and then
# `serve.start` fails with "The actor is dead because it was killed by `ray.kill`". A local Ray's processes
# inherit this process's environment, so these are set (where the user has not) before it starts.
PATIENT_SERVE_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
}


def patient_serve() -> None:
    """Give Ray Serve's proxy the `PATIENT_SERVE_ENV` timeouts, unless the environment already sets them."""
    for name, value in PATIENT_SERVE_ENV.items():
        os.environ.setdefault(name, value)


def start_ray(address: str | None, replicas: int) -> bool:
    """Connect to `address` or start a local Ray; whether we started it (and must stop it)."""
    import ray

    if address is not None and address != "auto":
        check_reachable(address)
    try:
        if address is None:
            patient_serve()  # the local Ray's processes inherit it; a running cluster keeps its own
            ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(replicas / 2) + 1), include_dashboard=False)
        else:
            ray.init(address=address)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        raise ValueError(f"cannot connect to Ray at {address}: {exc}") from exc
    return address is None


def run_cluster(args: argparse.Namespace, server: ServerConfig) -> int:
    """Deploy and serve until interrupted; Serve (and a local Ray) are shut down on the way out."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    import ray
    from ray import serve

    from swarmkv.cluster.ray_app import APP_NAME, build_app

    started = start_ray(args.ray_address, args.replicas)
    try:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= args.replicas else 0.0
        config = cluster_config(args, server, num_gpus)
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        print(
            f"swarmkv serve: {args.replicas} replicas ({args.router} routing) on http://{args.host}:{args.port}",
            file=sys.stderr,
        )
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
