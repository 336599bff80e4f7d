"""Final shared weights, checkpoints, resuming, and personalized inference on a device."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from pflower.predict import StateMismatch, personal_model, run_config
from pflower.predict import main as predict_main
from pflower.task.data import load_client_data
from pflower.task.train import evaluate
from pflower.testbed.local_grid import run_local

RUN = {
    "algorithm": "fedalt",
    "dataset": "digits",
    "partitioner": "pathological",
    "split": "head",
    "num-server-rounds": 2,
    "evaluate-every": 2,
    "fraction-train": 1.0,
    "finetune-epochs": 0,
    "checkpoint-every": 1,
}


def test_device_model_is_final_shared_plus_its_own_personal_layers(tmp_path, capsys):
    nodes = {i: {"state-dir": str(tmp_path / f"node-{i}")} for i in range(3)}
    report = run_local({**RUN, "outputs-dir": str(tmp_path / "out")}, 3, node_configs=nodes)
    run = report.path
    assert (run / "final-shared.pt").exists()
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["round-0.pt", "round-1.pt", "round-2.pt"]  # round 0: the run's start
    final = torch.load(run / "final-shared.pt", weights_only=True)
    last = torch.load(run / "checkpoints" / "round-2.pt", weights_only=True)["arrays"]
    assert all(torch.equal(final[k], last[k]) for k in final)
    # the device's model scores on its test split what the client reported at the end
    with open(run / "clients.csv") as f:
        reported = {
            int(r["partition-id"]): float(r["personal-accuracy"]) for r in csv.DictReader(f)
        }
    cfg_model = personal_model(run, tmp_path / "node-1")
    _, test = load_client_data(run_config(run), 1, 3)
    assert evaluate(cfg_model, test)["accuracy"] == pytest.approx(reported[1], abs=1e-9)
    predict_main(["--run", str(run), "--state-dir", str(tmp_path / "node-1"),
                  "--partition-id", "1", "--num-partitions", "3"])  # fmt: skip
    assert '"accuracy"' in capsys.readouterr().out


def test_resume_from_saved_shared_weights(tmp_path):
    first = run_local({**RUN, "outputs-dir": str(tmp_path / "a")}, 3)
    saved = first.path / "final-shared.pt"
    again = run_local(
        {**RUN, "num-server-rounds": 1, "resume-from": str(saved), "outputs-dir": str(tmp_path)},
        3,
    )
    assert again.final["clients"] == 3
    with pytest.raises(ValueError, match="resume-from"):
        run_local({**RUN, "resume-from": str(tmp_path / "nope.pt")}, 3)
    torch.save({"other": torch.zeros(2)}, tmp_path / "wrong.pt")
    with pytest.raises(ValueError, match="do not match"):
        run_local({**RUN, "resume-from": str(tmp_path / "wrong.pt")}, 3)


def test_predict_pairs_a_run_s_weights_only_with_the_state_that_run_wrote(tmp_path, capsys):
    """Issue 31, item 4: run A's shared weights with a later run's or another experiment's
    personal layers are refused, naming both; with the layers A wrote they are A's model."""
    nodes = {i: {"state-dir": str(tmp_path / f"node-{i}")} for i in range(2)}
    one = {**RUN, "num-server-rounds": 1, "evaluate-every": 1, "checkpoint-every": 0}

    def run(name, **keys):
        out = {"outputs-dir": str(tmp_path / name)}
        return run_local({**one, **out, **keys}, 2, node_configs=nodes).path

    def reported(run_dir):
        with open(run_dir / "clients.csv") as f:
            return {
                int(r["partition-id"]): float(r["personal-accuracy"]) for r in csv.DictReader(f)
            }

    def accuracy(run_dir):
        model = personal_model(run_dir, tmp_path / "node-1", 1, 2)
        _, test = load_client_data(run_config(run_dir), 1, 2)
        return evaluate(model, test)["accuracy"]

    a = run("a")
    b = run("b")  # the same experiment, run again: it continues A's layers
    # B's first save kept A's final layers as the previous version: A still finds its own
    assert accuracy(a) == pytest.approx(reported(a)[1], abs=1e-9)
    assert accuracy(b) == pytest.approx(reported(b)[1], abs=1e-9)
    c = run("c", **{"experiment-name": "other"})  # another experiment overwrites B's
    assert accuracy(c) == pytest.approx(reported(c)[1], abs=1e-9)
    tag_b = json.loads((b / "config.json").read_text())["run-tag"]
    tag_c = json.loads((c / "config.json").read_text())["run-tag"]
    with pytest.raises(StateMismatch) as refused:
        personal_model(b, tmp_path / "node-1", 1, 2)
    message = str(refused.value)
    assert f"run {tag_b}" in message and f"run {tag_c}" in message  # both scopes named
    assert "experiment 'other'" in message
    # the command line: one line naming both, exit code 2, no traceback
    with pytest.raises(SystemExit) as exited:
        predict_main(["--run", str(b), "--state-dir", str(tmp_path / "node-1"),
                      "--partition-id", "1", "--num-partitions", "2"])  # fmt: skip
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert tag_b in err and tag_c in err and "Traceback" not in err
    # another partition's layers (a device's state-dir copied to another node) are refused
    with pytest.raises(StateMismatch, match="partition '0/2'"):
        personal_model(c, tmp_path / "node-1", 0, 2)
