"""Moved to sluice.supervisor.processes; this name stays until the last import of it is rewritten."""

from sluice.supervisor.processes import EmbeddedRedis, free_port, stop_processes, wait_ready

__all__ = ["EmbeddedRedis", "free_port", "stop_processes", "wait_ready"]
