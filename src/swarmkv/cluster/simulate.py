"""Replay a trace through a `Router` over replicas that are each an `EngineCore`, with no model.

A request is routed when it arrives, then looked up on its replica (all but its last prompt token, as the
engine's scheduler leaves one to compute), given pages for its prompt and reply at once and held until it
finishes: its prefill waits behind the replica's earlier prefills (one queue per replica, at a fixed rate)
and its reply decodes at a fixed rate, beside the prefills (the cost model: a replica's time goes to prefill;
decode is not charged to it). The wait before its prefill is its queueing delay. It then commits and frees its pages, leaving them cached, so the
next turn of its agent can hit them. Each request is a turn of its agent's session on the replica's core, so
eviction there is the engine's own, in the replica's retention order. In-flight
requests per replica, and the prefill tokens queued there, are the loads the router balances on, so a hot
replica's queue pushes work elsewhere.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import count

from swarmkv.cluster.load_policy import LoadThresholds
from swarmkv.cluster.routing import (
    DEFAULT_IMBALANCE,
    DEFAULT_MIN_MATCH,
    Policy,
    RouteKey,
    Router,
    evict_ahead,
)
from swarmkv.cluster.trace import Trace
from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import Sequence as Turn
from swarmkv.kv import RetentionPolicy, pages_for

SimPolicy = Policy | None  # None: every request on the one replica, no router


@dataclass(frozen=True)
class ClusterSpec:
    """The replicas a trace runs on: how many, their KV in pages, and their speed."""

    replicas: int
    pages_per_replica: int
    page_size: int = 16
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0
    min_match: int = DEFAULT_MIN_MATCH
    imbalance: int = DEFAULT_IMBALANCE
    seed: int = 0
    evict_ahead_fraction: float = 1 / 16  # of a replica's pages, per eviction scan (see routing.evict_ahead)
    retention: RetentionPolicy = EngineConfig.retention  # the replicas' eviction policy
    thresholds: LoadThresholds = LoadThresholds()  # the balanced policy's

    @property
    def evict_ahead_pages(self) -> int:
        """Pages each eviction frees beyond the need, on replicas and in the router's indexes alike."""
        return int(self.pages_per_replica * self.evict_ahead_fraction)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.pages_per_replica < 1 or self.page_size < 1:
            raise ValueError(
                f"a replica needs at least one page of at least one token, got {self.pages_per_replica}"
                f" pages of {self.page_size}"
            )
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError("prefill and decode rates must be positive")


@dataclass(frozen=True)
class SimResult:
    """One policy on one cluster size: token counts over the whole trace and where requests went."""

    policy: str
    replicas: int
    prompt_tokens: int
    hit_tokens: int
    cached_pages: int  # pages cached across all replicas once the trace has run
    evictions: int
    head_copies: float  # replicas holding a swarm's whole head at the end, averaged over swarms
    requests_per_replica: tuple[int, ...]
    decisions: dict[str, int] = field(default_factory=dict)  # reason -> count
    prefill_tokens_per_replica: tuple[int, ...] = ()  # prompt tokens computed on each replica
    p95_queue_delay_s: float = 0.0  # wait before a request's prefill starts, 95th percentile
    prefill_tokens_per_s: float = 0.0  # each replica's prefill rate in the run the delay comes from
    busy_hit_rate: float | None = None  # the hit rate in that run, when it is a second, busier run
    busy_request_skew: float | None = None  # and that run's busiest replica over the mean, in requests
    busy_prefill_skew: float | None = None  # and in prefill tokens computed

    @property
    def hit_rate(self) -> float:
        """Prefix-hit tokens over prompt tokens, cluster-wide."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed."""
        return self.prompt_tokens - self.hit_tokens

    @property
    def request_skew(self) -> float:
        """The busiest replica's requests over the mean."""
        return _skew(self.requests_per_replica)

    @property
    def prefill_skew(self) -> float:
        """The busiest replica's prefill tokens computed over the mean."""
        return _skew(self.prefill_tokens_per_replica)


def _skew(per_replica: Sequence[int]) -> float:
    total = sum(per_replica)
    return max(per_replica) * len(per_replica) / total if total else 0.0


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank `fraction` percentile of `values` (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-fraction * len(ordered) // 1)) - 1))]


@dataclass
class SimClock:
    """Seconds of the replayed trace, what the retention of a replica (or of the router's shadows) reads for its
    sessions' pauses, so a replay repeats whatever the machine's speed: a wall clock made `return` retention's
    eviction order, and so every figure, depend on the load."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


class _Events:
    """One replica's KV changes in time order: a request's prompt committed when its prefill ends, all of its
    tokens committed and its pages freed (left cached) when its reply ends. `clock` is the replica's: each change
    happens at its own time, and a request's lookup at its prefill's start."""

    def __init__(self, core: EngineCore, clock: SimClock) -> None:
        self._manager = core.kv
        self._clock = clock
        self._heap: list[tuple[float, int, int, Turn]] = []
        self._order = count()

    def push(self, at_s: float, request: Turn, num_computed_tokens: int) -> None:
        """At `at_s`, the request has KV for its first `num_computed_tokens` tokens (all: it finished)."""
        heapq.heappush(self._heap, (at_s, next(self._order), num_computed_tokens, request))

    def run_until(self, until_s: float) -> None:
        """Apply every change due by `until_s`, then stand the clock at `until_s` (when finite)."""
        while self._heap and self._heap[0][0] <= until_s:
            at_s, _, num_computed, request = heapq.heappop(self._heap)
            self._clock.now_s = at_s
            request.num_computed_tokens = num_computed
            self._manager.commit(request, num_computed)
            if num_computed == len(request.token_ids):
                self._manager.free(request)
                self._manager.close(request.request_id)
        if until_s < math.inf:
            self._clock.now_s = until_s


def simulate(trace: Trace, spec: ClusterSpec, policy: SimPolicy) -> SimResult:
    """Replay `trace` on `spec`'s replicas, routed by `policy` (None: one replica, no router)."""
    if policy is None and spec.replicas != 1:
        raise ValueError(f"no policy routes over {spec.replicas} replicas; give one")
    ids = [f"r{i:02d}" for i in range(spec.replicas)]
    config = EngineConfig(block_size=spec.page_size, retention=spec.retention)
    clocks = {rid: SimClock() for rid in ids}
    cores = {rid: EngineCore(config, spec.pages_per_replica, clock=clocks[rid]) for rid in ids}
    arrivals = SimClock()  # the router's: it routes each request as it arrives
    router = None
    if policy is not None:
        router = Router(
            policy,
            pages_per_replica=spec.pages_per_replica,
            page_size=spec.page_size,
            min_match=spec.min_match,
            imbalance=spec.imbalance,
            seed=spec.seed,
            evict_ahead_pages=spec.evict_ahead_pages,
            retention=spec.retention,
            thresholds=spec.thresholds,
            clock=arrivals,
        )
    loads = dict.fromkeys(ids, 0)
    queue_free_s = dict.fromkeys(ids, 0.0)
    served = dict.fromkeys(ids, 0)
    computed = dict.fromkeys(ids, 0)
    delays_s: list[float] = []
    finishes: list[tuple[float, str]] = []  # (finish_s, replica): in-flight requests, for the loads
    kv_events = {rid: _Events(cores[rid], clocks[rid]) for rid in ids}
    order = count()
    prompt_tokens = hit_tokens = 0
    for req in trace.requests:
        while finishes and finishes[0][0] <= req.arrival_s:
            loads[heapq.heappop(finishes)[1]] -= 1
        prompt = req.prompt
        arrivals.now_s = req.arrival_s
        if router is None:
            rid = ids[0]
        else:
            now, rate = req.arrival_s, spec.prefill_tokens_per_s
            queued = {r: max(0.0, free_s - now) * rate for r, free_s in queue_free_s.items()}
            rid = router.choose(RouteKey(prompt, None, req.session), loads, queued).replica
        # The replica's prefills run one after another: this one looks up what every earlier one left.
        start_s = max(req.arrival_s, queue_free_s[rid])
        kv_events[rid].run_until(start_s)
        core, events = cores[rid], kv_events[rid]
        manager = core.kv
        tokens = prompt + list(req.reply)
        request = Turn(f"q{next(order)}", tokens, SamplingParams(max_tokens=1), session_id=req.session)
        if req.session is not None and core.valid_session_id(req.session):
            core.open_turn(request)
        evict_ahead(manager, tokens, None, spec.evict_ahead_pages)
        hit = manager.lookup(prompt[:-1], None)
        cached = manager.allocate(request, hit, len(tokens) - hit.num_tokens) is not None
        hit_here = hit.num_tokens if cached else 0  # no room beside the running requests: not cached
        prompt_tokens += len(prompt)
        hit_tokens += hit_here
        queue_free_s[rid] = start_s + (len(prompt) - hit_here) / spec.prefill_tokens_per_s
        computed[rid] += len(prompt) - hit_here
        delays_s.append(start_s - req.arrival_s)
        finish_s = queue_free_s[rid] + len(req.reply) / spec.decode_tokens_per_s
        if cached:
            events.push(queue_free_s[rid], request, len(prompt))
            events.push(finish_s, request, len(tokens))
        else:
            manager.close(request.request_id)
        heapq.heappush(finishes, (finish_s, rid))
        loads[rid] += 1
        served[rid] += 1
    for events in kv_events.values():
        events.run_until(math.inf)
    copies = sum(
        sum(
            c.kv.lookup(head, None).num_tokens >= len(head) // spec.page_size * spec.page_size
            for c in cores.values()
        )
        for head in trace.heads
    )
    decisions = {reason: n for (_, reason), n in router.decisions.items()} if router else {}
    return SimResult(
        policy or "one replica",
        spec.replicas,
        prompt_tokens,
        hit_tokens,
        sum(c.kv.num_cached for c in cores.values()),
        sum(c.kv.num_evictions for c in cores.values()),
        copies / len(trace.heads),
        tuple(served[rid] for rid in ids),
        decisions,
        tuple(computed[rid] for rid in ids),
        percentile(delays_s, 0.95),
        spec.prefill_tokens_per_s,
    )


def busy_prefill_rate(trace: Trace, prefill_tokens: int, replicas: int, busy: float) -> float:
    """Each replica's prefill rate (tokens/s) at which `prefill_tokens` over the trace's arrival span keep
    `replicas` replicas `busy` (a fraction) busy: the trace's arrival rate is then that load on the cluster."""
    if not 0.0 < busy <= 1.0:
        raise ValueError(f"busy must be in (0, 1], got {busy}")
    return prefill_tokens / (busy * replicas * arrival_span_s(trace))


def arrival_span_s(trace: Trace) -> float:
    """Seconds from the trace's first arrival to its last (at least one)."""
    return max(1.0, trace.requests[-1].arrival_s - trace.requests[0].arrival_s)


def sweep(
    trace: Trace,
    spec: ClusterSpec,
    replica_counts: Sequence[int],
    policies: Sequence[Policy],
    busy: tuple[int, float] | None = None,
    workers: int = 1,
) -> list[SimResult]:
    """Every policy at every replica count of `spec`'s kind; one run at 1 replica, where every policy routes
    alike (its policy reads "any"). With `busy` = (prefill tokens, fraction), each row also runs again with
    the replicas' prefill rate set so that many tokens over the trace's span keep them that busy (see
    `busy_prefill_rate`), and its queueing delay and rate are that run's. `workers` processes run the rows."""
    if not policies:
        raise ValueError("no routing policy to simulate")
    jobs: list[tuple[ClusterSpec, SimPolicy]] = []
    for num_replicas in replica_counts:
        at = replace(spec, replicas=num_replicas)
        row_policies: list[SimPolicy] = [None] if num_replicas == 1 else list(policies)
        for policy in row_policies:
            jobs.append((at, policy))
            if busy is not None:
                rate = busy_prefill_rate(trace, busy[0], num_replicas, busy[1])
                jobs.append((replace(at, prefill_tokens_per_s=rate), policy))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            runs = list(pool.map(simulate, [trace] * len(jobs), *zip(*jobs, strict=True)))
    else:
        runs = [simulate(trace, at, policy) for at, policy in jobs]
    if busy is not None:  # each light run's figures, with the queueing of its busy twin
        runs = [
            replace(
                light,
                p95_queue_delay_s=busy_run.p95_queue_delay_s,
                prefill_tokens_per_s=busy_run.prefill_tokens_per_s,
                busy_hit_rate=busy_run.hit_rate,
                busy_request_skew=busy_run.request_skew,
                busy_prefill_skew=busy_run.prefill_skew,
            )
            for light, busy_run in zip(runs[::2], runs[1::2], strict=True)
        ]
    return [replace(r, policy="any") if r.replicas == 1 else r for r in runs]


def whole_trace_pages(trace: Trace, page_size: int) -> int:
    """Pages one replica needs to keep every token of the trace cached: never evicting, it loses no hit."""
    # Each request may also start a partly filled page, and copy one, beyond the pages its tokens fill.
    return pages_for(trace.num_unique_tokens, page_size) + 3 * len(trace.requests)


def reference(trace: Trace, spec: ClusterSpec) -> SimResult:
    """The trace on one replica whose KV holds all of it: the hit rate a single cache could reach."""
    big = replace(spec, replicas=1, pages_per_replica=whole_trace_pages(trace, spec.page_size))
    return replace(simulate(trace, big, None), policy="whole trace")
