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
    assert store.get("resp_a") is None and len(store) == 2  # the oldest went first
    deleted = store.delete("resp_b")
    assert deleted is not None and deleted[1] is True  # resp_b was its chain's newest
    now_s[0] = 61.0
    assert store.get("resp_c") is None and len(store) == 0
