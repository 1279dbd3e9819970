"""What several `sluice` commands share: options (each with its `SLUICE_*` variable), the
settings with the options given, the logging set-up."""

from __future__ import annotations

import logging
import os

import typer

from sluice.config.settings import Settings

RedisUrl = typer.Option(None, "--redis-url", metavar="URL", envvar="SLUICE_REDIS_URL",
                        help="Redis URL (redis:// or rediss://).")
ModelsFile = typer.Option(None, "--models-file", metavar="FILE", envvar="SLUICE_MODELS_FILE",
                          help="Model deployments YAML.")
AllowAnonymous = typer.Option(False, "--allow-anonymous/--no-allow-anonymous",
                              envvar="SLUICE_ALLOW_ANONYMOUS", show_default=False,
                              help="Listen on a non-loopback address without SLUICE_API_KEYS (when "
                                   "something in front of the api authenticates callers).")
ApiUrl = typer.Option("http://127.0.0.1:8000", "--url", metavar="URL", envvar="SLUICE_URL",
                      help="The Sluice api.")
ApiKey = typer.Option(None, "--api-key", metavar="KEY", envvar="SLUICE_API_KEY",
                      help="A key of SLUICE_API_KEYS (`sluice keys new`), where the api asks for one.")


def settings_with(**overrides) -> Settings:
    """The settings (SLUICE_*), with the options that were given."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=os.environ.get("SLUICE_LOG_LEVEL", level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
