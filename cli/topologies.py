"""Moved to sluice.supervisor.topologies; this name stays until the last import of it is rewritten."""

from sluice.supervisor.topologies import LocalCluster, LocalSentinel

__all__ = ["LocalCluster", "LocalSentinel"]
