"""SwarmkvRequestRouter (cluster/ray_router.py) driven as Ray Serve drives it, without a Ray cluster.

Ray Serve hands `choose_replicas` a candidate list on every call and tells the router its replica set through
`update_replicas`. A replica missing from one call's candidates, or avoided by one retried request, is not gone:
its shadow index and sessions must stay, so the agent's next turn goes back to the replica holding its head. The
router forgot them (issue 56's two-replica miss, the lead it left); these tests reproduce that forgetting with a
forced interleaving. Only Ray's import is needed, so they run in the fast tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from itertools import count

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest  # noqa: E402

from swarmkv.cluster.forward import ForwardedRequest, RouteNote  # noqa: E402
from swarmkv.cluster.ray_router import NOTE_KWARG, SwarmkvRequestRouter  # noqa: E402
from swarmkv.cluster.routing import RouteKey  # noqa: E402

DEPLOYMENT = DeploymentID("Engine", "swarmkv")
HEAD = list(range(1000, 1600))  # a swarm's head: 600 tokens, far past the least match
OTHER_HEAD = list(range(5000, 5600))
_ids = count()


class FakeReplica:
    """What the router reads of Ray's RunningReplica: its id, its queue (for Ray's probe) and its limit."""

    max_ongoing_requests = 1024

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()
    asyncio.set_event_loop(None)


def new_router(loop: asyncio.AbstractEventLoop, replicas: list[FakeReplica]) -> SwarmkvRequestRouter:
    async def build() -> SwarmkvRequestRouter:
        router = SwarmkvRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(policy="balanced", min_match=32)
        router.update_replicas(list(replicas))  # type: ignore[arg-type]
        return router

    return loop.run_until_complete(build())


def agent_turn(head: list[int], agent: int, turn: int) -> ForwardedRequest:
    """Agent `agent`'s turn `turn`: the head, its task, then one private segment a turn."""
    tokens = head + [90_000 + agent] * 20 + [80_000 + turn] * 40 * turn
    key = RouteKey(tokens, None, f"agent-{agent}")
    return ForwardedRequest(
        "POST", "/v1/chat/completions", "", (), b"", key, replica_pages=4096, page_size=16
    )


def route(
    loop: asyncio.AbstractEventLoop,
    router: SwarmkvRequestRouter,
    candidates: list[FakeReplica],
    req: ForwardedRequest,
    *,
    completed: bool = True,
) -> RouteNote:
    """Route one request as Ray does (choose, then routed, then completed unless told otherwise)."""

    async def go() -> RouteNote:
        metadata = RequestMetadata(request_id=f"r{next(_ids)}", internal_request_id=f"i{next(_ids)}")
        pending = PendingRequest(args=[req], kwargs={}, metadata=metadata)
        ranks = await router.choose_replicas(candidates, pending)  # type: ignore[arg-type]
        (chosen,) = ranks
        (replica,) = chosen
        note = pending.kwargs[NOTE_KWARG]
        assert isinstance(note, RouteNote) and note.replica == replica.replica_id.unique_id
        router.on_request_routed(pending, replica.replica_id, None)
        if completed:
            router.on_request_completed(replica.replica_id, metadata.internal_request_id)
        return note

    return loop.run_until_complete(go())


def test_a_replica_left_out_of_one_call_keeps_its_agents(loop: asyncio.AbstractEventLoop) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    router = new_router(loop, [a, b])
    first = route(loop, router, [a, b], agent_turn(HEAD, 1, 0))
    assert route(loop, router, [a, b], agent_turn(HEAD, 2, 0)).replica == first.replica  # the swarm's head
    away = b if first.replica == "a" else a
    # Ray leaves the swarm's replica out of one call (another swarm's request): it is still in Ray's set.
    assert route(loop, router, [away], agent_turn(OTHER_HEAD, 7, 0)).replica == away.replica_id.unique_id
    # The agent's next turn goes back to its head, found in the shadow index that call did not erase. (Erased,
    # both replicas look cold and idle, and the one routed to less, the other, took it: 0% from cache.)
    second = route(loop, router, [a, b], agent_turn(HEAD, 1, 1))
    assert (second.replica, second.reason) == (first.replica, "session")
    # A new agent of the same swarm follows the head there too.
    assert route(loop, router, [a, b], agent_turn(HEAD, 3, 0)).replica == first.replica


def test_a_request_retried_elsewhere_does_not_erase_its_replica(loop: asyncio.AbstractEventLoop) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    router = new_router(loop, [a, b])
    first = route(loop, router, [a, b], agent_turn(HEAD, 1, 0))
    # The ingress retries a request whose replica went silent past the timeout (busy, not dead): it avoids it.
    retried = agent_turn(HEAD, 3, 0)
    retried = ForwardedRequest(**{**retried.__dict__, "avoid": (first.replica,)})
    assert route(loop, router, [a, b], retried).replica != first.replica
    second = route(loop, router, [a, b], agent_turn(HEAD, 1, 1))
    assert (second.replica, second.reason) == (first.replica, "session")


def test_a_replica_gone_from_rays_set_is_forgotten(loop: asyncio.AbstractEventLoop) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    router = new_router(loop, [a, b])
    first = route(loop, router, [a, b], agent_turn(HEAD, 1, 0))
    survivor = b if first.replica == "a" else a
    router.update_replicas([survivor])  # type: ignore[arg-type]
    # Ray replaces a replica under a new id; the old one's index and sessions are gone with it.
    replacement = FakeReplica("c")
    router.update_replicas([survivor, replacement])  # type: ignore[arg-type]
    assert router._router is not None and router._router.shadow(first.replica) is None
    after = route(loop, router, [survivor, replacement], agent_turn(HEAD, 1, 1))
    assert after.reason != "session"  # nothing holds its session: it is placed afresh


def test_a_dead_replica_is_forgotten(loop: asyncio.AbstractEventLoop) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    router = new_router(loop, [a, b])
    first = route(loop, router, [a, b], agent_turn(HEAD, 1, 0))
    router.on_replica_actor_died(ReplicaID(first.replica, DEPLOYMENT))
    assert router._router is not None and router._router.shadow(first.replica) is None
