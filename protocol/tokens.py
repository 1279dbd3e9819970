"""Prompt length in tokens, so that a prompt longer than the model's context is refused before it
is queued: a 4xx at the api, an error line of a batch at the jobs worker (workers/jobs/lines.py).

The tokenizer is read from the model directory when the process can see it (the default model's
prepared directory, or a local path); where it cannot, the worker's engine still refuses
the prompt and the request ends failed with the engine's message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from sluice.config.model import ModelConfig
from sluice.config.model_paths import local_model_dir

log = logging.getLogger(__name__)


class PromptLimits:
    def __init__(self, cache_dir: Path):
        self.cache_dir = cache_dir
        self._loaded: dict[tuple[str, str], tuple[object, int] | None] = {}
        self._templates: dict[tuple[str, str, str], object] = {}
        self._lock = threading.Lock()  # one load per model, whichever thread asks first

    def is_loaded(self, model: ModelConfig) -> bool:
        """Whether `model`'s tokenizer was read already (or found unreadable): no disk read left."""
        return (model.name, model.path) in self._loaded

    async def load(self, model: ModelConfig) -> tuple[object, int] | None:
        """As `loaded`, reading the files in a thread when they were not read yet: reading one
        holds the GIL for about a second, which on the event loop stalls every connection."""
        if self.is_loaded(model):
            return self._loaded[(model.name, model.path)]
        return await asyncio.to_thread(self._load, model)

    async def preload(self, models: Iterable[ModelConfig]) -> None:
        """Read these models' tokenizers in a thread (the api's start, before it is ready)."""
        pending = [m for m in models if not self.is_loaded(m)]
        if pending:
            await asyncio.to_thread(self._load_each, pending)

    def _load_each(self, models: list[ModelConfig]) -> None:
        for model in models:
            try:
                self._load(model)
            except Exception as err:  # noqa: BLE001 - unreadable files are the engine's to refuse
                log.warning("model %r: could not read its tokenizer (%s)", model.name, err)

    def loaded(self, model: ModelConfig) -> tuple[object, int] | None:
        """The model's tokenizer (a `tokenizers.Tokenizer`) and context length, when the api
        can read them; None where it cannot see the model's files."""
        return self._load(model)

    def chat_template(self, model: ModelConfig) -> object | None:
        """A transformers tokenizer for rendering chat messages as the worker does."""
        directory = local_model_dir(model.path, self.cache_dir)
        if directory is None or self.loaded(model) is None:
            return None
        key = ("chat", model.name, model.path)
        if key not in self._templates:
            from transformers import AutoTokenizer

            self._templates[key] = AutoTokenizer.from_pretrained(str(directory))
        return self._templates[key]

    def _load(self, model: ModelConfig) -> tuple[object, int] | None:
        key = (model.name, model.path)
        if key in self._loaded:
            return self._loaded[key]
        with self._lock:
            if key in self._loaded:
                return self._loaded[key]
            found: tuple[object, int] | None = None
            try:
                directory = local_model_dir(model.path, self.cache_dir)
                if directory is not None and (directory / "tokenizer.json").is_file():
                    from tokenizers import Tokenizer

                    config = json.loads((directory / "config.json").read_text())
                    context = model.framework_config.max_model_len or config.get("max_position_embeddings")
                    if context:
                        found = (Tokenizer.from_file(str(directory / "tokenizer.json")), int(context))
            finally:
                self._loaded[key] = found  # set once complete: a reader never sees a half-loaded entry
        return found

    async def check(self, model: ModelConfig, prompt: str, max_tokens: int) -> str | None:
        """Why this prompt cannot fit the model's context, or None (read and tokenized off the event loop)."""
        await self.load(model)
        if self._fits(model, prompt, max_tokens):
            return None
        return await asyncio.to_thread(self.problem, model, prompt, max_tokens)

    def problem(self, model: ModelConfig, prompt: str, max_tokens: int) -> str | None:
        """As `check`, in the calling thread (a batch's lines are checked in a thread already)."""
        loaded = self._load(model)
        if loaded is None or self._fits(model, prompt, max_tokens):
            return None
        tokenizer, context = loaded
        # encode_batch lets go of the GIL while it works (encode holds it: tokenizing 1.5 M
        # characters stalled every other thread, the event loop included, for 10 s here).
        n = len(tokenizer.encode_batch_fast([prompt])[0].ids)  # type: ignore[attr-defined]
        if n + max_tokens > context:
            return (f"prompt: {n} tokens plus max_tokens {max_tokens} exceed the model's context "
                    f"length ({context} tokens)")
        return None

    def _fits(self, model: ModelConfig, prompt: str, max_tokens: int) -> bool:
        """True when the prompt fits without counting its tokens (a token is at least one byte),
        or when the tokenizer cannot be read (the engine is left to refuse it)."""
        loaded = self._load(model)
        return loaded is None or len(prompt.encode()) + max_tokens <= loaded[1]
