"""One webhook delivery attempt over HTTP: the endpoint's host resolved once and every address
checked (private ones refused unless allowed), the connection made to the checked address (the
Host header and TLS name are the endpoint's own, so no second lookup can rebind it), Standard
Webhooks headers signed with the `standardwebhooks` library, no redirects, one timeout for the
whole attempt, and the answer's body never read."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

import httpx
from standardwebhooks.webhooks import Webhook

from sluice.broker.webhooks.endpoints import Endpoint
from sluice.protocol.webhooks import check_url, resolve

USER_AGENT = "Sluice-Webhooks/1"


def signed_headers(endpoint: Endpoint, event_id: str, body: str, now: float) -> dict[str, str]:
    """webhook-id, webhook-timestamp and webhook-signature (one `v1,` signature per secret in
    use: two during a rotation's grace period)."""
    at = datetime.fromtimestamp(int(now), tz=UTC)
    signatures = " ".join(Webhook(s).sign(event_id, at, body) for s in endpoint.signing_secrets(now))
    return {"webhook-id": event_id, "webhook-timestamp": str(int(now)), "webhook-signature": signatures,
            "content-type": "application/json", "user-agent": USER_AGENT}


async def post(client: httpx.AsyncClient, endpoint: Endpoint, event_id: str, body: str, *,
               allow_private: bool, timeout_s: float) -> tuple[bool, str]:
    """(delivered, what happened): a 2xx answer is delivered; anything else (another status, a
    redirect, a timeout, a refused address, a connection error) is not, and says why.
    UnsafeUrl from an address that is not allowed is the caller's to count as a failure."""
    scheme, host, port = check_url(endpoint.url)
    address = await asyncio.to_thread(resolve, host, port, allow_private=allow_private)
    parts = urlsplit(endpoint.url)
    netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    url = urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))
    headers = signed_headers(endpoint, event_id, body, time.time())
    headers["host"] = host if port == (443 if scheme == "https" else 80) else f"{host}:{port}"
    extensions = {"sni_hostname": host} if scheme == "https" else {}
    try:
        async with asyncio.timeout(timeout_s):
            request = client.build_request("POST", url, content=body.encode(), headers=headers,
                                           extensions=extensions)
            response = await client.send(request, stream=True, follow_redirects=False)
            await response.aclose()  # the body is never read: an endpoint cannot make the sender hold it
    except TimeoutError:
        return False, f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as err:
        return False, f"{type(err).__name__}: {err}"[:300]
    if 200 <= response.status_code < 300:
        return True, f"HTTP {response.status_code}"
    return False, f"HTTP {response.status_code}"
