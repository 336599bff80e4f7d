"""Past one machine: pflower on a real multi-node Ray cluster (issue 29).

``benchmarks/ray_cluster.py`` starts a Ray cluster of two nodes on this machine (Ray's own
``cluster_utils.Cluster``: two raylets, each with its own CPU), points Flower's simulation
engine at it with ``RAY_ADDRESS`` and runs pflower; the clients' messages must run on both
nodes, and the run must equal, bit for bit, the same run on one node. A drill (``pytest -m drill``,
about a minute); skipped where Ray is not installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.drill
def test_two_ray_nodes_share_the_clients_and_equal_one_node(tmp_path):
    import ray_cluster

    result = ray_cluster.main(
        ["--ray-nodes", "2", "--clients", "6", "--rounds", "2", "--workdir", str(tmp_path)]
    )
    nodes = result["ray-nodes"]
    assert len(nodes) == 2 and all(n["cpus"] == 1 for n in nodes)
    assert all(n["messages"] > 0 for n in nodes), nodes  # both nodes ran clients
    assert sum(n["messages"] for n in nodes) >= 2 * 3 + 6  # 2 rounds x 3 trainers + evaluation
    assert result["equal-to-single-node"]
