"""Prometheus metrics of one server: engine counters read at scrape time, latency histograms, HTTP counts.

Each app builds its own CollectorRegistry, so two servers in one process (tests, benchmarks) never mix
their numbers and nothing lives in module globals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "swarmkv"

# (metric name, engine stats key, help); each gauge is a current value.
_GAUGES = (
    ("kv_pages_total", "kv_pages_total", "KV pages in the pool."),
    ("kv_pages_in_use", "kv_pages_in_use", "KV pages held by at least one running request."),
    ("kv_pages_cached", "kv_pages_cached", "KV pages kept by the prefix cache that no request holds."),
    ("kv_bytes_in_use", "kv_bytes_in_use", "Bytes of the KV pages held by running requests."),
    ("kv_bytes_logical", "kv_bytes_logical", "Bytes the running requests' KV would take without sharing."),
    ("requests_running", "requests_running", "Requests admitted to the engine."),
    ("requests_waiting", "requests_waiting", "Requests queued for admission (new or preempted)."),
    ("offloaded_bytes", "offloaded_bytes", "Bytes of KV pages kept in the host-memory tier."),
    ("pinned_bytes", "pinned_bytes", "Bytes of KV pages held by pins."),
    ("pins", "pins", "Pins the engine holds."),
    ("sessions_open", "sessions_open", "Sessions a request named that are not yet released."),
    (
        "sessions_paused",
        "sessions_paused",
        "Open sessions with no request waiting or running (their agent is away, e.g. on a tool call).",
    ),
)
# Monotonic since the engine started; exposed with the `_total` suffix.
_COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "Prompt tokens processed (served by the prefix cache or computed)."),
    (
        "prefill_tokens_computed",
        "prefill_tokens_computed",
        "Prompt tokens whose KV was computed, not reused.",
    ),
    (
        "prefix_hit_tokens",
        "prefix_hit_tokens",
        "Prompt tokens served by the prefix cache instead of computed.",
    ),
    (
        "recomputed_tokens",
        "recomputed_tokens",
        "Tokens computed again after a preemption or an eviction"
        " (prefill_tokens_computed = prompt_tokens - prefix_hit_tokens + recomputed_tokens).",
    ),
    ("cascade_decode_rows", "cascade_decode_rows", "Decode rows that read a shared prefix once per group."),
    ("generation_tokens", "generated_tokens", "Tokens generated."),
    ("preemptions", "preemptions", "Requests preempted (pages dropped, recomputed later)."),
    ("swap_preemptions", "swap_preemptions", "Preemptions whose private pages went to the host tier."),
    (
        "recompute_preemptions",
        "recompute_preemptions",
        "Preemptions that dropped the request's KV, to be recomputed.",
    ),
    ("offload_stores", "offload_stores", "KV pages copied from the device to the host tier."),
    ("offload_loads", "offload_loads", "KV pages copied back from the host tier to the device."),
    ("offload_load_bytes", "offload_load_bytes", "Bytes copied back from the host tier to the device."),
    ("offload_drops", "offload_drops", "Host-tier pages whose KV was dropped because the tier was full."),
    ("evictions", "evictions", "Cached KV pages evicted to make room."),
    ("requests_finished", "requests_finished", "Requests that finished (stop or length)."),
    ("requests_aborted", "requests_aborted", "Requests aborted because their client went away."),
    ("requests_failed", "requests_failed", "Requests failed by an engine step that raised."),
    ("failed_steps", "failed_steps", "Engine steps whose forward or sampler raised."),
)

# Seconds; a CPU step of a small model takes tens of milliseconds, a long prefill seconds.
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 20, 60)


class _EngineCollector(Collector):
    """Reads the engine's stats snapshot whenever Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        for name, key, doc in _GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=stats[key])
        reclaimed = max(0, stats["kv_bytes_logical"] - stats["kv_bytes_in_use"])
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_bytes_reclaimed_by_sharing",
            "Logical KV bytes of running requests minus the bytes they hold: what sharing saves now.",
            value=reclaimed,
        )
        for name, key, doc in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=stats[key])


class ServerMetrics:
    """The registry one app serves at /metrics."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_stats))
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request.",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.cache_breaks = Counter(
            f"{PREFIX}_cache_breaks",
            "Chat prompts that diverged from their session's or salt's most similar earlier prompt before"
            " its end, by the cause `swarmkv lint` names.",
            ["cause"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
