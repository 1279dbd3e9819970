"""The Redis servers tests and `sluice up` start for themselves: a cluster node's port leaves
room for its bus (port + 10000 ≤ 65535), the first time and when its first port was taken."""

from __future__ import annotations

import socket
from pathlib import Path

from sluice.supervisor.processes import EmbeddedRedis, free_port
from sluice.supervisor.topologies import CLUSTER_PORT_BOUND, LocalCluster


def test_a_port_drawn_under_a_bound_is_under_it_and_free() -> None:
    for _ in range(300):
        port = free_port(below=CLUSTER_PORT_BOUND)
        assert port < CLUSTER_PORT_BOUND
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # (free an instant ago: another test may take it, rarely)


def test_every_node_of_a_local_cluster_can_have_its_bus(tmp_path: Path) -> None:
    assert all(node.port < CLUSTER_PORT_BOUND for node in LocalCluster(tmp_path).nodes)


def test_a_node_whose_port_was_taken_chooses_again_under_the_bound(tmp_path: Path) -> None:
    node = EmbeddedRedis(tmp_path, appendonly=False, below=CLUSTER_PORT_BOUND)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", node.port))
        taken.listen()
        first = node.port
        node.start()
    try:
        assert node.port != first and node.port < CLUSTER_PORT_BOUND
    finally:
        node.stop()
