"""API keys with scopes, and who may see what.

`SLUICE_API_KEYS` holds comma-separated entries `[scope:]key` or `[scope:]sha256:<hex>`, the
scope `user` or `admin`. An entry without a scope is a `user` key: a key that was written
down before scopes existed gets the least it needs, never configuration or everyone's data.
Keys are kept only as SHA-256 digests and compared in constant time.

A user key submits, and sees and cancels only what it made (requests, files, batches):
anything else answers 404, exactly as a missing id does, so ids cannot be probed. An admin key
does everything, including model configuration, the inference log and the live workers.
Without keys everything is open (the caller is anonymous), and `sluice api` then listens only
on a loopback address unless told `--allow-anonymous`.

Keys may also come from a keys file (SLUICE_KEYS_FILE, config/tenants.py), each with its
tenant. Every caller has a tenant: a SLUICE_API_KEYS key is one of its own, an anonymous
caller is `default`. A tenant configured to `share` lets its keys see and cancel each other's
requests, files and batches.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from dataclasses import dataclass
from typing import Literal

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Send
from starlette.types import Scope as ASGIScope

from sluice.api.errors import ApiError, ErrorResponse, error_body
from sluice.broker.keys import tenant_index
from sluice.config.model import ConfigError
from sluice.config.settings import Settings
from sluice.config.tenants import DEFAULT_TENANT, Tenants, build_tenants, read_keys_file

log = logging.getLogger(__name__)

Scope = Literal["user", "admin"]
SCOPES: tuple[Scope, ...] = ("user", "admin")
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Caller:
    digest: str | None  # the key's digest; None when no keys are configured
    scope: Scope
    tenant: str = DEFAULT_TENANT
    peers: frozenset[str] = frozenset()  # the keys of its tenant, when the tenant shares (else empty)

    @property
    def admin(self) -> bool:
        return self.scope == "admin"

    @property
    def shares(self) -> bool:
        return bool(self.peers)

    @property
    def lists(self) -> str | None:
        """Whose files and batches a listing shows: everyone's (None) to an admin, its tenant's
        when the tenant shares, else its own."""
        if self.admin:
            return None
        return tenant_index(self.tenant) if self.shares else self.digest

    def owns(self, owner: str | None) -> bool:
        """Whether this caller may see and change what the key with digest `owner` made: its
        own, or a key's of its tenant when the tenant shares."""
        return self.admin or (self.digest is not None and owner is not None
                              and (owner == self.digest or owner in self.peers))


ANONYMOUS = Caller(None, "admin")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key(entry: str) -> tuple[str, Scope]:
    """One SLUICE_API_KEYS entry as (digest, scope)."""
    head, sep, rest = entry.partition(":")
    scope: Scope = "user"
    if sep and head in SCOPES:
        scope, entry = head, rest
    if entry.startswith("sha256:"):
        hexdigest = entry.removeprefix("sha256:").lower()
        if not _HEX_DIGEST.fullmatch(hexdigest):
            raise ConfigError("SLUICE_API_KEYS: a sha256: entry needs 64 hex digits (see `sluice keys new`)")
        return hexdigest, scope
    if not entry:
        raise ConfigError(f"SLUICE_API_KEYS: an empty key after {head}:")
    return digest(entry), scope


def key_digests(keys: list[str]) -> dict[str, Scope]:
    """Digest → scope of every configured key; a key given two scopes is a configuration error."""
    scopes: dict[str, Scope] = {}
    for entry in keys:
        d, scope = parse_key(entry)
        if scopes.setdefault(d, scope) != scope:
            raise ConfigError("SLUICE_API_KEYS: one key is listed as both user and admin")
    if scopes and "admin" not in scopes.values():
        log.warning("SLUICE_API_KEYS has no admin key: model configuration, the inference log and "
                    "/v1/workers are refused to every key (mark an operator's key admin:<key>)")
    return scopes


def load_keys(settings: Settings) -> tuple[dict[str, Scope], Tenants]:
    """Digest → scope of every key (SLUICE_API_KEYS' and the keys file's), and the tenants.
    A malformed entry, a bad keys file or a key given two scopes is a ConfigError naming it."""
    scopes = key_digests(settings.api_keys)
    keys_file = None
    if settings.keys_file is not None:
        try:
            keys_file = read_keys_file(settings.keys_file)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for entry in keys_file.keys:
            if scopes.setdefault(entry.digest, entry.scope) != entry.scope:
                raise ConfigError(f"SLUICE_KEYS_FILE {settings.keys_file}: a key is {entry.scope} there and "
                                  f"{scopes[entry.digest]} in SLUICE_API_KEYS")
    return scopes, build_tenants(list(scopes), keys_file)  # (a key of the file keeps its tenant)


def configured_keys(settings: Settings) -> list[str]:
    """What says keys are configured (for the anonymous-listen check): SLUICE_API_KEYS' entries
    and the keys file."""
    return [*settings.api_keys, *([str(settings.keys_file)] if settings.keys_file else [])]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def anonymous_listen_error(host: str, keys: list[str], allow_anonymous: bool) -> str | None:
    """Why the api must not listen on `host`, or None: without keys, anyone who can reach it
    could submit, read every result and reconfigure models."""
    if keys or allow_anonymous or is_loopback(host):
        return None
    return (f"refusing to listen on {host} with no API keys: anyone who can reach it could use and "
            "reconfigure it. Set SLUICE_API_KEYS (make a key with `sluice keys new --scope admin`), "
            "or pass --allow-anonymous (SLUICE_ALLOW_ANONYMOUS=1) if something in front of it "
            "already authenticates callers.")


# Declares the bearer scheme in the OpenAPI document; the answers stay ours (auto_error off).
bearer = HTTPBearer(auto_error=False, description="an API key from SLUICE_API_KEYS, when keys are set")


def caller_for(scopes: dict[str, Scope], authorization: str, tenants: Tenants | None = None) -> Caller:
    """The caller that an Authorization header names (anonymous when no keys are configured),
    with its tenant; 401 for a missing or unknown key."""
    if not scopes:
        return ANONYMOUS
    scheme, _, token = authorization.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if not token:
        raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    presented = digest(token)
    found: Scope | None = None
    for d, scope in scopes.items():  # every digest compared, so the time does not say which matched
        if hmac.compare_digest(presented, d):
            found = scope
    if found is None:
        raise ApiError(401, "invalid API key", code="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    tenants = tenants or Tenants()
    tenant = tenants.tenant_of(presented)
    return Caller(presented, found, tenant, tenants.peers(tenant))


async def require_key(request: Request,
                      _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Caller:
    """The caller (anonymous when no keys are configured); 401 for a missing or unknown key."""
    s = request.app.state.sluice
    return caller_for(s.key_digests, request.headers.get("authorization", ""), getattr(s, "tenants", None))


async def require_admin(caller: Caller = Depends(require_key)) -> Caller:
    if not caller.admin:
        raise ApiError(403, "this route needs an admin key (an admin:<key> entry in SLUICE_API_KEYS)",
                       code="permission_denied")
    return caller


def _needs_key(dependant: Dependant) -> bool:
    return any(d.call is require_key or _needs_key(d) for d in dependant.dependencies)


# Set in a request's scope by a refusal that must not read the body it left unread (api/connections.py).
CLOSE_UNREAD = "sluice.close_unread"


class KeyBeforeBody:
    """Plain ASGI: a request to a route that needs a key is answered 401 before any of its body
    is read. FastAPI reads and parses a body (a multipart upload, spooled to disk, included)
    before it runs the route's dependencies, so without this anyone could make the api read and
    store up to the body limit without a key. The route's own `require_key` still gives it its
    caller; the api's protocol closes the connection after this answer, leaving the body unread."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._routes: dict[int, bool] = {}  # id(route) → whether it needs a key

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._needs_key(scope):
            headers = dict(scope["headers"])
            try:
                authorization = headers.get(b"authorization", b"").decode("latin-1")
                caller_for(scope["app"].state.sluice.key_digests, authorization)
            except ApiError as refused:
                scope[CLOSE_UNREAD] = True  # the api's protocol closes instead of draining the body
                body = error_body(refused.message, refused.code, refused.param)
                await ErrorResponse(body, refused.status, headers=refused.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _needs_key(self, scope: ASGIScope) -> bool:
        for route in scope["app"].router.routes:
            if isinstance(route, APIRoute) and route.matches(scope)[0] is Match.FULL:
                if id(route) not in self._routes:
                    self._routes[id(route)] = _needs_key(route.dependant)
                return self._routes[id(route)]
        return False
