"""`sluice dlq`: requests that failed every delivery: list, retry, drop."""

from __future__ import annotations

import asyncio

import typer

from sluice.config.settings import Settings

dlq_app = typer.Typer(no_args_is_help=True, help="Requests that failed every delivery: list, retry, drop.")
RedisUrl = typer.Option(None, "--redis-url", metavar="URL", envvar="SLUICE_REDIS_URL",
                        help="The Redis to use (default: that of the `sluice up` running on the data "
                             "directory).")
Model = typer.Option(..., "--model", metavar="MODEL", help="The deployed model.")
Ids = typer.Argument(None, metavar="REQUEST_ID", help="The dead letters' request ids (or --all).")
All = typer.Option(False, "--all", help="Every dead letter of the model.")


def _settings(**overrides) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _redis_url(redis_url: str | None, settings: Settings) -> str:
    """--redis-url or SLUICE_REDIS_URL, else the Redis of the `sluice up` running on the data
    directory, else the default; says which on stderr."""
    from sluice.cli.running import running_redis_url, shown

    if redis_url:
        typer.echo(f"Redis: {shown(redis_url)} (--redis-url or SLUICE_REDIS_URL)", err=True)
        return redis_url
    found = running_redis_url(settings.data_dir)
    if found:
        typer.echo(f"Redis: {shown(found)} (the sluice up running on {settings.data_dir})", err=True)
        return found
    typer.echo(f"Redis: {shown(settings.redis_url)} (the default: no sluice up runs on {settings.data_dir}; "
               "--redis-url or SLUICE_REDIS_URL name another)", err=True)
    return settings.redis_url


def _dead_letters(model: str, redis_url: str | None, action):
    import redis as redis_errors

    from sluice.broker.delivery.dead_letters import DeadLetters
    from sluice.broker.plumbing.connection import connect
    from sluice.broker.registry import ModelRegistry

    settings = _settings()
    url = _redis_url(redis_url, settings)

    async def run():
        redis = connect(url, name="sluice-cli")
        try:
            deployed = await ModelRegistry(redis).get(model)
            if deployed is None:
                names = sorted(m.name for m in await ModelRegistry(redis).all())
                typer.echo(f"error: no model {model!r} is deployed on this Redis "
                           f"({'deployed: ' + ', '.join(names) if names else 'none is'})", err=True)
                raise typer.Exit(2)
            letters = DeadLetters(redis, model, status_ttl_s=settings.status_ttl_s, shards=deployed.shards,
                                  result_ttl_s=deployed.result_ttl_s or settings.result_ttl_s)
            return await action(letters, deployed.max_queued or settings.max_queued)
        finally:
            await redis.aclose()

    try:
        return asyncio.run(run())
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as err:
        from sluice.cli.running import shown

        typer.echo(f"error: no Redis answers at {shown(url)}: {err}", err=True)
        raise typer.Exit(1) from None


def _selection(ids: list[str] | None, all_: bool) -> list[str] | None:
    if bool(ids) == all_:
        raise typer.BadParameter("name request ids, or --all")
    return None if all_ else ids


@dlq_app.command("list")
def dlq_list(model: str = Model, redis_url: str | None = RedisUrl) -> None:
    """List a model's dead letters: request id, deliveries, last error."""
    letters = _dead_letters(model, redis_url, lambda d, _: d.list())
    for d in letters:
        typer.echo(f"{d.request_id}\t{d.attempts}\t{d.error}")
    if not letters:
        typer.echo(f"no dead letters for {model}", err=True)


@dlq_app.command("retry")
def dlq_retry(ids: list[str] | None = Ids, all_: bool = All, model: str = Model,
              redis_url: str | None = RedisUrl) -> None:
    """Put dead-lettered requests back on their queue."""
    chosen = _selection(ids, all_)
    done = _dead_letters(model, redis_url, lambda d, bound: d.retry(chosen, max_queued=bound))
    typer.echo(f"retried {len(done)}: {' '.join(done)}")


@dlq_app.command("drop")
def dlq_drop(ids: list[str] | None = Ids, all_: bool = All, model: str = Model,
             redis_url: str | None = RedisUrl) -> None:
    """Delete dead-lettered requests for good."""
    chosen = _selection(ids, all_)
    done = _dead_letters(model, redis_url, lambda d, _: d.drop(chosen))
    typer.echo(f"dropped {len(done)}: {' '.join(done)}")
