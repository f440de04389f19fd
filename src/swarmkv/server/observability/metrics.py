"""Prometheus metrics of one server: engine counters read at scrape time, latency histograms, HTTP counts.

Each app builds its own CollectorRegistry, so two servers in one process (tests, benchmarks) never mix
their numbers and nothing lives in module globals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from swarmkv.core.stats import EngineStats

PREFIX = "swarmkv"

Read = Callable[[EngineStats], int | float]

# (metric name, help, the field it reads); each gauge is a current value. Fields are read by attribute, so a
# renamed stats field fails the type check here.
_GAUGES: tuple[tuple[str, str, Read], ...] = (
    ("kv_pages_total", "KV pages in the pool.", lambda s: s.kv_pages_total),
    ("kv_pages_in_use", "KV pages held by at least one running request.", lambda s: s.kv_pages_in_use),
    (
        "kv_pages_cached",
        "KV pages kept by the prefix cache that no request holds.",
        lambda s: s.kv_pages_cached,
    ),
    ("kv_bytes_in_use", "Bytes of the KV pages held by running requests.", lambda s: s.kv_bytes_in_use),
    (
        "kv_bytes_logical",
        "Bytes the running requests' KV would take without sharing.",
        lambda s: s.kv_bytes_logical,
    ),
    (
        "kv_bytes_reclaimed_by_sharing",
        "Logical KV bytes of running requests minus the bytes they hold: what sharing saves now.",
        lambda s: s.kv_bytes_reclaimed,
    ),
    ("requests_running", "Requests admitted to the engine.", lambda s: s.requests_running),
    ("requests_waiting", "Requests queued for admission (new or preempted).", lambda s: s.requests_waiting),
    ("offloaded_bytes", "Bytes of KV pages kept in the host-memory tier.", lambda s: s.offloaded_bytes),
    (
        "pinned_bytes",
        "Bytes held by pins: KV pages, and on hybrids the recurrent-state snapshots at their ends.",
        lambda s: s.pinned_bytes,
    ),
    ("pins", "Pins the engine holds.", lambda s: s.pins),
    ("sessions_open", "Sessions a request named that are not yet released.", lambda s: s.sessions_open),
    (
        "sessions_paused",
        "Open sessions with no request waiting or running (their agent is away, e.g. on a tool call).",
        lambda s: s.sessions_paused,
    ),
    (
        "spec_tokens_per_step",
        "Tokens a verification step yielded on average since the start: accepted drafts plus one (0: none yet).",
        lambda s: s.spec_tokens_per_step or 0.0,
    ),
)
# Monotonic since the engine started; exposed with the `_total` suffix.
_COUNTERS: tuple[tuple[str, str, Read], ...] = (
    (
        "prompt_tokens",
        "Prompt tokens processed (served by the prefix cache or computed).",
        lambda s: s.prompt_tokens,
    ),
    (
        "prefill_tokens_computed",
        "Prompt tokens whose KV was computed, not reused.",
        lambda s: s.prefill_tokens_computed,
    ),
    (
        "prefix_hit_tokens",
        "Prompt tokens served by the prefix cache instead of computed.",
        lambda s: s.prefix_hit_tokens,
    ),
    (
        "recomputed_tokens",
        "Tokens computed again after a preemption or an eviction"
        " (prefill_tokens_computed = prompt_tokens - prefix_hit_tokens + recomputed_tokens).",
        lambda s: s.recomputed_tokens,
    ),
    # Pins' one-token prefills are not requests: the counters above leave them out, these count them.
    (
        "pin_prompt_tokens",
        "Prefix tokens pins processed (served by the prefix cache or computed); not in prompt_tokens.",
        lambda s: s.pin_prompt_tokens,
    ),
    (
        "pin_prefill_tokens_computed",
        "Prefix tokens whose KV a pin computed; not in prefill_tokens_computed.",
        lambda s: s.pin_prefill_tokens_computed,
    ),
    (
        "pin_prefix_hit_tokens",
        "Prefix tokens a pin found in the prefix cache; not in prefix_hit_tokens.",
        lambda s: s.pin_prefix_hit_tokens,
    ),
    (
        "pin_recomputed_tokens",
        "Prefix tokens a pin computed again after a preemption or an eviction.",
        lambda s: s.pin_recomputed_tokens,
    ),
    (
        "cascade_decode_rows",
        "Decode rows that read a shared prefix once per group.",
        lambda s: s.cascade_decode_rows,
    ),
    ("generation_tokens", "Tokens generated.", lambda s: s.generated_tokens),
    (
        "lookahead_steps",
        "Steps launched before the previous step's sampled ids were read (async scheduling).",
        lambda s: s.lookahead_steps,
    ),
    (
        "spec_verify_steps",
        "Speculative chunks verified: a request's draft checked in one step.",
        lambda s: s.spec_verify_steps,
    ),
    ("spec_draft_tokens", "Draft tokens proposed and verified.", lambda s: s.spec_draft_tokens),
    ("spec_accepted_tokens", "Draft tokens accepted.", lambda s: s.spec_accepted_tokens),
    (
        "spec_accepted_sibling_tokens",
        "Accepted draft tokens that came from replies of other requests under the same head.",
        lambda s: s.spec_accepted_sibling_tokens,
    ),
    (
        "spec_accepted_session_tokens",
        "Accepted draft tokens that came from the session's earlier replies.",
        lambda s: s.spec_accepted_session_tokens,
    ),
    (
        "spec_mtp_draft_tokens",
        "Draft tokens the model's MTP layer proposed and the step verified.",
        lambda s: s.spec_mtp_draft_tokens,
    ),
    ("spec_accepted_mtp_tokens", "Accepted MTP draft tokens.", lambda s: s.spec_accepted_mtp_tokens),
    ("grammars_compiled", "Grammars compiled for constrained replies.", lambda s: s.grammars_compiled),
    (
        "grammar_cache_hits",
        "Constrained requests whose grammar was found compiled (agents sharing their tools).",
        lambda s: s.grammar_cache_hits,
    ),
    ("forced_tokens", "Tokens appended because a grammar allowed nothing else.", lambda s: s.forced_tokens),
    (
        "loop_guard_penalties",
        "Rows whose reply repeated itself verbatim and whose loop continuation was penalised.",
        lambda s: s.loop_guard_penalties,
    ),
    (
        "loop_guard_closing",
        "Rows inside a JSON string the reply had looped in, whose closing quote was raised.",
        lambda s: s.loop_guard_closing,
    ),
    ("preemptions", "Requests preempted (pages dropped, recomputed later).", lambda s: s.preemptions),
    (
        "swap_preemptions",
        "Preemptions whose private pages went to the host tier.",
        lambda s: s.swap_preemptions,
    ),
    (
        "recompute_preemptions",
        "Preemptions that dropped the request's KV, to be recomputed.",
        lambda s: s.recompute_preemptions,
    ),
    ("offload_stores", "KV pages copied from the device to the host tier.", lambda s: s.offload_stores),
    ("offload_loads", "KV pages copied back from the host tier to the device.", lambda s: s.offload_loads),
    (
        "offload_load_bytes",
        "Bytes copied back from the host tier to the device.",
        lambda s: s.offload_load_bytes,
    ),
    (
        "offload_drops",
        "Host-tier pages whose KV was dropped because the tier was full.",
        lambda s: s.offload_drops,
    ),
    ("evictions", "Cached KV pages evicted to make room.", lambda s: s.evictions),
    ("requests_finished", "Requests that finished (stop or length).", lambda s: s.requests_finished),
    ("requests_failed", "Requests failed by an engine step that raised.", lambda s: s.requests_failed),
    ("failed_steps", "Engine steps whose forward or sampler raised.", lambda s: s.failed_steps),
)

# Seconds; a CPU step of a small model takes tens of milliseconds, a long prefill seconds.
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 20, 60)


class _EngineCollector(Collector):
    """Reads the engine's stats snapshot whenever Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats], num_aborted: Callable[[], int]) -> None:
        self._stats = stats
        self._num_aborted = num_aborted

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        for name, doc, read in _GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=read(stats))
        for name, doc, read in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=read(stats))
        yield CounterMetricFamily(
            f"{PREFIX}_requests_aborted",
            "Requests aborted because their client went away.",
            value=self._num_aborted(),
        )


class ServerMetrics:
    """The registry one app serves at /metrics."""

    def __init__(self, engine_stats: Callable[[], EngineStats], num_aborted: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_stats, num_aborted))
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request (0 for tokens that arrive together).",
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
