"""The warm SuperExec (``pflower.deploy.warm_exec``): a SuperNode with ``--isolation process``
runs every message in a fork of a process that imported torch and the app once. The zygote
forks with no other thread alive, and a loopback deployment (TLS, authentication, gateway)
with it completes a run whose results equal the same run on LocalGrid."""

from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_zygote_forks_single_threaded():
    from pflower.deploy.warm_exec import ForkExecutor

    executor = ForkExecutor()
    try:
        assert executor.threads_at_fork == 1  # no thread a fork could leave holding a lock
    finally:
        executor.close()


@pytest.mark.skipif(
    shutil.which("flower-superlink") is None
    and not (Path(sys.executable).parent / "flower-superlink").exists(),
    reason="Flower's deployment executables are not installed",
)
def test_a_warm_federation_runs_and_equals_local_grid(tmp_path):
    from pflower.deploy import Federation
    from pflower.experiments.local_grid import run_local

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = {
        "algorithm": "fedalt",
        "dataset": "digits",
        "split": "head",
        "pretrain-rounds": 1,  # a personal-init record, then checkpoints of it
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "evaluate-every": 3,
        "finetune-epochs": 1,
        "outputs-dir": str(tmp_path / "outputs"),
    }
    fed = Federation(tmp_path / "fed", supernodes=2, port=port, warm=True)
    try:
        fed.up()
        assert {"warm-exec-0", "warm-exec-1"} <= set(fed.entries)
        done = fed.run(run, REPO, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        fed.stop_all()
    assert not fed.entries  # every process stopped, the warm SuperExecs too
    (results,) = (tmp_path / "outputs").glob("*/results.json")
    deployed = json.loads(results.read_text())["final"]
    local = run_local({**run, "outputs-dir": str(tmp_path / "local")}, 2).final
    assert deployed["personal-accuracy"] == local["personal-accuracy"]
    assert deployed["clients"] == 2
