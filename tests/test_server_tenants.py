"""Tenants (`--api-keys FILE`): one tenant's caches, sessions, pins and stored responses are nobody else's.

One server on the scripted checkpoint with three keys: tenants "alpha" and "beta", and "ops", an admin.
Each test starts from what alpha did and checks what beta can see or reach: nothing of alpha's in
`/v1/cache/tree`, a 404 for each of alpha's ids, no cached tokens for alpha's exact prompt even under
alpha's salt, no cache break against alpha's prompts. The admin's tree shows both. Shares: a tenant's
pins stop at its share of the pinned memory, and past the open-session cap a tenant ends its own sessions.
The cluster's route keys and stored chains are per tenant too.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmkv import LLM
from swarmkv.cluster.route_key import RouteKeyer
from swarmkv.kv.retention import Retention
from swarmkv.server import ServerConfig, create_app
from swarmkv.server import cli as server_cli
from swarmkv.server.background import BackgroundServer
from swarmkv.server.tenants import (
    ANONYMOUS,
    KeyFileError,
    Tenant,
    TenantKeys,
    parse_key_lines,
    read_key_file,
)
from swarmkv.tokenizer import Tokenizer

KEYS = {"alpha": "key-alpha-1", "beta": "key-beta-1", "ops": "key-ops-1"}
KEY_FILE = f"""# tenants of the test server
{KEYS["alpha"]} alpha
{KEYS["beta"]}  beta     # two spaces, then a comment
{KEYS["ops"]}\tops admin
"""
# Long enough for many full pages of the byte-level tokenizer, so a repeat of it is served from the cache.
SYSTEM = "You answer questions about cities. " * 12
ALPHA_SALT = "alpha-secret-salt"
ALPHA_SESSION = "alpha-secret-session"
TIMEOUT_S = 60
# Three tenants' shares of 128 KiB: two pins of SYSTEM (27 pages of 2 KiB each on the scripted model) each.
PINNED_BYTES = 3 * 128 * 1024


class Client:
    """One tenant's HTTP client."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S)

    def chat(self, question: str, **extra: Any) -> dict[str, Any]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        body = {"messages": messages, "max_tokens": 2, "temperature": 0, **extra}
        response = self.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def cached(self, question: str, **extra: Any) -> int:
        return int(self.chat(question, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"])

    def tree(self) -> dict[str, Any]:
        response = self.http.get("/v1/cache/tree")
        assert response.status_code == 200, response.text
        return dict(response.json())


@pytest.fixture(scope="module")
def server(scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(KEY_FILE)
    llm = LLM(
        str(scripted_model_dir),
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_seqs=4,
        max_pinned_memory=PINNED_BYTES,
    )
    with BackgroundServer(create_app(llm, ServerConfig(api_keys=key_file))) as served:
        yield served.url


@pytest.fixture(scope="module")
def alpha(server: str) -> Client:
    return Client(server, KEYS["alpha"])


@pytest.fixture(scope="module")
def beta(server: str) -> Client:
    return Client(server, KEYS["beta"])


@pytest.fixture(scope="module")
def ops(server: str) -> Client:
    return Client(server, KEYS["ops"])


@pytest.fixture(scope="module")
def alpha_response(alpha: Client) -> str:
    """A stored response of alpha's, in alpha's session and under alpha's salt."""
    body = {
        "input": "Alpha's private question about Paris.",
        "max_output_tokens": 2,
        "cache_salt": ALPHA_SALT,
    }
    response = alpha.http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    alpha.chat("Alpha's question about Rome.", cache_salt=ALPHA_SALT, session_id=ALPHA_SESSION)
    return str(response.json()["id"])


def test_the_key_file_maps_keys_to_tenants_and_its_errors_name_the_line(tmp_path: Path) -> None:
    keys = parse_key_lines(KEY_FILE.splitlines(), "keys.txt")
    assert keys == {
        KEYS["alpha"]: Tenant("alpha"),
        KEYS["beta"]: Tenant("beta"),
        KEYS["ops"]: Tenant("ops", admin=True),
    }
    bad = {
        "lonely-key": "keys.txt:2: expected 'KEY TENANT' or 'KEY TENANT admin', got 1 words",
        "k1 alpha root": "keys.txt:2: expected 'KEY TENANT' or 'KEY TENANT admin', got 3 words ending in 'root'",
        "k1 al/pha": "keys.txt:2: tenant 'al/pha' must be 1-64 letters, digits, '.', '_' or '-'",
        "k0 beta": "keys.txt:2: this key is already given on an earlier line",
        "k1 alpha admin": "keys.txt:2: tenant 'alpha' is admin on one line and not on another",
    }
    for line, message in bad.items():
        with pytest.raises(KeyFileError) as caught:
            parse_key_lines(["k0 alpha", line], "keys.txt")
        assert str(caught.value) == message
    with pytest.raises(KeyFileError, match="keys.txt: no 'KEY TENANT' line"):
        parse_key_lines(["# nothing", ""], "keys.txt")
    with pytest.raises(KeyFileError, match="cannot read --api-keys file"):
        read_key_file(tmp_path / "missing.txt")
    with pytest.raises(KeyFileError, match="not both"):
        TenantKeys.of("one-key", tmp_path / "missing.txt")
    with pytest.raises(KeyFileError, match="cannot read"):  # the server refuses to start on a bad file
        create_app(None, ServerConfig(api_keys=tmp_path / "missing.txt"))  # type: ignore[arg-type]


def test_names_are_scoped_per_tenant_and_unscoped_without_keys() -> None:
    alpha = Tenant("alpha")
    assert (alpha.cache_salt(None), alpha.cache_salt("s"), alpha.scope("s"), alpha.scope(None)) == (
        "alpha",
        "alpha\0s",
        "alpha\0s",
        None,
    )
    assert ANONYMOUS.cache_salt("s") == "s" and ANONYMOUS.scope("s") == "s"
    long_id = alpha.scope("x" * 256)
    assert long_id is not None and len(long_id) <= 256 and long_id.startswith("alpha\0#")
    assert alpha.view("alpha\0s") == ("alpha", "s") and alpha.view("beta\0s") is None
    assert alpha.view(None) is None and Tenant("ops", admin=True).view("beta") == ("beta", None)
    keys = TenantKeys.of("only-key", None)
    assert keys.authenticate([(b"x-api-key", b"only-key")]) is ANONYMOUS
    assert keys.authenticate([(b"authorization", b"Bearer wrong")]) is None
    assert TenantKeys.of(None, None).authenticate([]) is ANONYMOUS


def test_an_unknown_key_is_refused(server: str) -> None:
    response = httpx.get(f"{server}/v1/cache/tree", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    response = httpx.get(f"{server}/v1/cache/tree", headers={"x-api-key": KEYS["beta"]})
    assert response.status_code == 200


def test_another_tenants_prompt_gets_no_cached_tokens_even_under_its_salt(
    alpha: Client, beta: Client
) -> None:
    question, salt = "Which river runs through Lyon?", "alpha-leaked-salt"
    alpha.cached(question, cache_salt=salt)
    assert alpha.cached(question, cache_salt=salt) > 0  # alpha's own repeat is served from the cache
    assert beta.cached(question, cache_salt=salt) == 0  # the oracle: beta guessed alpha's prompt and salt
    unsalted = "Which river runs through Bordeaux?"
    alpha.cached(unsalted)
    assert alpha.cached(unsalted) > 0
    assert beta.cached(unsalted) == 0  # no salt at all: still each tenant's own cache


def test_the_tree_shows_a_tenant_its_own_names_only(alpha: Client, beta: Client, alpha_response: str) -> None:
    beta.chat("Beta's question about Oslo.", cache_salt="beta-salt", session_id="beta-session")
    beta_text = json.dumps(beta.tree())
    for secret in (ALPHA_SALT, ALPHA_SESSION, alpha_response, '"alpha"'):
        assert secret not in beta_text
    beta_nodes = beta.tree()["nodes"]
    assert {n["tenant"] for n in beta_nodes} == {"beta"}
    assert any(n["salt"] == "beta-salt" for n in beta_nodes)
    assert any("beta-session" in n["sessions"] for n in beta_nodes)
    assert all("\0" not in json.dumps(n) for n in beta_nodes)  # no engine-scoped name leaks out

    alpha_nodes = alpha.tree()["nodes"]
    assert {n["tenant"] for n in alpha_nodes} == {"alpha"}
    assert any(n["salt"] == ALPHA_SALT for n in alpha_nodes)  # as alpha's client sent it
    assert any(ALPHA_SESSION in n["sessions"] for n in alpha_nodes)
    assert "beta-salt" not in json.dumps(alpha_nodes)


def test_an_admin_sees_every_tenant(ops: Client, alpha: Client, beta: Client, alpha_response: str) -> None:
    beta.chat("Beta's question about Bergen.", cache_salt="beta-salt")
    tree = ops.tree()
    assert {"alpha", "beta"} <= {n["tenant"] for n in tree["nodes"] if n["kind"] == "root"}
    roots = {(n["tenant"], n["salt"]) for n in tree["nodes"] if n["kind"] == "root"}
    assert ("alpha", ALPHA_SALT) in roots and ("beta", "beta-salt") in roots
    assert tree["num_indexed_pages"] > alpha.tree()["num_indexed_pages"]


def test_another_tenants_stored_response_is_a_404(alpha: Client, beta: Client, alpha_response: str) -> None:
    path = f"/v1/responses/{alpha_response}"
    assert beta.http.get(path).status_code == 404
    assert beta.http.delete(path).status_code == 404
    follow_up = {"input": "Go on.", "previous_response_id": alpha_response, "max_output_tokens": 2}
    continued = beta.http.post("/v1/responses", json=follow_up)
    assert continued.status_code == 404 and continued.json()["error"]["param"] == "previous_response_id"
    counted = beta.http.post("/v1/responses/input_tokens", json=follow_up)
    assert counted.status_code == 404
    assert alpha.http.get(path).status_code == 200  # still alpha's, untouched
    assert alpha.http.post("/v1/responses", json=follow_up).status_code == 200


def test_another_tenants_session_and_pin_are_a_404(alpha: Client, beta: Client) -> None:
    alpha.chat("Alpha's question about Nice.", session_id="shared-name")
    assert beta.http.post("/v1/sessions/shared-name/release").status_code == 404
    assert alpha.http.post("/v1/sessions/shared-name/release").status_code == 200

    pin_body = {"messages": [{"role": "system", "content": SYSTEM}], "ttl_s": 60}
    pinned = alpha.http.post("/v1/cache/pin", json=pin_body)
    assert pinned.status_code == 200, pinned.text
    pin_id = pinned.json()["id"]
    assert pin_id.startswith("pin-") and "\0" not in pin_id
    assert beta.http.get(f"/v1/cache/pin/{pin_id}").status_code == 404
    assert beta.http.delete(f"/v1/cache/pin/{pin_id}").status_code == 404
    mine = alpha.http.get(f"/v1/cache/pin/{pin_id}")
    assert mine.status_code == 200 and mine.json()["id"] == pin_id
    assert alpha.http.delete(f"/v1/cache/pin/{pin_id}").status_code == 200


def test_cache_breaks_compare_a_tenants_own_prompts_only(alpha: Client, beta: Client) -> None:
    session = {"session_id": "break-session", "swarmkv_diagnostics": True}
    alpha.chat("Alpha's first turn about Madrid.", **session)
    # Beta's first prompt in a session of the same name diverges from alpha's, but is compared with nothing.
    first = beta.chat("Beta's unrelated turn.", **session)
    assert first["usage"]["swarmkv"]["cache_break"] is None
    again = alpha.chat("Alpha's edited turn about Seville.", **session)
    assert again["usage"]["swarmkv"]["cache_break"] is not None  # alpha's own history still counts


def test_a_tenant_past_the_open_session_cap_ends_its_own_sessions_only() -> None:
    retention = Retention("session", max_open=6)
    for i, session in enumerate(["beta\0b1", "beta\0b2"] + [f"alpha\0a{i}" for i in range(10)]):
        retention.open(f"r{i}", session)
        retention.close(f"r{i}")  # the turn finished: an idle, paused session
    # alpha opened 10 under a cap of 6: its own longest idle went, beta's two older sessions stayed.
    assert retention.num_open == 6
    assert not retention.release("alpha\0a5") and retention.release("alpha\0a6")
    assert retention.release("beta\0b1") and retention.release("beta\0b2")


def test_a_tenant_pins_its_share_and_no_more_leaving_room_for_others(alpha: Client, beta: Client) -> None:
    pin_body = {"messages": [{"role": "system", "content": SYSTEM}], "ttl_s": 60}
    pins = []
    for _ in range(2):
        pinned = alpha.http.post("/v1/cache/pin", json=pin_body)
        assert pinned.status_code == 200, pinned.text
        pins.append(pinned.json()["id"])
    refused = alpha.http.post("/v1/cache/pin", json=pin_body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "pin_limit_exceeded"
    assert "this tenant's share" in refused.json()["error"]["message"]
    theirs = beta.http.post("/v1/cache/pin", json=pin_body)  # alpha's full share leaves beta's whole
    assert theirs.status_code == 200, theirs.text
    for pin_id in pins:
        assert alpha.http.delete(f"/v1/cache/pin/{pin_id}").status_code == 200
    assert beta.http.delete(f"/v1/cache/pin/{theirs.json()['id']}").status_code == 200


def test_the_clusters_route_keys_and_stored_chains_are_per_tenant(scripted_model_dir: Path) -> None:
    keyer = RouteKeyer(Tokenizer.from_hf_dir(scripted_model_dir))
    alpha, beta = Tenant("alpha"), Tenant("beta")
    body = {"messages": [{"role": "user", "content": "Hi"}], "cache_salt": "s", "session_id": "x"}
    raw = json.dumps(body).encode()
    mine, theirs = (keyer.route("POST", "/v1/chat/completions", {}, raw, t).key for t in (alpha, beta))
    assert mine.tokens == theirs.tokens and (mine.salt, mine.session) == ("alpha\0s", "alpha\0x")
    assert (theirs.salt, theirs.session) == (
        "beta\0s",
        "beta\0x",
    )  # beta's shadow index never matches alpha's

    keyer.remember("resp_1", None, "replica-a", [{"role": "user", "content": "secret"}], tenant="alpha")
    assert keyer.route("GET", "/v1/responses/resp_1", {}, b"", alpha).target == "replica-a"
    assert keyer.route("GET", "/v1/responses/resp_1", {}, b"", beta).target is None
    follow_up = json.dumps({"input": "Go on.", "previous_response_id": "resp_1"}).encode()
    assert keyer.replay(follow_up, "resp_1", "beta") is None  # alpha's items are never replayed for beta
    assert b"secret" in (keyer.replay(follow_up, "resp_1", "alpha") or b"")
    keyer.forget("resp_1", "beta")
    assert keyer.route("GET", "/v1/responses/resp_1", {}, b"", alpha).target == "replica-a"


def test_serve_refuses_a_bad_key_file_before_loading_the_model(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    server_cli.register(parser.add_subparsers())
    bad = tmp_path / "keys.txt"
    bad.write_text("k1 alpha\nk2\n")
    with pytest.raises(KeyFileError, match="keys.txt:2: expected 'KEY TENANT'"):
        server_cli.prepare(parser.parse_args(["serve", "--api-keys", str(bad)]))
