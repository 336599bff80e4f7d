"""A real deployment on loopback: a SuperLink with TLS and SuperNode authentication behind
the Fleet gateway, two SuperNodes with personal state on disk, FedAlt submitted with ``flwr
run``; outsiders refused, kill -9 of a SuperNode and of the SuperLink survived. Every process
the test starts is stopped by the test, by its process id (``Federation.stop_all``).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pflower.deploy import Federation, connection

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


def _node_ids(fed: Federation) -> set[int]:
    import subprocess

    out = subprocess.run(
        [str(Path(__import__("sys").executable).parent / "flwr"), "supernode", "ls", fed.name,
         "--format", "json"],
        env=fed.env, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    return {int(n["node-id"]) for n in json.loads(out).get("nodes", [])}


def _wait_for(path: Path, text: str, proc, timeout: float = 300, count: int = 1) -> None:
    """Until ``text`` appears ``count`` times in the log ``path``, while ``flwr run``
    (``proc``) runs. 300 s: on a loaded 2-core box (another drill installing torch beside
    it) the run's start and round 1 once took longer than 120 s; a wait that ends on time
    costs nothing."""
    deadline, said = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        said = path.read_text(errors="replace") if path.exists() else ""
        if said.count(text) >= count:
            return
        assert proc.poll() is None, f"the run ended before {text!r}:\n{said[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {count} x {text!r} after {timeout} s:\n{said[-3000:]}")


@pytest.mark.drill
def test_a_tls_federation_keeps_personal_layers_refuses_outsiders_and_survives_kill_9(
    tmp_path,
):
    """One federation as an operator meets it (TLS, SuperNode authentication, personal layers
    on the devices' disks), every fault a SIGKILL (nothing signs off):

    1. a device-side party (only ``ca.crt``, the gateway's address) can neither register a
       key nor submit a run;
    2. a SuperNode dies in round 2 of 5: its reply is dropped under its own node id, the run
       goes on, the node restarted (after Flower's heartbeat window) rejoins;
    3. the SuperLink dies (with the ServerApp) after round 3: restarted on its database, the
       run resubmitted with ``resume-from`` continues after the newest checkpoint, both
       devices resume their own layers from disk, and the run completes;
    4. a SuperNode whose key was never registered is refused.
    Every process is stopped by the test, by its process id (``Federation.stop_all``)."""
    fed = Federation(tmp_path / "fed", supernodes=2, port=_free_port())
    outputs = tmp_path / "outputs"
    run_config = {**RUN, "num-server-rounds": 5, "evaluate-every": 5, "outputs-dir": str(outputs)}
    try:
        fed.up()
        _wait_nodes(fed, 2)
        ids = _node_ids(fed)
        # `deploy up` again on the same directory (a new object, from pids.json) reuses all
        again = Federation(fed.root, supernodes=2, port=fed.port).up()
        assert len(again) == 4 and all("already running" in line for line in again), again
        assert _node_ids(fed) == ids

        # 1. only the Fleet API is served where the devices connect
        outsider = {**fed.env, "FLWR_HOME": str(tmp_path / "outsider")}
        connection(outsider["FLWR_HOME"], "outsider", fed.fleet_address, str(fed.creds / "ca.crt"))
        flwr = str(Path(sys.executable).parent / "flwr")
        attempts = [
            [flwr, "supernode", "register", str(fed.creds / "supernode-2.pub"), "outsider"],
            [flwr, "run", str(REPO), "outsider", "--run-config", "num-server-rounds=1"],
        ]
        for command in attempts:
            tried = subprocess.run(command, env=outsider, capture_output=True, text=True,
                                   timeout=120)  # fmt: skip
            assert tried.returncode != 0, tried.stdout + tried.stderr
        assert _node_ids(fed) == ids  # no third key
        assert "gateway: refused POST" in (fed.logs / "gateway.log").read_text()

        # 2. SuperNode 0 is killed while round 2 runs, and restarted
        run = fed.submit(run_config, REPO, "run")
        # killed while its ClientApp works on round 2's message (pulled: only its reply is
        # missing; a node killed before pulling would get the message after its restart)
        _wait_for(fed.logs / "supernode-0.log", "Receiving: train message", run, count=2)
        fed.crash("supernode-0")
        fed.restart_supernode(0)  # refused until the dead node's heartbeat lapses, then in

        # 3. the SuperLink is killed after round 3, restarted, the run resumed
        _wait_for(fed.logs / "run.log", "round 3/5", run)
        fed.crash("superlink")
        assert run.wait(120) != 0, "the submitter sees the SuperLink go"
        said = (fed.logs / "run.log").read_text(errors="replace")
        dropped = [int(x) for x in re.findall(r"dropped the reply of node (\d+)", said)]
        assert dropped and set(dropped) <= ids, said[-3000:]  # the dead node, by its own id
        (crashed,) = list(outputs.iterdir())
        assert (crashed / "checkpoints" / "round-3.pt").exists()
        fed.start_superlink()  # the same --database; the SuperNodes reconnect by themselves
        # with Flower's reconnect backoff: one node took over 60 s on a loaded 2-core box
        _wait_nodes(fed, 2, timeout=180)
        done = fed.run({**run_config, "resume-from": str(crashed)}, REPO)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "resuming at round 4" in done.stdout + done.stderr
        final = _results(outputs)[-1]
        assert [r["round"] for r in final["rounds"]] == [1, 2, 3, 4, 5]
        for entry in final["rounds"][3:]:
            # both devices trained, and each resumed its own layers from its disk
            assert entry["train"]["applied"] == 2 and not entry["dropped"], entry
            assert entry["train"]["personal-restored"] == 1.0, entry
        assert final["final"]["personal-accuracy"] > 0.5
        kept = torch.load(fed.state_dir(0) / "personal.pt", weights_only=True)
        assert kept and all(torch.isfinite(t).all() for t in kept.values())

        # 4. a SuperNode whose key was never registered is refused
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
