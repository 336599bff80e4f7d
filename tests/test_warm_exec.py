"""The warm SuperExec (``pflower.deploy.warm_exec``): a SuperNode with ``--isolation process``
runs every message in a fork of a process that imported torch and the app once. The zygote
forks with no other thread alive, a fork imports nothing more to serve a run's messages, and
a loopback deployment (TLS, authentication, gateway; the kit's shorter waits) with it
completes a run whose results equal the same run on LocalGrid."""

from __future__ import annotations

import json
import pickle
import shutil
import socket
import subprocess
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


#: in a fresh process: the zygote's warm-up, then every recorded (message, context) served by
#: the production ClientApp, as forks of the zygote serve them; prints what that imported
_REPLAY = """
import json, pickle, sys
from pflower.deploy.warm_exec import warm_up
warm_up()
from pflower.client_app import build_client_app
with open(sys.argv[1], "rb") as f:
    runs = pickle.load(f)
before = set(sys.modules)
for run, served in runs:
    app = build_client_app(run)
    for msg, context in served:
        app(msg, context)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_a_fork_of_the_warm_zygote_imports_nothing(tmp_path):
    """What the production ClientApp imports while it serves a run's messages (start-up
    query, training, evaluation; every algorithm) after the zygote's warm-up: nothing. Each
    task runs in a new fork, so a module imported lazily there is imported again for every
    message (torch's optimizers import torch._dynamo on first use: 2.8 s a message)."""
    from pflower.client_app import build_client_app
    from pflower.experiments.local_grid import run_local

    runs = []
    for algorithm in ("fedavg", "local", "fedalt", "fedsim", "apfl", "pflego", "ffgg"):
        run = {
            "algorithm": algorithm,
            "dataset": "digits",
            "num-server-rounds": 2,
            "evaluate-every": 1,
            "outputs-dir": str(tmp_path / algorithm),
        }
        app, served = build_client_app(run), []

        def record(msg, context, app=app, served=served):  # as received, state included
            served.append(pickle.dumps((msg, context)))
            return app(msg, context)

        run_local(run, 2, client_app=record)
        assert len(served) >= 6  # queries, training and evaluation of both nodes
        runs.append((run, [pickle.loads(m) for m in served]))
    messages = tmp_path / "served.pickle"
    messages.write_bytes(pickle.dumps(runs))
    done = subprocess.run(
        [sys.executable, "-c", _REPLAY, str(messages)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


@pytest.mark.skipif(
    shutil.which("flower-superlink") is None
    and not (Path(sys.executable).parent / "flower-superlink").exists(),
    reason="Flower's deployment executables are not installed",
)
@pytest.mark.drill
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
    # with the kit's shorter waits: Flower's SuperNode through pflower.deploy.supernode
    fed = Federation(tmp_path / "fed", supernodes=2, port=port, warm=True, poll_interval=0.2)
    try:
        fed.up()
        assert {"warm-exec-0", "warm-exec-1"} <= set(fed.entries)
        assert fed.entries["supernode-0"]["command"][1:3] == ["-m", "pflower.deploy.supernode"]
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


#: in a fresh process, as the zygote and its forks do: a fork loads a client's arrays and hands
#: them back; the zygote adopts them and the next fork starts with them (prints the calls of
#: the loading function each fork made, and whether a device's own file came back)
_HAND_BACK = """
import json, os, sys
from pathlib import Path
import numpy as np
from pflower.config import Config
from pflower.deploy.warm_exec import _adopt, _hand_back, warm_up
from pflower.task.data import loaders
warm_up()
calls = Path(sys.argv[1]) / "calls"
fn = loaders.client_arrays.fn
def counting(*args):
    with open(calls, "a") as f:
        f.write("1")
    return fn(*args)
loaders.client_arrays.fn = counting
node_file = Path(sys.argv[1]) / "node.npz"
np.savez(node_file, x=np.random.default_rng(0).normal(size=(40, 3)), y=np.arange(40) % 2)
digits = Config.from_run_config({"dataset": "digits"})
node = Config.from_run_config({"dataset": "node", "input-shape": "3", "num-classes": 2})
handed = Path(sys.argv[1]) / "handed.pkl"
seen = []
for _ in range(2):
    known = {k for k, _ in loaders.client_arrays.items()}
    pid = os.fork()
    if pid == 0:
        a = loaders.client_arrays(digits, 1, 3, None)
        loaders.client_arrays(node, 0, 1, str(node_file))
        _hand_back(handed, known)
        os._exit(0)
    os.waitpid(pid, 0)
    seen.append(calls.read_text().count("1") if calls.exists() else 0)
    calls.unlink(missing_ok=True)
    _adopt(handed)
keys = [k for k, _ in loaders.client_arrays.items()]
print(json.dumps({"calls": seen, "kept": [k[0].dataset for k in keys], "left": handed.exists()}))
"""


def test_a_fork_hands_its_data_arrays_back_and_the_next_fork_starts_with_them(tmp_path):
    """The first fork loads the client's arrays (and a device file's); the zygote adopts the
    former only, so the second fork loads only the device file again; nothing is left on
    disk."""
    done = subprocess.run(
        [sys.executable, "-c", _HAND_BACK, str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said == {"calls": [2, 1], "kept": ["digits"], "left": False}
