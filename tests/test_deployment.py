"""A real deployment on loopback: a SuperLink with TLS and SuperNode authentication, two
SuperNodes with personal state on disk, FedAlt submitted with ``flwr run``; a SuperNode
restarted between runs resumes its personal layers; an unregistered key is refused. Every
process the test starts is stopped by the test, by its process id (``Federation.stop_all``).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from pflower.deploy import Federation

REPO = Path(__file__).resolve().parents[1]
RUN = {
    "algorithm": "fedalt",
    "dataset": "digits",
    "partitioner": "pathological",
    "split": "head",
    "pretrain-rounds": 0,
    "num-server-rounds": 3,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "evaluate-every": 3,
    "local-epochs": 1,
    "personal-epochs": 1,
    "finetune-epochs": 1,
}

pytestmark = pytest.mark.skipif(
    shutil.which("flower-superlink") is None and not (Path(__import__("sys").executable).parent
                                                      / "flower-superlink").exists(),
    reason="Flower's deployment executables are not installed",
)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_nodes(fed: Federation, count: int, timeout: float = 60) -> None:
    """Until the SuperLink lists ``count`` online SuperNodes."""
    import subprocess

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [str(Path(__import__("sys").executable).parent / "flwr"), "supernode", "ls",
             fed.name, "--format", "json"],
            env=fed.env, capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        try:
            nodes = json.loads(out).get("nodes", [])
        except json.JSONDecodeError:
            nodes = []
        if sum(str(n.get("status", "")).lower() == "online" for n in nodes) >= count:
            return
        time.sleep(1)
    raise AssertionError(f"fewer than {count} SuperNodes online after {timeout} s: {out}")


def _results(outputs: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(outputs.glob("*/results.json"))]


def test_tls_authenticated_federation_keeps_personal_layers(tmp_path):
    fed = Federation(tmp_path / "fed", supernodes=2, port=_free_port())
    outputs = tmp_path / "outputs"
    try:
        fed.prepare()
        fed.start_superlink()
        fed.start_gateway()
        for i in range(2):
            fed.register(i)
            fed.start_supernode(i)
        _wait_nodes(fed, 2)

        first = fed.run({**RUN, "outputs-dir": str(outputs)}, REPO)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        runs = _results(outputs)
        assert len(runs) == 1, first.stdout[-3000:]
        trained = [r for r in runs[0]["rounds"] if r["train"]]
        # every reply carried exactly the shared parameters: a personal name would have been
        # dropped as "names/shapes/dtypes differ" by the strategy
        assert runs[0]["dropped-replies"] == 0
        assert all(r["train"]["applied"] == 2 for r in trained)
        state = fed.state_dir(0) / "personal.pt"
        kept = torch.load(state, weights_only=True)
        assert kept and all(torch.isfinite(t).all() for t in kept.values())

        # restart SuperNode 0 between runs: it must resume from its own layers on disk
        fed.stop("supernode-0")
        fed.start_supernode(0)
        _wait_nodes(fed, 2)
        second = fed.run({**RUN, "num-server-rounds": 1, "outputs-dir": str(outputs)}, REPO)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        latest = _results(outputs)[-1]
        first_round = next(r for r in latest["rounds"] if r["train"])
        assert first_round["train"]["personal-restored"] == 1.0  # both clients resumed

        # a SuperNode whose key was never registered is refused
        intruder = fed.start_supernode(2)  # credentials/supernode-2: generated, not registered
        deadline = time.monotonic() + 90
        while intruder.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        log = (fed.logs / "supernode-2.log").read_text(errors="replace")
        assert intruder.poll() is not None and intruder.returncode != 0, log[-2000:]
        superlink_log = (fed.logs / "superlink.log").read_text(errors="replace")
        assert "No SuperNode found with the given public key" in superlink_log
    finally:
        fed.stop_all()
    assert not fed.processes
