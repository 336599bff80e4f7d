"""pflower through Flower's simulation engine on a real multi-node Ray cluster.

Starts a Ray cluster of ``--ray-nodes`` nodes on this machine with Ray's own cluster utility
(``ray.cluster_utils.Cluster``: a head node and worker nodes, each its own raylet and object
store with its own CPUs, joined over loopback as separate machines would join over the
network), points Flower's engine at it with ``RAY_ADDRESS`` (Flower's Ray backend calls
``ray.init()``, which joins the cluster that variable names, as ``docs/scale.md`` describes for
real machines), runs one pflower configuration with ``run_simulation``, and records on which
Ray node every client message ran (``ray.get_runtime_context().get_node_id()``, written by a
thin ClientApp wrapper). Then runs the same configuration on one node (Ray started by
Flower's engine itself, as ``flwr run .`` does) and compares the two runs: every round's
metrics and the final shared parameters, bit for bit.

    python benchmarks/ray_cluster.py                        # 2 nodes, 10 clients, FedAlt
    python benchmarks/ray_cluster.py --ray-nodes 3 --clients 30 --rounds 4

Prints one JSON object: the nodes (id, CPUs), messages per node, wall seconds of each run and
whether the two runs are equal. ``tests/test_ray_cluster.py`` runs the small default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = {
    "algorithm": "fedalt",
    "split": "head",
    "dataset": "digits",
    "model": "mlp",
    "fraction-train": 0.5,
    "evaluate-every": 1,
    "finetune-epochs": 1,
    "console": "compact",
}


class NodeRecordingApp:
    """pflower's ClientApp; every message it handles leaves a file ``<dir>/<ray node id>-<n>``
    (the workers of every node are on this machine, so one directory sees them all)."""

    def __init__(self, run: dict, directory: str) -> None:
        self.run, self.directory, self.app = run, directory, None

    def __call__(self, message, context):
        import ray

        from pflower.client_app import build_client_app

        if self.app is None:
            self.app = build_client_app(self.run)
        node = ray.get_runtime_context().get_node_id()
        mark = Path(self.directory) / f"{node}-{message.metadata.message_id}"
        mark.write_text(str(context.node_config.get("partition-id")))
        return self.app(message, context)


def _client_app(run: dict, directory: str):
    from flwr.clientapp import ClientApp

    recording = NodeRecordingApp(run, directory)
    app = ClientApp()
    for kind in ("train", "evaluate", "query"):
        getattr(app, kind)()(recording)
    return app


def simulate(run: dict, clients: int, out: Path, marks: Path) -> float:
    """One ``run_simulation`` of ``run``; its outputs in ``out``. Returns wall seconds."""
    from flwr.simulation import run_simulation

    from pflower.server_app import build_server_app

    marks.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run_simulation(
        server_app=build_server_app({**run, "outputs-dir": str(out)}),
        client_app=_client_app(run, str(marks)),
        num_supernodes=clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    return time.monotonic() - started


def outputs(out: Path) -> tuple[list, dict]:
    """(every round's train and evaluate metrics, the final shared parameters)."""
    import torch

    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    results = json.loads((run_dir / "results.json").read_text())
    rounds = [{k: r.get(k) for k in ("round", "train", "evaluate")} for r in results["rounds"]]
    for r in rounds:  # wall time is not a result
        for part in (r["train"], r["evaluate"]):
            if isinstance(part, dict):
                part.pop("seconds", None)
    return rounds, torch.load(run_dir / "final-shared.pt")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ray-nodes", type=int, default=2)
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)

    import ray
    import torch
    from ray.cluster_utils import Cluster

    # the seed samples too: the two-node and the one-node run are compared round by round
    run = {**RUN, "num-server-rounds": args.rounds, "seed": args.seed, "sample-seed": args.seed}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pflower-ray-"))

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": args.cpus_per_node, "include_dashboard": False},
    )
    try:
        for _ in range(args.ray_nodes - 1):
            cluster.add_node(num_cpus=args.cpus_per_node)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        ray.init(address=cluster.address)  # as Flower's ray.init() would, to read the nodes
        nodes = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
        ray.shutdown()  # Flower's engine joins by RAY_ADDRESS itself
        cluster_s = simulate(run, args.clients, work / "cluster", work / "marks-cluster")
        ray.shutdown()
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        cluster.shutdown()
    single_s = simulate(run, args.clients, work / "single", work / "marks-single")
    ray.shutdown()

    per_node = Counter(m.name.split("-", 1)[0] for m in (work / "marks-cluster").iterdir())
    ran_on = {node: per_node.get(node, 0) for node in nodes}
    a_rounds, a_final = outputs(work / "cluster")
    b_rounds, b_final = outputs(work / "single")
    equal = (
        a_rounds == b_rounds
        and all(torch.equal(a_final[k], b_final[k]) for k in b_final)
        and set(a_final) == set(b_final)
    )
    result = {
        "ray-nodes": [{"node-id": n, "cpus": c, "messages": ran_on[n]} for n, c in nodes.items()],
        "clients": args.clients,
        "rounds": args.rounds,
        "messages-on-every-node": all(v > 0 for v in ran_on.values()),
        "cluster-wall-s": round(cluster_s, 1),
        "single-node-wall-s": round(single_s, 1),
        "equal-to-single-node": equal,
        "final-personal-accuracy": a_rounds[-1]["evaluate"].get("personal-accuracy"),
        "workdir": str(work),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
