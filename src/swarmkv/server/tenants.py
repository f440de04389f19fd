"""Tenants: who a request's API key says it comes from, and the engine names (salts, sessions, pins) it may reach.

`--api-keys FILE` maps keys to tenants, one `KEY TENANT [admin]` line each (`#` starts a comment). A named
tenant's cache salts, session ids and pin ids reach the engine scoped as `TENANT\\0VALUE` (its requests
without a salt run under the salt `TENANT`), so two tenants never share a prefix-cache page, a session or a
pin whatever names their clients send, and one tenant's ids name nothing of another's. With no key, or the
single `--api-key`, every client is the one unnamed tenant: names reach the engine as sent, as before.
The cache view shows a tenant its own roots and sessions only, its own names as it sent them; an admin
tenant sees every tenant's, each root labelled with its tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swarmkv.api.session_id import MAX_SESSION_ID_CHARS
from swarmkv.kv.retention import GROUP_SEP

# Between a tenant's name and a scoped value; never in a name. Retention and pins count a tenant's sessions
# and pins by this prefix, for its share of their caps.
SEP = GROUP_SEP
MAX_TENANT_CHARS = 64
_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a tenant's name reaches logs and metrics: keep it plain
ADMIN_WORD = "admin"


class KeyFileError(ValueError):
    """An `--api-keys` file that cannot be read as `KEY TENANT [admin]` lines."""


@dataclass(frozen=True)
class Tenant:
    """Who sent a request. `name` None: the only tenant (no keys, or one `--api-key`), whose names are unscoped."""

    name: str | None
    admin: bool = False

    @property
    def sees_all(self) -> bool:
        """Whether the cache view shows this tenant every root."""
        return self.name is None or self.admin

    def scope(self, value: str | None, max_chars: int = MAX_SESSION_ID_CHARS) -> str | None:
        """The engine's name for one of this tenant's names (a session, a salt, a pin id); None stays None.

        A scoped value too long for the engine's limit becomes a digest of it: `TENANT\\0#<sha256>`."""
        if value is None or self.name is None:
            return value
        scoped = f"{self.name}{SEP}{value}"
        if len(scoped) <= max_chars:
            return scoped
        return f"{self.name}{SEP}#{hashlib.sha256(value.encode('utf-8', 'surrogatepass')).hexdigest()}"

    def cache_salt(self, salt: str | None) -> str | None:
        """The salt this tenant's request runs under: its own salt nested in the tenant, else the tenant's."""
        if self.name is None:
            return salt
        return self.name if salt is None else f"{self.name}{SEP}{salt}"

    def view(self, engine_value: str | None) -> tuple[str | None, str | None] | None:
        """(tenant, the name as its client sent it) of an engine name, or None when this tenant may not see it."""
        if self.name is None:
            return None, engine_value  # one tenant: every name is its own
        if engine_value is None:
            return (None, None) if self.admin else None  # made by no tenant
        owner, sep, value = engine_value.partition(SEP)
        if owner != self.name and not self.admin:
            return None
        return owner, value if sep else None


ANONYMOUS = Tenant(None)


class TenantKeys:
    """API key -> tenant. Empty: no key needed, every request is the anonymous tenant."""

    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._keys = [(key.encode(), tenant) for key, tenant in keys.items()]

    @property
    def required(self) -> bool:
        """Whether a request needs a key."""
        return bool(self._keys)

    @property
    def num_tenants(self) -> int:
        """How many tenants the keys name (1 without keys)."""
        return max(1, len({tenant.name for _, tenant in self._keys}))

    @classmethod
    def of(cls, api_key: str | None, api_keys: Path | None) -> TenantKeys:
        """The keys `--api-key` and `--api-keys FILE` give; a KeyFileError if both are set or FILE is bad."""
        if api_key and api_keys is not None:
            raise KeyFileError("give --api-key (one tenant) or --api-keys FILE (several), not both")
        if api_keys is not None:
            return cls(read_key_file(api_keys))
        return cls({api_key: ANONYMOUS} if api_key else {})

    def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> Tenant | None:
        """The tenant of `Authorization: Bearer KEY` or `x-api-key: KEY`; None for a missing or unknown key."""
        if not self._keys:
            return ANONYMOUS
        given: list[bytes] = []
        for name, value in headers:
            if name == b"x-api-key":
                given.append(bytes(value).strip())
            elif name == b"authorization":
                scheme, _, token = bytes(value).partition(b" ")
                if scheme.lower() == b"bearer":
                    given.append(token.strip())
        found: Tenant | None = None
        for token in given:
            for key, tenant in self._keys:  # every key compared, so timing says nothing of which matched
                if hmac.compare_digest(token, key) and found is None:
                    found = tenant
        return found


def parse_key_lines(lines: Iterable[str], source: str) -> dict[str, Tenant]:
    """`KEY TENANT [admin]` lines (blank lines and `#` comments skipped) -> key -> tenant; a KeyFileError
    naming `source` and the line for anything else."""
    keys: dict[str, Tenant] = {}
    admins: dict[str, bool] = {}
    for number, raw in enumerate(lines, start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source}:{number}"
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != ADMIN_WORD):
            raise KeyFileError(
                f"{where}: expected 'KEY TENANT' or 'KEY TENANT admin', got {len(words)} words"
                + (f" ending in {words[2]!r}" if len(words) == 3 else "")
            )
        key, name = words[0], words[1]
        if not _NAME.fullmatch(name) or len(name) > MAX_TENANT_CHARS:
            raise KeyFileError(
                f"{where}: tenant {name!r} must be 1-{MAX_TENANT_CHARS} letters, digits, '.', '_' or '-'"
            )
        if key in keys:
            raise KeyFileError(f"{where}: this key is already given on an earlier line")
        admin = len(words) == 3
        if admins.setdefault(name, admin) != admin:
            raise KeyFileError(f"{where}: tenant {name!r} is admin on one line and not on another")
        keys[key] = Tenant(name, admin)
    if not keys:
        raise KeyFileError(f"{source}: no 'KEY TENANT' line: a key file must give at least one key")
    return keys


def read_key_file(path: Path) -> dict[str, Tenant]:
    """The keys of an `--api-keys` file (see `parse_key_lines`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read --api-keys file {str(path)!r}: {exc}") from exc
    return parse_key_lines(text.splitlines(), str(path))


TENANT_SCOPE_KEY = "swarmkv.tenant"  # where the gate leaves a request's Tenant in its ASGI scope
