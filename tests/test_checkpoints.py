"""Final shared weights, checkpoints, resuming, and personalized inference on a device."""

from __future__ import annotations

import csv

import pytest
import torch

from pflower.experiments.local_grid import run_local
from pflower.predict import main as predict_main
from pflower.predict import personal_model
from pflower.task.data import load_client_data
from pflower.task.train import evaluate

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
    from pflower.predict import run_config

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
