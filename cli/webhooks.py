"""`sluice webhooks`: endpoints (add, list, rm, test, rotate, disable, enable), the dead deliveries
(dead, with --replay), and the sender process (send). Talks to Redis, as `sluice dlq` does."""

from __future__ import annotations

import asyncio
import json
import uuid

import typer

from sluice.cli.dead_letters import _redis_url
from sluice.cli.shared import RedisUrl
from sluice.cli.shared import settings_with as _settings

webhooks_app = typer.Typer(no_args_is_help=True, help="Webhook endpoints, dead deliveries and the sender.")
EndpointId = typer.Argument(..., metavar="ENDPOINT_ID", help="The endpoint's id (we_...).")


def _run(redis_url: str | None, action):
    from sluice.broker.plumbing.connection import connect

    url = _redis_url(redis_url, _settings())

    async def run():
        redis = connect(url, name="sluice-cli")
        try:
            return await action(redis)
        finally:
            await redis.aclose()

    return asyncio.run(run())


def _show(data) -> None:
    typer.echo(json.dumps(data, indent=2))


@webhooks_app.command("add")
def add(url: str = typer.Argument(..., metavar="URL", help="Where to POST events (http:// or https://)."),
        event: list[str] = typer.Option([], "--event", "-e", metavar="TYPE",
                                        help="An event type to send (repeat; none: all)."),
        owner: str = typer.Option("", metavar="DIGEST",
                                  help="The api key digest (sha256 hex) whose work it hears of; "
                                       "'' without keys."),
        key: str | None = typer.Option(None, metavar="KEY",
                                       help="The api key itself (its digest is stored, not the key)."),
        description: str = typer.Option("", metavar="TEXT", help="A note shown in listings."),
        redis_url: str | None = RedisUrl) -> None:
    """Register an endpoint; its signing secret is shown once."""
    from sluice.api.auth import digest
    from sluice.broker.webhooks.endpoints import EndpointStore
    from sluice.protocol.webhooks import EVENT_TYPES, UnsafeUrl, check_literal, check_url, resolve

    unknown = sorted(set(event) - set(EVENT_TYPES) - {"*"})
    if unknown:
        typer.echo(f"error: unknown event types {unknown}; known: {', '.join(EVENT_TYPES)}", err=True)
        raise typer.Exit(2)
    allow = _settings().webhooks_allow_private
    try:
        _, host, port = check_url(url)
        check_literal(host, allow_private=allow)
        resolve(host, port, allow_private=allow)
    except UnsafeUrl as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    async def action(redis):
        endpoint = await EndpointStore(redis).create(url, event, digest(key) if key else owner, description)
        return {**endpoint.public(), "secret": endpoint.secret}

    _show(_run(redis_url, action))


@webhooks_app.command("list")
def list_endpoints(redis_url: str | None = RedisUrl) -> None:
    """The endpoints (never their secrets)."""
    from sluice.broker.webhooks.endpoints import EndpointStore

    async def action(redis):
        return [e.public() for e in await EndpointStore(redis).list()]

    _show(_run(redis_url, action))


def _one(endpoint_id: str, redis_url: str | None, change) -> None:
    from sluice.broker.webhooks.endpoints import EndpointStore

    async def action(redis):
        return await change(EndpointStore(redis), redis)

    found = _run(redis_url, action)
    if found is None or found is False:
        typer.echo(f"error: no webhook endpoint {endpoint_id!r}", err=True)
        raise typer.Exit(1)
    _show(found)


@webhooks_app.command("rm")
def rm(endpoint_id: str = EndpointId, redis_url: str | None = RedisUrl) -> None:
    """Delete an endpoint (its deliveries still waiting are dropped)."""
    async def change(store, redis):
        return {"id": endpoint_id, "deleted": True} if await store.delete(endpoint_id) else None

    _one(endpoint_id, redis_url, change)


@webhooks_app.command("rotate")
def rotate(endpoint_id: str = EndpointId, redis_url: str | None = RedisUrl) -> None:
    """A new signing secret, shown once (the previous one still signs for 24 h)."""
    async def change(store, redis):
        e = await store.rotate(endpoint_id)
        return e and {**e.public(), "secret": e.secret}

    _one(endpoint_id, redis_url, change)


@webhooks_app.command("disable")
def disable(endpoint_id: str = EndpointId,
            enable: bool = typer.Option(False, "--enable", help="Enable it again instead."),
            redis_url: str | None = RedisUrl) -> None:
    """Stop (or with --enable, resume) sending to an endpoint."""
    async def change(store, redis):
        e = await store.set_enabled(endpoint_id, enable)
        return e and e.public()

    _one(endpoint_id, redis_url, change)


@webhooks_app.command("test")
def test(endpoint_id: str = EndpointId, redis_url: str | None = RedisUrl) -> None:
    """Send a `webhook.test` event to one endpoint (through the running sender)."""
    from sluice.broker.webhooks.deliveries import Deliveries
    from sluice.protocol.webhooks import probe_payload

    async def change(store, redis):
        if await store.get(endpoint_id) is None:
            return None
        event = f"msg_{uuid.uuid4().hex}"
        await Deliveries(redis).enqueue([(endpoint_id, event, probe_payload(event))], lease_s=0)
        return {"id": event, "type": "webhook.test", "queued": True}

    _one(endpoint_id, redis_url, change)


@webhooks_app.command("dead")
def dead(replay: bool = typer.Option(False, "--replay",
                                     help="Deliver them again, with a fresh retry period."),
         event_id: list[str] = typer.Option([], "--id", metavar="ID",
                                            help="Only this delivery or event id (repeat)."),
         limit: int = typer.Option(100, min=1, metavar="N", help="Show at most this many."),
         redis_url: str | None = RedisUrl) -> None:
    """Deliveries that failed for their whole retry period; --replay sends them again."""
    from sluice.broker.webhooks.deliveries import Deliveries

    async def action(redis):
        d = Deliveries(redis)
        if replay:
            return {"replayed": await d.replay(event_id or None)}
        return [x for x in await d.dead(limit)
                if not event_id or x["id"] in event_id or x["event_id"] in event_id]

    _show(_run(redis_url, action))


@webhooks_app.command("send")
def send(metrics_port: int | None = typer.Option(None, metavar="PORT",
                                                 help="Serve Prometheus metrics on this port."),
         redis_url: str | None = RedisUrl) -> None:
    """Run a webhook sender (as many as you like: they share the work through a consumer group)."""
    import uvloop

    from sluice.cli.shared import setup_logging
    from sluice.workers.webhooks.process import serve

    setup_logging()
    settings = _settings(redis_url=redis_url)
    uvloop.run(serve(settings, metrics_port))
