"""SwarmkvRequestRouter: Ray Serve's request-router hook, placing each request with `routing.Router`.

Ray Serve builds one instance per deployment handle, in the handle's process (the ingress), and calls
`choose_replicas` with the healthy replicas. This class only adapts: it keeps each replica's in-flight count
(requests routed and not completed), hands `Router.choose` the candidates' ids and loads, tells it to
`forget` a replica once it is gone for good, and writes the decision (a RouteNote) into the request's kwargs,
so the replica returns it with its response and the ingress can count decisions and label its metrics.

Gone for good means Ray reported the replica's actor dead, or dropped it from its replica set: Ray never
brings a replica back under the same id (a replacement has a new one). A replica missing from one call's
candidates, or one that a retried request avoids (it timed out, perhaps only busy), keeps its shadow index
and sessions: forgetting them sent an agent's next turn away from the replica holding its head.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from swarmkv.cluster.forward import ANY_REPLICA, ForwardedRequest, RouteNote
from swarmkv.cluster.routing import DEFAULT_IMBALANCE, DEFAULT_MIN_MATCH, Policy, Router
from swarmkv.core.config import EngineConfig

NOTE_KWARG = "note"  # the replica method's keyword argument that receives the RouteNote


class SwarmkvRequestRouter(RequestRouter):
    """Routes ForwardedRequests by session, prefix or round-robin; other calls go to the least loaded."""

    def initialize_state(
        self,
        policy: Policy = "prefix",
        min_match: int = DEFAULT_MIN_MATCH,
        imbalance: int = DEFAULT_IMBALANCE,
        seed: int = 0,
        **_: Any,
    ) -> None:
        """Called by Ray Serve with RequestRouterConfig.request_router_kwargs."""
        self._policy: Policy = policy
        self._min_match = min_match
        self._imbalance = imbalance
        self._seed = seed
        self._router: Router | None = None  # built when the first request names the replicas' pool size
        self._in_flight: dict[str, int] = {}
        self._known: set[str] = set()
        # internal request id -> its decision and request, until it is sent (or cancelled)
        self._chosen: dict[str, tuple[RouteNote, PendingRequest]] = {}
        self._targeted: Counter[tuple[str, str]] = Counter()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One replica per request (a rank of one), decided once however often Ray asks again."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._forget_gone(by_id.keys())
        if pending_request is None or not by_id:
            return [list(candidate_replicas)] if candidate_replicas else []
        req = _forwarded(pending_request)
        if req is None:  # a plain method call: `target=<replica id>` picks its replica, else any
            target = pending_request.kwargs.get("target")
            return [[by_id[target]]] if target in by_id else [list(candidate_replicas)]
        for failed in req.avoid:  # left out of this request only: Ray says when a replica is gone
            if failed in by_id and len(by_id) > 1:
                del by_id[failed]
        for request_id in [i for i, (_, pr) in self._chosen.items() if pr.future.cancelled()]:
            del self._chosen[request_id]
        request_id = pending_request.metadata.internal_request_id
        note = self._chosen[request_id][0] if request_id in self._chosen else None
        if note is None or note.replica not in by_id:
            note = self._decide(req, by_id)
            self._chosen[request_id] = (note, pending_request)
        pending_request.kwargs[NOTE_KWARG] = note
        return [[by_id[note.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count the request against its replica until it completes."""
        self._chosen.pop(pending_request.metadata.internal_request_id, None)
        replica = replica_id.unique_id
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request finished (or failed) on its replica."""
        replica = replica_id.unique_id
        if self._in_flight.get(replica, 0) > 0:
            self._in_flight[replica] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's replica set changed: a replica that left it is gone for good."""
        super().update_replicas(replicas)
        self._forget_gone(())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A dead replica's shadow index and sessions go: its sessions re-route and prefill again."""
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _decide(self, req: ForwardedRequest, by_id: dict[str, RunningReplica]) -> RouteNote:
        # Decided but not yet sent counts too: a burst is decided before any of it reaches a replica.
        deciding = Counter(note.replica for note, _ in self._chosen.values())
        loads = {replica: self._in_flight.get(replica, 0) + deciding[replica] for replica in by_id}
        candidates = tuple(sorted(by_id))
        router = self._router_for(req)
        if req.target is not None or router is None:
            replica = req.target if req.target in by_id else min(candidates, key=lambda r: (loads[r], r))
            reason = "target" if req.target is not None and req.target != ANY_REPLICA else "balance"
            if req.key.tokens or req.key.session is not None:  # user traffic, not the ingress's fan-out
                self._targeted[(self._policy, reason)] += 1
            return RouteNote(replica, reason, candidates, self._decisions())
        decision = router.choose(req.key, loads)
        return RouteNote(decision.replica, decision.reason, candidates, self._decisions())

    def _router_for(self, req: ForwardedRequest) -> Router | None:
        if self._router is None and req.replica_pages is not None:
            self._router = Router(
                self._policy,
                pages_per_replica=req.replica_pages,
                page_size=req.page_size or 16,
                min_match=self._min_match,
                imbalance=self._imbalance,
                seed=self._seed,
                retention=req.retention or EngineConfig.retention,
            )
        return self._router

    def _decisions(self) -> dict[tuple[str, str], int]:
        totals = Counter(self._targeted)
        if self._router is not None:
            totals.update(self._router.decisions)
        return dict(totals)

    def _forget_gone(self, candidates: Iterable[str]) -> None:
        """Forget every known replica that is neither in Ray's replica set nor among `candidates`."""
        live = {replica_id.unique_id for replica_id in self.curr_replicas} | set(candidates)
        for gone in self._known - live:
            self._forget(gone)
        self._known = live

    def _forget(self, replica: str) -> None:
        self._in_flight.pop(replica, None)
        self._known.discard(replica)
        if self._router is not None:
            self._router.forget(replica)


def _forwarded(pending_request: PendingRequest) -> ForwardedRequest | None:
    if not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ForwardedRequest) else None
