"""`sluice`: thin wrappers that start or call the api, workers and tools."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypedDict

import typer

from sluice.bench.app import bench_app
from sluice.cli.api_keys import keys_app
from sluice.cli.batch import batch_app
from sluice.cli.dead_letters import dlq_app
from sluice.cli.models import models_app
from sluice.cli.shared import AllowAnonymous, ModelsFile, RedisUrl, settings_with, setup_logging
from sluice.cli.webhooks import webhooks_app

# Plain help, as argparse's and clap's (vLLM, uv): a flag without a type, a paragraph wrapped to
# the terminal (up to 120 columns), each option's SLUICE_* variable and default beside its help.
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, context_settings={"max_content_width": 120},
                  help="Queue-fronted LLM serving on Redis and vLLM.")
app.add_typer(models_app, name="models")
app.add_typer(dlq_app, name="dlq")
app.add_typer(bench_app, name="bench")
app.add_typer(batch_app, name="batch")
app.add_typer(keys_app, name="keys")
app.add_typer(webhooks_app, name="webhooks")


class _ServeOptions(TypedDict):
    """uvicorn.run's options shared by one api process and several."""

    host: str
    port: int
    log_level: str
    timeout_graceful_shutdown: int
    timeout_keep_alive: int


@app.command()
def api(
    redis_url: str | None = RedisUrl,
    host: str | None = typer.Option(None, "--host", metavar="ADDRESS", envvar="SLUICE_API_HOST",
                                    help="The address to listen on (default: 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", metavar="PORT", envvar="SLUICE_API_PORT",
                                    help="The port to listen on (default: 8000)."),
    models_file: Path | None = ModelsFile,
    allow_anonymous: bool = AllowAnonymous,
    workers: int = typer.Option(1, "--workers", metavar="N", envvar="SLUICE_API_WORKERS", min=1,
                                help="api processes sharing the port (one per core is the most that helps)."),
) -> None:
    """Start the api: one process, or `--workers N` on one port."""
    import math
    import shutil
    import tempfile

    import uvicorn

    from sluice.api.app import create_app
    from sluice.api.auth import anonymous_listen_error, configured_keys, load_keys
    from sluice.api.connections import guarded, raise_fd_limit

    setup_logging()
    settings = settings_with(redis_url=redis_url, api_host=host, api_port=port, models_file=models_file)
    refused = anonymous_listen_error(settings.api_host, configured_keys(settings), allow_anonymous)
    if refused:
        typer.echo(f"error: {refused}", err=True)
        raise typer.Exit(2)
    load_keys(settings)  # a malformed entry or keys file stops here with its message, not in a traceback
    # SIGTERM closes the listening socket at once; open SSE streams run on for up to
    # shutdown_timeout_s (their own grace), and uvicorn waits a little longer so the streams,
    # not uvicorn, end what is left (an OpenAI stream then aborts its request).
    # uvicorn's own logs (its access log: one line per request, at info) follow SLUICE_LOG_LEVEL
    options = _ServeOptions(host=settings.api_host, port=settings.api_port,
                            log_level=os.environ.get("SLUICE_LOG_LEVEL", "INFO").lower(),
                            timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s) + 2,
                            timeout_keep_alive=math.ceil(settings.api_keep_alive_s))
    # Header and body timeouts and a cap on open connections (api/connections.py); the open-file
    # limit is raised for the cap first (the processes of --workers inherit it).
    allowed = raise_fd_limit(settings.api_max_connections)
    if workers == 1:
        limits = settings.model_copy(update={"api_max_connections": allowed})
        uvicorn.run(create_app(settings, freeze_gc=True), http=guarded(limits), **options)
        return
    # Each process builds its app from SLUICE_* (the options above go there too), and writes its
    # metrics where every process's scrape reads them (api/metrics.py).
    saved = dict(os.environ)  # given back after: a test in this process starts more processes
    os.environ.update({k: str(v) for k, v in (("SLUICE_REDIS_URL", settings.redis_url),
                                              ("SLUICE_MODELS_FILE", settings.models_file)) if v is not None})
    metrics_dir = Path(tempfile.mkdtemp(prefix="sluice-api-metrics-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    try:
        uvicorn.run("sluice.api.app:app_from_environment", factory=True, workers=workers,
                    http="sluice.api.connections:FromEnvironment", **options)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)


@app.command()
def worker(
    model: str = typer.Option(..., "--model", metavar="MODEL", help="The deployed model this worker serves."),
    redis_url: str | None = RedisUrl,
    name: str | None = typer.Option(None, "--name", metavar="NAME", envvar="SLUICE_WORKER_NAME",
                                    help="Stable consumer name (default: <host>-<model>)."),
    engine: str = typer.Option("vllm", "--engine", metavar="vllm|null", envvar="SLUICE_WORKER_ENGINE",
                               help="vllm, or null (no model: measures the queue)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", metavar="PORT",
                                            envvar="SLUICE_WORKER_METRICS_PORT",
                                            help="Serve Prometheus metrics on this port."),
    models_file: Path | None = ModelsFile,
) -> None:
    """Start one worker for one model."""
    import uvloop

    from sluice.workers.engines.factory import EngineKind
    from sluice.workers.process import serve

    setup_logging()
    kinds: dict[str, EngineKind] = {"vllm": "vllm", "null": "null"}
    if engine not in kinds:
        raise typer.BadParameter("--engine must be vllm or null")
    if os.environ.get("SLUICE_WORKER_CPUS"):  # `sluice up` gave this replica its own cores
        from sluice.cli.replicas import pin_to_cpus

        pin_to_cpus(os.environ["SLUICE_WORKER_CPUS"])
    settings = settings_with(redis_url=redis_url, models_file=models_file)
    # uvloop, as `vllm serve` and uvicorn run: the worker's token path is event-loop work
    uvloop.run(serve(settings, model, name, kinds[engine], metrics_port))


@app.command()
def jobs(redis_url: str | None = RedisUrl, models_file: Path | None = ModelsFile) -> None:
    """Start the jobs worker: bulk jobs (batches), on Celery.

    It reads the batch input files, puts their rows on the bulk lane of the same Redis and
    writes the output files."""
    from sluice.workers.jobs.app import run_worker

    setup_logging()
    run_worker(settings_with(redis_url=redis_url, models_file=models_file))


@app.command()
def up(
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", envvar="SLUICE_REDIS_URL",
                                         help="Use this Redis instead of a local one."),
    port: int = typer.Option(8000, "--port", metavar="PORT", envvar="SLUICE_API_PORT",
                             help="The api's port."),
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDRESS", envvar="SLUICE_API_HOST",
                             help="The api's address."),
    models_file: Path | None = ModelsFile,
    allow_anonymous: bool = AllowAnonymous,
    verbose: bool = typer.Option(False, "--verbose/--no-verbose", "-v", envvar="SLUICE_VERBOSE",
                                 show_default=False, help="Show every process's log here too."),
    from_oci: str | None = typer.Option(None, "--from", metavar="oci://REGISTRY/REPO:TAG",
                                        envvar="SLUICE_FROM",
                                        help="Serve a model published with `sluice publish`."),
    trust_artifact: bool = typer.Option(False, "--trust-artifact/--no-trust-artifact",
                                        envvar="SLUICE_TRUST_ARTIFACT", show_default=False,
                                        help="Let the --from artifact run its own code (a custom "
                                             "runtime, trust_remote_code, .py or pickled files), "
                                             "set any engine option and its own replica count."),
) -> None:
    """Run Sluice on this machine: Redis, the api, the workers.

    The embedded default: Redis (a local one unless --redis-url names another), the api, every
    model's worker replicas and the jobs worker, all stopped together."""
    from sluice.cli.up import run_up

    setup_logging()
    if from_oci:
        from sluice.cli.publish import PublishError, pull

        if models_file:
            raise typer.BadParameter("--from brings its own models file: leave --models-file out")
        try:
            settings = settings_with()
            models_file = pull(from_oci, settings.data_dir / "oci", trust=trust_artifact,
                               public_key=settings.artifact_public_key)
        except PublishError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2) from None
    raise typer.Exit(run_up(redis_url, host, port, models_file,
                            allow_anonymous=allow_anonymous, verbose=verbose))


@app.command()
def publish(
    model: str = typer.Argument(..., metavar="MODEL", help="A model of the models file."),
    target: str = typer.Argument(..., metavar="REGISTRY/REPO:TAG", help="Where to push, e.g. "
                                 "registry:5000/sluice/m:v1."),
    models_file: Path | None = ModelsFile,
    plain_http: bool | None = typer.Option(
        None, "--plain-http/--tls", help="HTTP without TLS (default: only for a registry on loopback)."),
    sign_key: Path | None = typer.Option(None, "--sign-key", metavar="FILE", envvar="SLUICE_SIGNING_KEY",
                                         help="Sign the artifact with this Ed25519 private key (PEM); a pull "
                                              "with SLUICE_ARTIFACT_PUBLIC_KEY verifies it."),
) -> None:
    """Push a model to an OCI registry as one artifact.

    The artifact holds the model's prepared files, its deployment, engine and batching
    configuration, schemas and the Sluice version; `sluice up --from oci://...` serves it
    elsewhere. Credentials: the Docker config, or SLUICE_REGISTRY_USERNAME and
    SLUICE_REGISTRY_PASSWORD."""
    from sluice.cli.publish import PublishError
    from sluice.cli.publish import publish as push
    from sluice.config.model import load_models

    setup_logging()
    settings = settings_with(models_file=models_file)
    found = {m.name: m for m in load_models(settings.models_file)}
    if model not in found:
        typer.echo(f"error: no model {model!r} in the models file ({', '.join(found)})", err=True)
        raise typer.Exit(2)
    try:
        digest = push(found[model], target, settings.cache_dir, plain_http=plain_http, sign_key=sign_key)
    except PublishError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"pushed {model} to {target.removeprefix('oci://')} ({digest})")


@app.command()
def compose(
    models_file: Path | None = ModelsFile,
    output: Path | None = typer.Option(None, "--output", "-o", metavar="FILE",
                                       help="Write the file here (default: stdout)."),
    cpu: bool = typer.Option(False, "--cpu",
                             help="The CPU-only variant (a model asking for GPUs is an error)."),
) -> None:
    """Write a compose file for the models file.

    Its services: redis, the api, jobs, and a worker service per model with the replicas, CPU
    and memory limits and GPUs of the model's `deployment`."""
    from sluice.cli.compose import write_compose
    from sluice.config.model import ConfigError

    try:
        models = settings_with(models_file=models_file).models_file
        typer.echo(write_compose(models, output, cpu=cpu), nl=False)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    from sluice.config.model import ConfigError

    try:
        app()
    except ConfigError as err:
        typer.echo(f"configuration error: {err}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
