"""The ingress's view of a request: its rendered token prefix and session (a RouteKey), and Responses chains.

The prompt is rendered exactly as a replica will render it (the protocol layer's parsers and renderer,
`swarmkv.api`, with the model's own tokenizer and chat template), so the router matches tokens, not characters. A request the
server would refuse gets an empty key: it goes wherever load says, and the replica answers the 400.
With `--api-keys`, a key's salt and session are its tenant's (`server/tenants.py`), as the replica's engine
sees them, so the router's shadow indexes never match one tenant's prompt to another's pages; a stored
chain is found, and replayed, only for the tenant that stored it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.completion_request import parse_completion_request
from swarmkv.api.errors import APIError, parse_json_body
from swarmkv.api.layout import resolve_layout
from swarmkv.api.messages_request import parse_messages_request
from swarmkv.api.paths import CHAT_ROUTE, COMPLETIONS_ROUTE, MESSAGES_ROUTE, RESPONSES_ROUTE
from swarmkv.api.render import render_completion, render_request
from swarmkv.api.responses_request import parse_responses_request, previous_response_id
from swarmkv.api.session_id import SESSION_HEADER, resolve_session_id
from swarmkv.choices import PromptLayout
from swarmkv.cluster.routing import RouteKey
from swarmkv.tokenizer import Tokenizer

if TYPE_CHECKING:  # the server's package loads torch; the ingress's keys need only its Tenant's methods
    from swarmkv.server.tenants import Tenant

EMPTY_KEY = RouteKey(tokens=())
DEFAULT_CHAINS_MAX = 10_000  # response ids remembered for previous_response_id, oldest forgotten first


@dataclass(frozen=True)
class Chain:
    """Where a stored response lives: its chain's first response id (the chain's session) and its replica, and
    the chain's items up to it (inputs and outputs), to replay it on another replica if that one is lost."""

    first_id: str
    replica: str
    items: tuple[Any, ...] = ()
    tenant: str | None = None  # the tenant that stored it: nobody else's request finds it


@dataclass(frozen=True)
class Routed:
    """A request's route key, and the replica it must go to when it continues or reads a stored response."""

    key: RouteKey
    target: str | None = None
    response_id: str | None = None  # the stored response a Responses request continues (or reads)
    inputs: tuple[Any, ...] = ()  # a stored Responses request's input items, for its chain's replay
    tenant: str | None = None  # the name of the tenant whose key the request carries


class RouteKeyer:
    """Renders requests into route keys; remembers which chain and replica each stored response belongs to."""

    def __init__(
        self, tokenizer: Tokenizer, chains_max: int = DEFAULT_CHAINS_MAX, prompt_layout: PromptLayout = "auto"
    ) -> None:
        self._tokenizer = tokenizer
        self._prompt_layout = prompt_layout  # the replicas' `--prompt-layout`, so keys are their prompts
        self._chains: OrderedDict[str, Chain] = OrderedDict()
        self._chains_max = chains_max

    def route(
        self, method: str, path: str, headers: dict[str, str], body: bytes, tenant: Tenant | None = None
    ) -> Routed:
        """The route of one HTTP request (header names lower-case) of `tenant` (None: no keys, or one), its
        salt and session scoped as the replica's engine will see them."""
        routed = self._route(method, path, headers, body, tenant.name if tenant is not None else None)
        if tenant is None:
            return routed
        key = routed.key
        scoped = RouteKey(key.tokens, tenant.cache_salt(key.salt), tenant.scope(key.session))
        return replace(routed, key=scoped, tenant=tenant.name)

    def _route(
        self, method: str, path: str, headers: dict[str, str], body: bytes, tenant: str | None
    ) -> Routed:
        header_session = headers.get(SESSION_HEADER)
        if path.startswith(RESPONSES_ROUTE + "/") and method in ("GET", "DELETE"):
            response_id = path.removeprefix(RESPONSES_ROUTE + "/")
            return self._to_chain(EMPTY_KEY, response_id, tenant)
        if method != "POST":
            return Routed(self._session_only(header_session))
        try:
            payload = parse_json_body(body) if body else {}  # invalid text is a 400 there, never tokenized
            return self._route_post(path, header_session, payload, tenant)
        except (APIError, ValueError, TypeError, KeyError):  # malformed: the replica answers the 400
            return Routed(EMPTY_KEY)

    def remember(
        self,
        response_id: str,
        continued: str | None,
        replica: str,
        items: Sequence[Any] = (),
        tenant: str | None = None,
    ) -> None:
        """Record a stored response `response_id` that `tenant` made on `replica`, continuing the response
        `continued`; `items` are its request's input items and its output items."""
        previous = self._chain(continued, tenant) if continued is not None else None
        first = previous.first_id if previous is not None else response_id
        history = previous.items if previous is not None else ()
        # A response without items (store: false) cannot be continued, here or elsewhere.
        self._chains[response_id] = Chain(first, replica, history + tuple(items) if items else (), tenant)
        self._chains.move_to_end(response_id)
        while len(self._chains) > self._chains_max:
            self._chains.popitem(last=False)

    def replay(self, body: bytes, response_id: str, tenant: str | None = None) -> bytes | None:
        """`body` continuing `response_id`, rewritten to carry the chain's items itself (no
        previous_response_id), for a replica that lacks the chain; None when the chain is unknown (or
        another tenant's)."""
        chain = self._chain(response_id, tenant)
        if chain is None or not chain.items:
            return None
        payload = json.loads(body)
        del payload["previous_response_id"]
        payload["input"] = [*chain.items, *input_items(payload.get("input"))]
        return json.dumps(payload).encode()

    def forget(self, response_id: str, tenant: str | None = None) -> None:
        """Drop a deleted response of `tenant`'s."""
        if self._chain(response_id, tenant) is not None:
            del self._chains[response_id]

    def _chain(self, response_id: str, tenant: str | None) -> Chain | None:
        """The chain of `tenant`'s stored response; None for an unknown id, or another tenant's."""
        chain = self._chains.get(response_id)
        return chain if chain is not None and chain.tenant == tenant else None

    def _session_only(self, header_session: str | None) -> RouteKey:
        try:
            return RouteKey(tokens=(), session=resolve_session_id(None, header_session))
        except APIError:
            return EMPTY_KEY

    def _route_post(
        self, path: str, header_session: str | None, payload: dict[str, Any], tenant: str | None
    ) -> Routed:
        if path == CHAT_ROUTE:
            chat = parse_chat_request(payload)
            session = resolve_session_id(chat.options.session_id, header_session)
            session = session if session is not None else chat.options.prompt_cache_key
            tokens = render_request(self._tokenizer, chat, resolve_layout(self._prompt_layout, "chat"))[
                1
            ].token_ids
            return Routed(RouteKey(tokens, chat.options.cache_salt, session))
        if path == COMPLETIONS_ROUTE:
            req = parse_completion_request(payload)
            session = resolve_session_id(req.options.session_id, header_session)
            ids = render_completion(self._tokenizer, req.prompt)
            return Routed(RouteKey(ids, req.options.cache_salt, session))
        if path in (MESSAGES_ROUTE, MESSAGES_ROUTE + "/count_tokens"):
            msg = parse_messages_request(payload, needs_max_tokens=path == MESSAGES_ROUTE)
            session = resolve_session_id(msg.user_id, header_session)
            layout = resolve_layout(self._prompt_layout, "messages")
            tokens = render_request(self._tokenizer, msg.chat, layout)[1].token_ids
            return Routed(RouteKey(tokens, msg.chat.options.cache_salt, session))
        if path in (RESPONSES_ROUTE, RESPONSES_ROUTE + "/input_tokens"):
            return self._route_response(payload, header_session, tenant)
        return Routed(self._session_only(header_session))

    def _route_response(
        self, payload: dict[str, Any], header_session: str | None, tenant: str | None
    ) -> Routed:
        continued = previous_response_id(payload)
        req = parse_responses_request(payload, [])  # the chain's earlier items live on its replica
        layout = resolve_layout(self._prompt_layout, "responses")
        tokens = render_request(self._tokenizer, req.chat, layout)[1].token_ids
        session = resolve_session_id(None, header_session)
        session = session if session is not None else req.chat.options.prompt_cache_key
        key = RouteKey(tokens, req.chat.options.cache_salt, session)
        inputs = tuple(input_items(payload.get("input"))) if payload.get("store", True) is not False else ()
        if continued is None:
            return Routed(key, inputs=inputs)
        return replace(self._to_chain(key, continued, tenant), inputs=inputs)

    def _to_chain(self, key: RouteKey, response_id: str, tenant: str | None) -> Routed:
        """A stored response is read or continued only on the replica that stored it."""
        chain = self._chain(response_id, tenant)
        if chain is None:
            return Routed(key, response_id=response_id)
        session_key = RouteKey(key.tokens, key.salt, chain.first_id)
        return Routed(session_key, target=chain.replica, response_id=response_id)


def input_items(value: Any) -> list[Any]:
    """A Responses request's `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []
