"""Optional API keys: `Authorization: Bearer <key>` on every /v1 route when keys are configured.

Keys are kept only as SHA-256 digests (SLUICE_API_KEYS takes plain keys or `sha256:<hex>`),
compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from sluice.api.errors import ApiError


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_digests(keys: list[str]) -> list[str]:
    return [k.removeprefix("sha256:") if k.startswith("sha256:") else digest(k) for k in keys]


# Declares the bearer scheme in the OpenAPI document; the answers stay ours (auto_error off).
bearer = HTTPBearer(auto_error=False, description="an API key from SLUICE_API_KEYS, when keys are set")


async def require_key(request: Request,
                      credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str | None:
    """The caller's key digest (None when no keys are configured); 401 otherwise."""
    digests: list[str] = request.app.state.sluice.key_digests
    if not digests:
        return None
    token = credentials.credentials if credentials else ""
    if not token:
        raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    presented = digest(token.strip())
    if not any(hmac.compare_digest(presented, d) for d in digests):
        raise ApiError(401, "invalid API key", code="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    return presented
