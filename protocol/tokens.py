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
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.config.model import ModelConfig
from sluice.config.model_paths import local_model_dir
from sluice.protocol.prefix import prefix_keys
from sluice.protocol.rows import prompt_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


MISSING_S = 5.0  # a model whose tokenizer files were not found is looked for again this much later
Loaded = tuple["Tokenizer", int]  # a model's tokenizer and its context length in tokens

# A prompt this short is measured on the event loop: tokenizing it costs less than a thread's round trip.
INLINE_BYTES = 2048


@dataclass(frozen=True)
class Measured:
    """A row's prompt measured at admission: why it cannot fit the context (or None), and its
    prefix key (protocol/prefix.py; empty when not computed)."""

    problem: str | None = None
    prefix: tuple[str, ...] = ()
    tokens: int = 0  # its prompt's tokens, where the prefix key was computed (0: not counted)


class PromptLimits:
    def __init__(self, cache_dir: Path):
        self.cache_dir = cache_dir
        self._loaded: dict[tuple[str, str], Loaded | None] = {}
        # Files not found: looked for again after MISSING_S.
        self._missing_since: dict[tuple[str, str], float] = {}
        self._templates: dict[tuple[str, str, str], PreTrainedTokenizerBase] = {}
        self._no_template: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # one load per model, whichever thread asks first

    def is_loaded(self, model: ModelConfig) -> bool:
        """Whether `model`'s tokenizer was read already (or found unreadable lately): no disk read left."""
        return self._known((model.name, model.path))

    def _known(self, key: tuple[str, str]) -> bool:
        """A tokenizer read stays read; files not found are looked for again after MISSING_S: the
        default model's are written by the first worker to start (workers/model_prep.py), often
        after the api has started, and a miss kept for good left that api without its tokenizer
        (no prefix keys, no context check, /tokenize 501) until it restarted."""
        if key not in self._loaded:
            return False
        return self._loaded[key] is not None or time.monotonic() - self._missing_since[key] < MISSING_S

    async def load(self, model: ModelConfig) -> Loaded | None:
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

    def loaded(self, model: ModelConfig) -> Loaded | None:
        """The model's tokenizer (a `tokenizers.Tokenizer`) and context length, when the api
        can read them; None where it cannot see the model's files."""
        return self._load(model)

    def chat_template(self, model: ModelConfig) -> PreTrainedTokenizerBase | None:
        """A transformers tokenizer for rendering chat messages as the worker does."""
        directory = local_model_dir(model.path, self.cache_dir)
        if directory is None or self.loaded(model) is None:
            return None
        key = ("chat", model.name, model.path)
        if key not in self._templates:
            from transformers import AutoTokenizer

            self._templates[key] = AutoTokenizer.from_pretrained(str(directory))
        return self._templates[key]

    def _load(self, model: ModelConfig) -> Loaded | None:
        key = (model.name, model.path)
        if self._known(key):
            return self._loaded[key]
        with self._lock:
            if self._known(key):
                return self._loaded[key]
            found: Loaded | None = None
            try:
                directory = local_model_dir(model.path, self.cache_dir)
                if directory is not None and (directory / "tokenizer.json").is_file():
                    from tokenizers import Tokenizer

                    config = json.loads((directory / "config.json").read_text())
                    context = model.framework_config.max_model_len or config.get("max_position_embeddings")
                    if context:
                        found = (Tokenizer.from_file(str(directory / "tokenizer.json")), int(context))
            finally:
                self._missing_since[key] = time.monotonic()
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
        return _too_long(len(_token_ids(tokenizer, prompt)), max_tokens, context)

    async def measure(self, model: ModelConfig, row: Mapping[str, Any], max_tokens: int) -> Measured:
        """`check` for a row and, when the deployment has prefix affinity, its prefix key, from one
        tokenization of its prompt (the check alone tokenizes only a prompt that may not fit). A
        chat row's key comes from its messages as the chat template renders them (what the worker's
        engine is given); its context check counts the contents, as `check` does, so it tokenizes a
        second time only for contents that may not fit by their bytes."""
        loaded = await self.load(model)
        if loaded is None or not model.prefix_affinity:
            return Measured(await self.check(model, prompt_text(row), max_tokens))
        if _is_chat(row) and not self._has_template(model):
            await asyncio.to_thread(self._template, model)  # transformers reads files: once, off the loop
        if len(prompt_text(row).encode()) <= INLINE_BYTES:
            return self.measured(model, row, max_tokens)
        return await asyncio.to_thread(self.measured, model, row, max_tokens)

    def measured(self, model: ModelConfig, row: Mapping[str, Any], max_tokens: int) -> Measured:
        """As `measure`, in the calling thread."""
        loaded = self._load(model)
        if loaded is None:
            return Measured()
        tokenizer, context = loaded
        text = prompt_text(row)
        if _is_chat(row):
            problem = None if self._fits(model, text, max_tokens) else self.problem(model, text, max_tokens)
            rendered = self._rendered_chat(model, row)
            ids = _token_ids(tokenizer, rendered) if rendered is not None else []
        else:
            ids = _token_ids(tokenizer, text)
            problem = _too_long(len(ids), max_tokens, context)
        return Measured(problem, tuple(prefix_keys(ids, model.framework_config.cache_block_size)), len(ids))

    def _has_template(self, model: ModelConfig) -> bool:
        key = (model.name, model.path)
        return ("chat", *key) in self._templates or key in self._no_template

    def _template(self, model: ModelConfig) -> PreTrainedTokenizerBase | None:
        """`chat_template`, or None when the model's files have none that transformers can read
        (remembered: a chat row then gets no prefix key, and the engine renders it or refuses)."""
        if (model.name, model.path) in self._no_template:
            return None
        try:
            return self.chat_template(model)
        except Exception as err:  # noqa: BLE001 - no template here: no keys for chat rows
            log.warning("model %r: no chat template readable for prefix keys (%s)", model.name, err)
            self._no_template.add((model.name, model.path))
            return None

    def _rendered_chat(self, model: ModelConfig, row: Mapping[str, Any]) -> str | None:
        """The row's messages as the worker's engine renders them (workers/engines/vllm.py), or None
        when the template cannot: the engine will fail the request, and it needs no key."""
        chat = self._template(model)
        if chat is None:
            return None
        try:
            return chat.apply_chat_template(list(row["messages"]), tools=row.get("tools"), tokenize=False,
                                            add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template refusing the messages: the engine reports it
            return None

    def _fits(self, model: ModelConfig, prompt: str, max_tokens: int) -> bool:
        """True when the prompt fits without counting its tokens (a token is at least one byte),
        or when the tokenizer cannot be read (the engine is left to refuse it)."""
        loaded = self._load(model)
        return loaded is None or len(prompt.encode()) + max_tokens <= loaded[1]


def _is_chat(row: Mapping[str, Any]) -> bool:
    """A row the engine renders with the chat template (Engine.prompt_for)."""
    return "messages" in row and not row.get("prompt")


def _token_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    # encode_batch lets go of the GIL while it works (encode holds it: tokenizing 1.5 M
    # characters stalled every other thread, the event loop included, for 10 s here).
    return tokenizer.encode_batch_fast([text])[0].ids


def _too_long(n: int, max_tokens: int, context: int) -> str | None:
    if n + max_tokens > context:
        return (f"prompt: {n} tokens plus max_tokens {max_tokens} exceed the model's context "
                f"length ({context} tokens)")
    return None
