"""Custom runtimes the end-to-end tests deploy beside the real engine."""

from __future__ import annotations

from sluice.workers.engines.base import Engine
from sluice.workers.engines.custom import CustomRuntime
from sluice.workers.engines.null import NullEngine


class NullRuntime(CustomRuntime):
    """A second model that needs no engine of its own (" t0 t1 ..."): a models file with two
    models and several replicas, on a 2-core machine."""

    def create_engine(self) -> Engine:
        return NullEngine(delay_s=0.01)
