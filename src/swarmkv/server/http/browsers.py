"""What keeps other web pages off the server (Host, content type, Origin), and CORS for the pages it names.

A browser lets any page it shows send some requests to any address, this server's loopback port included:
"simple" POSTs (a text/plain, form or multipart body, or none) without asking first and, once DNS rebinding
has pointed the page's own name at 127.0.0.1, any request whose answer the page may then read. So:
- Host (400): a rebinding page's requests still carry its own name, so a name the server was not told to
  answer (`--allowed-hosts`) is refused. IP addresses and localhost always pass: a page names them only when
  it was loaded from them, which is no rebinding. A request without a Host passes (HTTP/1.0; the cluster's
  in-process calls): browsers always send one.
- Content type (415): a POST with a body must say JSON (`application/json`, or `application/*+json`, as
  FastAPI, and so vLLM, takes it), which a page of another origin cannot send without a CORS preflight.
- Origin (403): a POST or DELETE from a page whose origin is neither this server's nor one `--cors-origins`
  names; this refuses what the content type cannot, the bodyless POSTs (a session's release).
CORS itself is Starlette's middleware, installed only when `--cors-origins` names some origin.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse, Response

from swarmkv.api.errors import APIError
from swarmkv.server.config import ServerConfig

# Methods that change nothing (a preflight is an OPTIONS), so a page of another origin may send them.
_SAFE_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))
_CORS_METHODS = ("GET", "HEAD", "POST", "DELETE")


@dataclass(frozen=True)
class BrowserChecks:
    """The Host names a server answers (None: any) and the origins whose pages may call it ('*': any)."""

    host_names: frozenset[str] | None
    cors_origins: tuple[str, ...]

    @classmethod
    def of(cls, config: ServerConfig) -> BrowserChecks:
        """The checks `config`'s --host, --allowed-hosts and --cors-origins ask for."""
        return cls(config.allowed_host_names, config.cors_origin_list)

    def host_refusal(self, headers: Headers) -> APIError | None:
        """A 400 when the Host header names a host this server was not told to answer."""
        host = headers.get("host")
        if host is None or self.host_names is None:
            return None
        name = host_name(host)
        if name == "localhost" or name in self.host_names or _is_ip_address(name):
            return None
        return APIError(
            400,
            f"this server does not answer to the host name {name!r} (the request's Host header), which keeps "
            f"web pages that rebind their DNS name to it out; to answer this name, start it with "
            f"`swarmkv serve --allowed-hosts {name or '...'}` (or '*' for any name)",
            code="host_not_allowed",
        )

    def write_refusal(self, method: str, path: str, headers: Headers) -> APIError | None:
        """A 415 for a POST whose body is not declared JSON, a 403 for a write from another site's page."""
        content_type = headers.get("content-type")
        # A body must say it is JSON; a POST without one (a release) need not say anything.
        unsaid = content_type is None and _has_body(headers)
        if method == "POST" and (unsaid or (content_type is not None and not is_json(content_type))):
            given = "none" if content_type is None else repr(content_type)
            return APIError(
                415,
                f"{method} {path} takes a JSON body with 'Content-Type: application/json' (this request's "
                f"content type: {given}); `curl -d` sends 'application/x-www-form-urlencoded', so add "
                f"-H 'content-type: application/json'",
                code="unsupported_media_type",
            )
        origin = headers.get("origin")
        if method in _SAFE_METHODS or origin is None or self._cors_allows(origin):
            return None
        host = headers.get("host", "").strip().lower()
        if host and _netloc(origin) == host:
            return None  # the server's own page (/cache)
        return APIError(
            403,
            f"{method} {path} came from a web page of {origin!r}: this server takes writes from browsers only "
            f"from its own pages and from the origins `swarmkv serve --cors-origins` names",
            code="origin_not_allowed",
        )

    def _cors_allows(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin.strip().lower() in self.cors_origins

    def cors_middleware(self) -> list[Middleware]:
        """Starlette's CORS middleware for the listed origins; none (no CORS headers at all) when none are."""
        if not self.cors_origins:
            return []
        return [
            Middleware(
                _ListedOriginsCORS,
                allow_origins=self.cors_origins,
                allow_methods=_CORS_METHODS,
                allow_headers=("*",),  # the SDKs' own (anthropic-version, x-stainless-*) as well as auth
                # A public page calling a loopback server asks first (Chrome's private network access);
                # naming its origin is the consent.
                allow_private_network=True,
            )
        ]


class _ListedOriginsCORS(CORSMiddleware):
    """Starlette's CORS, but a preflight from an origin it does not list gets no Access-Control header at all
    (Starlette's still names the methods and max age)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        if not self.is_allowed_origin(request_headers["origin"]):
            return PlainTextResponse(
                "this origin may not call this server (swarmkv serve --cors-origins)", 400
            )
        return super().preflight_response(request_headers)


def host_name(host: str) -> str:
    """The host of a Host header's value, lower case, without its port, IPv6 brackets or final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port; an unbracketed IPv6 address has several colons
        host = host.partition(":")[0]
    return host.rstrip(".")


def is_json(content_type: str) -> bool:
    """Whether a Content-Type (its parameters aside) is JSON: application/json or application/*+json."""
    kind, _, subtype = content_type.partition(";")[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _netloc(origin: str) -> str:
    """An Origin header's host[:port], lower case; empty for "null" or one that is no URL."""
    try:
        return urlsplit(origin.strip()).netloc.lower()
    except ValueError:  # "http://[::1": an unclosed IPv6 address
        return ""


def _has_body(headers: Headers) -> bool:
    length = headers.get("content-length")
    return "transfer-encoding" in headers or (length is not None and length.strip() != "0")


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
