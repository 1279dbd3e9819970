"""Optional API keys: `Authorization: Bearer <key>` on every /v1 route when keys are configured.

Keys are kept only as SHA-256 digests (SLUICE_API_KEYS takes plain keys or `sha256:<hex>`),
compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from sluice.api.errors import ApiError


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_digests(keys: list[str]) -> list[str]:
    return [k.removeprefix("sha256:") if k.startswith("sha256:") else digest(k) for k in keys]


async def require_key(request: Request) -> str | None:
    """The caller's key digest (None when no keys are configured); 401 otherwise."""
    digests: list[str] = request.app.state.sluice.key_digests
    if not digests:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    presented = digest(token.strip())
    if not any(hmac.compare_digest(presented, d) for d in digests):
        raise ApiError(401, "invalid API key", code="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    return presented
