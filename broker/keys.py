"""Redis key names. All keys of one model share the hash tag {m:<model>} (one cluster slot)."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "sluice"
GROUP = "workers"
MODELS = f"{PREFIX}:models"
WORKERS = f"{PREFIX}:workers"


def idempotency(key: str) -> str:
    return f"{PREFIX}:idem:{key}"


@dataclass(frozen=True)
class ModelKeys:
    model: str

    @property
    def tag(self) -> str:
        return f"{PREFIX}:{{m:{self.model}}}"

    @property
    def requests(self) -> str:
        return f"{self.tag}:req"

    @property
    def bulk(self) -> str:
        return f"{self.tag}:bulk"

    @property
    def dead_letters(self) -> str:
        return f"{self.tag}:dlq"

    @property
    def log(self) -> str:
        return f"{self.tag}:log"

    @property
    def done(self) -> str:
        """Sharded pub/sub channel (SPUBLISH) announcing the model's requests whose final was
        just written: in a cluster it lives on the node of the model's slot, not on every node."""
        return f"{self.tag}:done"

    def reply(self, rid: str) -> str:
        return f"{self.tag}:reply:{rid}"

    def status(self, rid: str) -> str:
        return f"{self.tag}:status:{rid}"

    def response(self, rid: str) -> str:
        """What a Responses API response repeats of its request (instructions, metadata ...)."""
        return f"{self.tag}:resp:{rid}"

    def cancel(self, rid: str) -> str:
        return f"{self.tag}:cancel:{rid}"

    def consumer_lock(self, consumer: str) -> str:
        return f"{self.tag}:consumer:{consumer}"
