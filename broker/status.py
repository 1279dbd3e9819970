"""The typed read of a request's status hash: callers never decode the raw Redis fields."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.protocol.messages import FinalResult
from sluice.protocol.states import State


@dataclass(frozen=True)
class RequestStatus:
    """What the broker knows of a request. `result` is set once, with the final state."""

    id: str
    model: str
    state: State
    owner: str | None = None
    lane: str = "interactive"
    entry: str | None = None  # the stream entry that carries it now
    enqueued_at: float | None = None
    started_at: float | None = None
    attempt: int | None = None
    charges: int = 0
    result: FinalResult | None = None

    @property
    def final(self) -> bool:
        return self.state.final and self.result is not None

    @classmethod
    def from_hash(cls, rid: str, model: str, raw: dict[str, str]) -> RequestStatus | None:
        """None for an empty hash (an unknown or expired request)."""
        if not raw:
            return None
        result = raw.get("result")
        return cls(
            id=rid, model=raw.get("model", model), state=State(raw.get("state", State.QUEUED)),
            owner=raw.get("owner") or None, lane=raw.get("lane", "interactive"),
            entry=raw.get("entry") or None,
            enqueued_at=_num(raw.get("enqueued_at")), started_at=_num(raw.get("started_at")),
            attempt=int(raw["attempt"]) if raw.get("attempt") else None, charges=int(raw.get("charges") or 0),
            result=FinalResult.model_validate_json(result) if result else None,
        )


def _num(value: str | None) -> float | None:
    return float(value) if value else None
