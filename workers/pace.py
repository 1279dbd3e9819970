"""How fast a worker serves its model, for the model's latency targets (`slo` in its deployment).

- `tpot_ms`: a `ConcurrencyGovernor` (batching/slo.py) sees the gap before every token the
  engine hands out (an engine step's time at the concurrency running) and holds the continuous
  policy's admitted concurrency where the median gap meets the target. Token gaps, not finished
  requests: a burst fills the engine long before its first request finishes.
- `ttft_ms`: the worker reports in its heartbeat how many requests it admits at once and how
  many it finishes per second at that concurrency: admitted / (the tokens a request asks for,
  averaged over those running, x the current gap per token), or, with nothing running, the
  mean time one took from start to finish. The api sums them over the model's workers to bound
  the queue: a request it would have to keep waiting past the target is refused at once
  (api/intake.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.batching.base import BatchingPolicy
from sluice.batching.continuous import ContinuousAdmission
from sluice.batching.slo import ConcurrencyGovernor
from sluice.config.model import ModelConfig
from sluice.protocol.messages import FinalResult
from sluice.protocol.states import State
from sluice.workers import metrics
from sluice.workers.generation import Running

_GAP_WINDOW = 32  # token gaps per look at the limit: about one engine step at 32 running
_GAP_SMOOTHING = 0.02  # a gap's weight in the moving average (hundreds come a second)


class Pace:
    def __init__(self, model: ModelConfig, policy: BatchingPolicy, worker: str, *, smoothing: float = 0.2):
        self.model = model
        self.policy = policy
        self.worker = worker
        self.smoothing = smoothing
        self.service_s: float | None = None  # moving average, start to finish, of done requests
        self.gap_s: float | None = None  # moving average of the time between a row's tokens
        self.told = 0  # the admitted concurrency the last heartbeat reported
        self.governor: ConcurrencyGovernor | None = None
        slo = model.slo
        if slo is not None and slo.tpot_ms is not None and isinstance(policy, ContinuousAdmission):
            self.governor = ConcurrencyGovernor(slo.tpot_ms / 1000, policy.capacity, window=_GAP_WINDOW,
                                                quantile=0.5)
            policy.limit = self.governor.limit
        self._gauge()

    @property
    def admitted(self) -> int:
        return self.policy.admitted if isinstance(self.policy, ContinuousAdmission) else self.policy.capacity

    def service_rate(self, expected_tokens: float | None = None) -> float:
        """Requests per second this worker finishes with its admitted concurrency busy (0: unknown
        yet): from the current gap per token when the running requests say how many tokens
        they ask for (`expected_tokens`, their mean), else from finished requests."""
        if expected_tokens and self.gap_s:
            return self.admitted / (expected_tokens * self.gap_s)
        return self.admitted / self.service_s if self.service_s else 0.0

    def token_gap(self, gap_s: float, running: int) -> None:
        """The time one token took after the row's previous one, with `running` requests in the engine."""
        before = self.gap_s
        self.gap_s = gap_s if before is None else (1 - _GAP_SMOOTHING) * before + _GAP_SMOOTHING * gap_s
        if self.governor is not None:
            assert isinstance(self.policy, ContinuousAdmission)
            limit = self.governor.observe(gap_s, running)
            if limit != self.policy.limit:
                self.policy.limit = limit
                self._gauge()

    def finished(self, final: FinalResult) -> None:
        """A request this worker committed (its start-to-finish time, for the rate when idle)."""
        t = final.timings
        if final.status is not State.DONE or t.started is None or t.finished is None:
            return
        took = max(t.finished - t.started, 1e-3)
        before = self.service_s
        self.service_s = took if before is None else (1 - self.smoothing) * before + self.smoothing * took

    def _gauge(self) -> None:
        metrics.ADMITTED_CONCURRENCY.labels(self.model.name, self.worker).set(self.admitted)


def expected_tokens(running: Iterable[Running]) -> float | None:
    """The output tokens a running request asks for, on average (None with none running)."""
    asks = [int(row.get("max_tokens") or run.delivery.message.sampling.max_tokens)
            for run in running for row in run.delivery.message.rows]
    return sum(asks) / len(asks) if asks else None
