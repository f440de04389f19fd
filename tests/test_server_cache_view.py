"""GET /v1/cache/tree and GET /cache: the radix tree collapsed for reading, and the pool beside it.

The view's shape is checked two ways: on a RadixIndex built directly with thousands of pages (collapse,
aggregation, tiers, pins, holders), and end to end on a tiny Qwen3 server after a small swarm of chats
that share a system prompt, whose head must be one trunk node of exactly the full pages they share.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.engine.llm import LLM
from swarmkv.kv.page_pool import PagePool
from swarmkv.kv.radix_index import RadixIndex
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from swarmkv.server.observability.cache_tree import MAX_CHILDREN, build_view
from tiny_models import make_tiny_checkpoint

PAGE = 4
BLOCK = 16
SYSTEM = (
    "You are one agent of a swarm that maintains a large Python repository. Read the task, call the tools "
    "you need, and answer with a short summary of what you changed and why. Keep every answer short."
)
TASKS = ("Fix the flaky test.", "Rename the config module.", "Add type hints.", "Update the changelog.")


def _index_with_fan(num_leaves: int, head_pages: int = 10) -> tuple[RadixIndex, list[int], list[int]]:
    """A head of `head_pages` full pages, then `num_leaves` tails of 1-3 full pages and a partial leaf."""
    pool = PagePool(head_pages + num_leaves * 4 + 8)
    index = RadixIndex(pool, PAGE)
    head = pool.allocate(head_pages)
    parent = None
    for i, page in enumerate(head):
        index.insert(None, parent, tuple(range(i * PAGE, (i + 1) * PAGE)), page)
        parent = page
    tails: list[int] = []
    for leaf in range(num_leaves):
        parent = head[-1]
        for depth in range(leaf % 3 + 1):
            (page,) = pool.allocate(1)
            index.insert(None, parent, (10_000 + leaf, depth, 0, 0), page)
            parent = page
            tails.append(page)
        (partial,) = pool.allocate(1)
        pool.release([partial])
        index.insert(None, parent, (leaf, 1), partial)
    pool.release(tails)  # every tail finished; the head stays held by whoever holds it
    return index, head, tails


def test_collapse_and_aggregation_keep_thousands_of_pages_readable() -> None:
    index, head, _ = _index_with_fan(3000)
    index.pool.retain(head)  # a second holder of the head (a pin, say): holders 2 on the trunk
    index.pool.retain(head[:3])  # and a third of its first pages only: the chain's max
    records = index.export()
    assert len(records) == 1 + 10 + sum(i % 3 + 2 for i in range(3000))  # root, head, tails and partials
    nodes = build_view(records, pinned=frozenset(head[:2]))
    assert len(nodes) <= 1 + 1 + MAX_CHILDREN + 1

    root, trunk = nodes[0], nodes[1]
    assert root["kind"] == "root" and root["parent"] is None and root["tier"] is None
    assert trunk["trunk"] and trunk["parent"] == root["id"] and trunk["kind"] == "pages"
    assert (trunk["tokens"], trunk["pages"], trunk["start"]) == (10 * PAGE, 10, 0)
    assert trunk["holders"] == 3 and trunk["pinned"] and trunk["tier"] == "device"

    children = [n for n in nodes if n["parent"] == trunk["id"]]
    shown, aggregate = children[:-1], children[-1]
    assert len(shown) == MAX_CHILDREN and all(n["kind"] == "pages" and not n["aggregated"] for n in shown)
    # Largest first; each shown tail collapsed its chain of 3 full pages and a partial leaf into one node.
    assert [n["pages"] for n in shown] == [4] * MAX_CHILDREN
    assert all(n["tokens"] == 3 * PAGE + 2 and n["start"] == 10 * PAGE and n["holders"] == 0 for n in shown)
    assert aggregate["kind"] == "aggregate" and aggregate["aggregated"] == 3000 - MAX_CHILDREN
    total_tail_tokens = sum((i % 3 + 1) * PAGE + 2 for i in range(3000))
    assert aggregate["tokens"] + sum(n["tokens"] for n in shown) == total_tail_tokens
    assert aggregate["span"] == 3 * PAGE + 2 and aggregate["start"] == 10 * PAGE
    assert not aggregate["pinned"] and aggregate["holders"] == 0
    assert [n["id"] for n in nodes] == list(range(len(nodes)))
    assert all(n["parent"] is None or n["parent"] < n["id"] for n in nodes)


def test_a_node_with_few_children_shows_them_all_and_host_pages_are_marked() -> None:
    index, head, _ = _index_with_fan(MAX_CHILDREN + 1, head_pages=2)
    hosts = iter(range(100))
    evicted = index.evict(4, host_page=lambda: next(hosts))  # unheld device leaves go to the host
    assert len(evicted.moved) == 4
    nodes = build_view(index.export())
    trunk = nodes[1]
    children = [n for n in nodes if n["parent"] == trunk["id"]]
    assert len(children) == MAX_CHILDREN + 1 and not any(n["aggregated"] for n in children)
    tiers = {n["tier"] for n in children}
    assert "device" in tiers and tiers & {"host", "mixed"}
    assert trunk["tier"] == "device" and trunk["holders"] == 1 and not trunk["pinned"]  # held since allocated


def test_the_empty_cache_has_no_nodes() -> None:
    assert build_view(RadixIndex(PagePool(4), PAGE).export()) == []


# ---- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, ServerContext]]:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("cache_view") / "qwen3", "qwen3")
    llm = LLM(str(folder), kv_cache_memory="8MiB", block_size=BLOCK, max_model_len=512)
    app = create_app(llm, ServerConfig(served_model_name="tiny"))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        yield http, app.state.ctx
        app.state.ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)


def _messages(task: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def shared_head_tokens(ctx: ServerContext, tasks: tuple[str, ...], page_size: int) -> int:
    """The tokens the tree shares between these chats: their rendered prompts' common prefix, in full pages."""
    texts = [ctx.tokenizer.apply_chat_template(_messages(t)) for t in tasks]
    prompts = [ctx.tokenizer.encode(text, add_special_tokens=False) for text in texts]
    common = len(os.path.commonprefix(prompts))
    return common // page_size * page_size


def test_the_shared_head_is_one_trunk_node_with_each_session_after_it(
    served: tuple[httpx.Client, ServerContext],
) -> None:
    http, ctx = served
    for i, task in enumerate(TASKS):
        body = {"messages": _messages(task), "max_tokens": 4, "temperature": 0, "session_id": f"agent-{i}"}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    head = shared_head_tokens(ctx, TASKS, BLOCK)
    # A pin on the head's first two pages (page-aligned, so its prefill leaves no partial leaf behind).
    first_ids = ctx.tokenizer.encode(
        ctx.tokenizer.apply_chat_template(_messages(TASKS[0])), add_special_tokens=False
    )
    pin = http.post("/v1/cache/pin", json={"prompt_token_ids": first_ids[: 2 * BLOCK]})
    assert pin.status_code == 200, pin.text
    tree = http.get("/v1/cache/tree").json()
    assert tree["object"] == "cache.tree" and tree["page_size"] == BLOCK and head >= 3 * BLOCK

    nodes: list[dict[str, Any]] = tree["nodes"]
    (root,) = [n for n in nodes if n["kind"] == "root"]
    (trunk,) = [n for n in nodes if n["trunk"]]
    assert trunk["parent"] == root["id"] and root["salt"] is None
    assert (trunk["tokens"], trunk["pages"]) == (head, head // BLOCK)
    # The pin holds the head's first pages: one holder at most along the trunk, and it is pinned.
    assert trunk["holders"] == 1 and trunk["pinned"] and trunk["tier"] == "device"
    assert trunk["sessions"] == [f"agent-{i}" for i in range(len(TASKS))] and trunk["num_sessions"] == 4
    tails = [n for n in nodes if n["parent"] == trunk["id"]]
    assert len(tails) == len(TASKS) and all(n["start"] == head and n["holders"] == 0 for n in tails)
    # A tail's full pages name the session that computed them (a partial last page may name none).
    assert all(set(n["sessions"]) <= set(trunk["sessions"]) for n in tails)

    pool = tree["pool"]
    assert pool["pages_total"] == pool["pages_in_use"] + pool["pages_cached"] + pool["pages_free"]
    assert pool["pages_in_use"] == 2  # only the pin holds pages now
    assert pool["pinned_bytes"] > 0
    assert pool["hit_rate"] == pool["prefix_hit_tokens"] / pool["prompt_tokens"] > 0
    assert http.delete(f"/v1/cache/pin/{pin.json()['id']}").status_code == 200
    assert http.get("/v1/cache/tree").json()["nodes"][1]["holders"] == 0


def test_the_cache_page_is_one_self_contained_document(served: tuple[httpx.Client, ServerContext]) -> None:
    http, _ = served
    response = http.get("/cache")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "/v1/cache/tree" in page and 'data-role", "trunk"' in page and "data-tokens" in page
    # Nothing else is fetched: no external scripts, styles, images or fonts (users may be offline).
    for marker in ("<script src", "<link", "@import", "url(http", "https://", "http://cdn"):
        assert marker not in page


def test_the_tree_export_is_made_again_only_when_the_tree_changed() -> None:
    from engine_helpers import tiny_llm
    from swarmkv.server.observability.cache_snapshot import TreeSnapshots

    llm = tiny_llm(block_size=4)
    snapshots = TreeSnapshots()
    llm.generate([list(range(1, 14))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = snapshots.take(llm.engine)
    again = snapshots.take(llm.engine)
    assert again.records is first.records, "an unchanged tree is not exported again"
    assert again.stats == first.stats
    llm.generate([list(range(50, 63))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    changed = snapshots.take(llm.engine)
    assert changed.records is not first.records and len(changed.records) > len(first.records)
    assert changed.records == llm.engine.core.kv.export()
