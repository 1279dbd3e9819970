"""The states of a request and of a batch, and which of them are final."""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    """A request's state. Once final, a request never changes again (broker/lua/_lib.lua)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset({State.DONE, State.FAILED, State.EXPIRED, State.CANCELLED})


class BatchState(str, enum.Enum):
    """An OpenAI batch's status, in OpenAI's words."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in FINAL_BATCH_STATES


FINAL_BATCH_STATES = frozenset({BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED,
                                BatchState.CANCELLED})
ACTIVE_BATCH_STATES = tuple(s for s in BatchState if not s.final)
