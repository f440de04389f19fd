"""Under `--api-keys`, no tenant learns of another's schema or traffic: compiled grammars are cached per tenant,
`/metrics` (server-wide counters) answers an admin key only, and cache-break log lines name their tenant and
carry no prompt text unless `--log-cache-break-text` asks for it.

Tenant B sends the schema tenant A sent: what it costs and counts is what a schema nobody sent costs and counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmkv import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer

KEYS = {"alpha": "key-alpha-2", "beta": "key-beta-2", "ops": "key-ops-2"}
TIMEOUT_S = 60
SECRET = "alpha's secret field"


def schema(field: str) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "s",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {field: {"type": "integer"}},
                "required": [field],
                "additionalProperties": False,
            },
        },
    }


@pytest.fixture(scope="module")
def url(scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"{KEYS['alpha']} alpha\n{KEYS['beta']} beta\n{KEYS['ops']} ops admin\n")
    llm = LLM(str(scripted_model_dir), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)
    with BackgroundServer(create_app(llm, ServerConfig(api_keys=key_file))) as served:
        yield served.url


def get(url: str, path: str, tenant: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=TIMEOUT_S)


def chat(url: str, tenant: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **extra}
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def grammar_counts(url: str) -> tuple[float, float]:
    """(grammars compiled, grammar cache hits), as the admin reads them."""
    response = get(url, "/metrics", "ops")
    assert response.status_code == 200, response.text
    samples = {s.name: s.value for f in text_string_to_metric_families(response.text) for s in f.samples}
    return samples["swarmkv_grammars_compiled_total"], samples["swarmkv_grammar_cache_hits_total"]


def test_metrics_answer_the_admin_key_only(url: str) -> None:
    for tenant in ("alpha", "beta"):
        response = get(url, "/metrics", tenant)
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "admin_key_required"
        assert "swarmkv_prompt_tokens_total" not in response.text
    assert "swarmkv_prompt_tokens_total" in get(url, "/metrics", "ops").text
    assert httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).status_code == 401


def test_another_tenants_schema_compiles_as_if_unseen(url: str) -> None:
    chat(url, "alpha", "Give me JSON.", response_format=schema(SECRET))
    before = grammar_counts(url)
    chat(url, "beta", "Give me JSON.", response_format=schema(SECRET))  # alpha's schema: a guess confirmed?
    after_guess = grammar_counts(url)
    chat(url, "beta", "Give me JSON.", response_format=schema("nobody sent this"))
    after_fresh = grammar_counts(url)
    guess = (after_guess[0] - before[0], after_guess[1] - before[1])
    fresh = (after_fresh[0] - after_guess[0], after_fresh[1] - after_guess[1])
    assert guess == fresh == (1, 0)  # compiled, no hit: alpha's schema looks like one nobody sent
    chat(url, "beta", "Give me JSON.", response_format=schema(SECRET))
    again = grammar_counts(url)
    assert (again[0] - after_fresh[0], again[1] - after_fresh[1]) == (0, 1)  # beta's own is cached for beta


def test_a_cache_break_log_line_names_its_tenant_and_holds_no_prompt_text(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="swarmkv")
    chat(url, "alpha", "The launch code is 1111.", session_id="s1")
    chat(url, "alpha", "The launch code is 2222.", session_id="s1")
    deadline = 50
    while deadline and not any("cache break" in r.getMessage() for r in caplog.records):
        httpx.get(f"{url}/health", timeout=TIMEOUT_S)  # the classifier runs on a worker thread
        deadline -= 1
    lines = [r.getMessage() for r in caplog.records if "cache break" in r.getMessage()]
    assert lines and all("tenant=alpha" in line and "session=s1" in line for line in lines), lines
    assert not any("launch code" in line or "2222" in line or "evidence" in line for line in lines), lines


def test_the_cache_views_pool_shows_a_tenant_no_server_wide_traffic(url: str) -> None:
    chat(url, "alpha", "Count my tokens.")
    for tenant, shown in (("beta", False), ("ops", True)):
        pool = get(url, "/v1/cache/tree", tenant).json()["pool"]
        assert (pool["prompt_tokens"] is not None) == shown, (tenant, pool)
        assert (pool["prefix_hit_tokens"] is not None) == shown and pool["pages_total"] > 0
