"""The Responses API's store of past responses: bounded by count and by age."""

from __future__ import annotations

from swarmkv.server.responses_store import ResponseStore, StoredResponse


def test_store_evicts_the_oldest_past_its_count_and_expires_by_age() -> None:
    now_s = [0.0]
    store = ResponseStore(2, max_age_s=60.0, clock=lambda: now_s[0])

    def put(response_id: str, session_id: str) -> None:
        store.put(response_id, StoredResponse({"id": response_id}, [], session_id, store.now_s()))

    put("resp_a", "resp_a")
    put("resp_b", "resp_a")
    put("resp_c", "resp_c")
    assert store.get("resp_a", None) is None and len(store) == 2  # the oldest went first
    deleted = store.delete("resp_b", None)
    assert deleted is not None and deleted[1] is True  # resp_b was its chain's newest
    now_s[0] = 61.0
    assert store.get("resp_c", None) is None and len(store) == 0


def test_each_tenant_evicts_only_its_own_and_cannot_reach_another_tenants() -> None:
    store = ResponseStore(4, num_tenants=2)  # a share of 2 each

    def put(response_id: str, tenant: str) -> None:
        store.put(response_id, StoredResponse({"id": response_id}, [], response_id, store.now_s(), tenant))

    put("resp_a1", "a")
    put("resp_a2", "a")
    for i in range(10):  # b fills its share many times over
        put(f"resp_b{i}", "b")
    assert store.count("a") == 2 and store.count("b") == 2
    assert store.get("resp_a1", "a") is not None and store.get("resp_b9", "b") is not None
    assert store.get("resp_a1", "b") is None and store.get("resp_a1", None) is None
    assert store.delete("resp_a1", "b") is None and store.get("resp_a1", "a") is not None
