"""What travels between the ingress, the request router and an engine replica (plain data, no Ray)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmkv.cluster.routing import RouteKey
from swarmkv.kv import RetentionPolicy

ANY_REPLICA = "*"  # a target meaning "the least loaded replica, no routing decision recorded"
REPLICA_HEADER = "x-swarmkv-replica"
ROUTE_HEADER = "x-swarmkv-route"
RESPONSE_HEADERS_DROPPED = frozenset({"content-length", "transfer-encoding", "connection"})


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request for a replica's app, with what the router needs to place it.

    `messages` is the chat's raw messages (or a prompt string as one message): Ray's own
    PrefixCacheAffinityRouter reads it, so the bench can compare against it through the same deployment.
    """

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    key: RouteKey
    messages: list[Any] = field(default_factory=list)
    target: str | None = None  # a replica id, or ANY_REPLICA
    avoid: tuple[str, ...] = ()  # replicas that just failed this request (the ingress's one retry)
    replica_pages: int | None = None  # the replicas' KV pool in pages, for the router's shadow indexes
    page_size: int | None = None
    retention: RetentionPolicy | None = None  # the replicas' eviction policy, which the shadows follow


@dataclass(frozen=True)
class RouteNote:
    """The router's answer, handed to the replica with the request and returned with the response head."""

    replica: str
    reason: str
    candidates: tuple[str, ...]
    decisions: Mapping[tuple[str, str], int]  # (policy, reason) -> count, the router's totals so far


@dataclass(frozen=True)
class ResponseHead:
    """The first item a replica streams back: status, headers, who served it and why."""

    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str
    note: RouteNote | None = None

    def header(self, name: str, default: str = "") -> str:
        """A header's value (name lower-case), or `default`."""
        return next((v for k, v in self.headers if k == name), default)


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica's identity and KV pool, for the ingress's router setup and the tests."""

    replica: str
    pid: int
    kv_pages: int
    page_size: int
    retention: RetentionPolicy
