"""ClusterConfig: what `swarmkv serve --replicas N` deploys, shipped to every replica (no Ray import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from swarmkv.cluster.routing import DEFAULT_IMBALANCE, DEFAULT_MIN_MATCH, Policy
from swarmkv.server.config import ServerConfig

# "ray-prefix" is Ray Serve's own PrefixCacheAffinityRouter, for the bench's comparison.
RouterName = Policy | Literal["ray-prefix"]
RAY_PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"


@dataclass(frozen=True)
class ClusterConfig:
    """Everything the deployments need; built once by the CLI (or a test) and shipped to every replica."""

    replicas: int
    router: RouterName = "balanced"
    min_match: int = DEFAULT_MIN_MATCH
    imbalance: int = DEFAULT_IMBALANCE
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # ModelOptions fields (model, dtype, ...)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    server: ServerConfig = (
        ServerConfig()
    )  # each replica's app's (its host and port unused: the ingress listens)
    num_gpus: float = 0.0  # per replica: 1 on a GPU machine
    num_cpus: float = 0.5  # per replica: small, so N replicas fit on a small CPU machine
    torch_threads: int | None = None  # per replica on the CPU, so N replicas do not fight over the cores
    accept_timeout_s: float = 60.0  # a replica must take a request within this (Ray restarts dead ones)
    request_timeout_s: float = 600.0  # the longest wait for a response's next part

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.min_match < 0 or self.imbalance < 0:
            raise ValueError("--route-min-match and --route-imbalance must be at least 0")


def load_tokenizer(model: str | Path | None) -> Any:
    """The model's tokenizer alone (the ingress renders prompts; it runs no model)."""
    from swarmkv.models.loader import checkpoint_file_or_dir
    from swarmkv.tokenizer import Tokenizer

    path = checkpoint_file_or_dir(model)
    if path.is_file():
        from swarmkv.models.gguf_file import open_gguf

        return Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    return Tokenizer.from_hf_dir(path)
