"""How fast a worker serves its model, for the model's latency targets (`slo` in its deployment).

- `tpot_ms`: a `ConcurrencyGovernor` (batching/slo.py) sees each finished request's time per
  output token and holds the continuous policy's admitted concurrency where it meets target.
- `ttft_ms`: the worker reports in its heartbeat how many requests it admits at once and how
  many it finishes per second at that concurrency (admitted / the mean time one takes from
  start to finish, which stays known while the worker is idle). The api sums them over the
  model's workers to bound the queue: a request it would have to keep waiting past the
  target is refused at once (api/intake.py).
"""

from __future__ import annotations

from sluice.batching.base import BatchingPolicy
from sluice.batching.continuous import ContinuousAdmission
from sluice.batching.slo import ConcurrencyGovernor
from sluice.config.model import ModelConfig
from sluice.protocol.messages import FinalResult
from sluice.protocol.states import State
from sluice.workers import metrics


class Pace:
    def __init__(self, model: ModelConfig, policy: BatchingPolicy, worker: str, *, smoothing: float = 0.2):
        self.model = model
        self.policy = policy
        self.worker = worker
        self.smoothing = smoothing
        self.service_s: float | None = None  # moving average, start to finish, of done requests
        self.governor: ConcurrencyGovernor | None = None
        slo = model.slo
        if slo is not None and slo.tpot_ms is not None and isinstance(policy, ContinuousAdmission):
            self.governor = ConcurrencyGovernor(slo.tpot_ms / 1000, policy.capacity)
            policy.limit = self.governor.limit
        self._gauge()

    @property
    def admitted(self) -> int:
        return self.policy.admitted if isinstance(self.policy, ContinuousAdmission) else self.policy.capacity

    @property
    def service_rate(self) -> float:
        """Requests per second this worker finishes with its admitted concurrency busy (0: unknown yet)."""
        return self.admitted / self.service_s if self.service_s else 0.0

    def finished(self, final: FinalResult, running: int) -> None:
        """A request this worker committed; `running`: how many others were still in the engine."""
        t = final.timings
        if final.status is not State.DONE or t.started is None or t.finished is None:
            return
        took = max(t.finished - t.started, 1e-3)
        before = self.service_s
        self.service_s = took if before is None else (1 - self.smoothing) * before + self.smoothing * took
        tokens = final.usage.completion_tokens if final.usage else 0
        if self.governor is not None and t.first_token is not None and tokens > 1:
            tpot = (t.finished - t.first_token) / (tokens - 1)
            assert isinstance(self.policy, ContinuousAdmission)
            self.policy.limit = self.governor.observe(tpot, running + 1)
            self._gauge()

    def _gauge(self) -> None:
        metrics.ADMITTED_CONCURRENCY.labels(self.model.name, self.worker).set(self.admitted)
