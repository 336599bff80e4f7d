"""End to end through Flower's simulation engine (in-process, no background processes), and
the pipelines whose engine run adds nothing to that on a ``LocalGrid`` (the engine's
trajectory, bit for bit: the last test), which costs no Ray start (~20 s a run on CI's 2
cores)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from flwr.simulation import run_simulation
from helpers import corrupting_app

from pflower.client_app import build_client_app
from pflower.server_app import build_server_app
from pflower.testbed.local_grid import run_local

BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}


def simulate(overrides, num_nodes, client_app=None):
    reports = []
    run_simulation(
        server_app=build_server_app(overrides, on_report=reports.append),
        client_app=client_app or build_client_app(overrides),
        num_supernodes=num_nodes,
        backend_config=BACKEND,
    )
    assert len(reports) == 1, "the ServerApp did not finish"
    return reports[0]


def test_fedavg_ft_personalizes_on_pathological_mnist(tmp_path):
    """FedAvg + head fine-tuning beats the global model on 2-classes-per-client MNIST-5k."""
    overrides = {
        "algorithm": "fedavg-ft",
        "dataset": "mnist-5k",
        "partitioner": "pathological",
        "classes-per-client": 2,
        "num-server-rounds": 3,
        "fraction-train": 1.0,
        "evaluate-every": 3,
        "finetune-epochs": 3,
        "outputs-dir": str(tmp_path),
    }
    report = run_local(overrides, 5)
    final = report.final
    assert final["clients"] == 5  # the final round evaluates every client
    assert final["personal-accuracy"] > final["global-accuracy"] + 0.1
    assert final["personal-accuracy"] > 0.8
    (out,) = tmp_path.iterdir()
    for name in ("config.json", "results.json", "clients.csv", "accuracy.png", "clients.png"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    rows = list(csv.DictReader((out / "clients.csv").read_text().splitlines()))
    assert sorted(int(float(r["partition-id"])) for r in rows) == [0, 1, 2, 3, 4]


def test_nan_clients_are_dropped_and_the_run_completes(tmp_path):
    overrides = {
        "algorithm": "fedavg",
        "dataset": "digits",
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "evaluate-every": 2,
        "outputs-dir": str(tmp_path),
    }
    app = corrupting_app(overrides, partitions=(0,), value=np.nan)  # NaN everywhere
    report = run_local(overrides, 3, client_app=app)
    assert report.dropped == 2  # one NaN reply per round
    assert all(r.train["applied"] == 2 for r in report.rounds)
    assert report.final["clients"] == 3


def test_local_baseline_runs_without_federation(tmp_path):
    overrides = {
        "algorithm": "local",
        "dataset": "digits",
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "evaluate-every": 2,
        "outputs-dir": str(tmp_path),
    }
    report = run_local(overrides, 3)
    assert report.final["personal-accuracy"] > 0.5
    assert "global-accuracy" not in report.final  # no global model to speak of


def test_fedalt_pipeline_pretrain_then_personalize(tmp_path):
    """FedAvg pre-training, FedAlt with the head split, final v-only fine-tuning."""
    overrides = {
        "algorithm": "fedalt",
        "split": "head",
        "dataset": "mnist-5k",
        "partitioner": "pathological",
        "classes-per-client": 2,
        "pretrain-rounds": 2,
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "evaluate-every": 2,
        "server-optimizer": "adam",
        "server-lr": 0.01,
        "outputs-dir": str(tmp_path),
    }
    report = run_local(overrides, 4)
    assert [r.round for r in report.rounds] == [1, 2, 3, 4]
    pretrain_eval = report.rounds[1].evaluate  # the FedAvg model after step (a)
    assert pretrain_eval["personal-accuracy"] == pretrain_eval["global-accuracy"]
    final = report.final
    assert final["clients"] == 4
    assert final["personal-accuracy"] > final["global-accuracy"] + 0.1
    assert report.dropped == 0


def test_ffgg_and_local_ffgg_run_and_report_the_split_diagnostic(tmp_path):
    """FFGG and Local FFGG, on a ``LocalGrid`` (the engine's trajectory: the test below, whose
    run is FFGG's through the engine)."""

    for algorithm in ("ffgg", "local-ffgg"):
        overrides = {
            "algorithm": algorithm,
            "dataset": "digits",
            "num-server-rounds": 2,
            "fraction-train": 1.0,
            "evaluate-every": 2,
            "server-lr": 0.5,
            "outputs-dir": str(tmp_path / algorithm),
        }
        report = run_local(overrides, 3)
        assert report.dropped == 0
        for r in report.rounds:
            assert 0 < r.train["grad-norm-mean"] <= r.train["grad-norm-max"]
        assert report.final["clients"] == 3
        (out,) = (tmp_path / algorithm).iterdir()
        assert (out / "split-diagnostic.png").stat().st_size > 0


def test_local_grid_run_equals_the_simulation_engine_run(tmp_path):
    """The benchmarks' in-process LocalGrid changes the transport only: the same config gives
    the same trajectory as Flower's simulation engine (sampling, seeds, client state); the
    engine's dispatcher is the one the server indexed (``pflower.flower.dispatch``). A run is
    reproducible from its seeds (``sample-seed`` too: by default the sample is secret, new in
    every run) on new node ids: the engine's random ones, and LocalGrid's, twice."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    from pflower.flower import dispatch as flower_dispatch

    overrides = {
        "sample-seed": 0,  # two runs compared: the same sample
        "algorithm": "scaffold",
        "dataset": "synthetic-linear",
        "model": "synthetic-linear",
        "split": "none",
        "linear-n": 30,
        "linear-dtheta": 5,
        "linear-dw": 3,
        "batch-size": 60,
        "local-steps": 3,
        "lr": 0.5,
        "server-lr": 0.5,
        "fraction-train": 0.5,
        "num-server-rounds": 4,
        "evaluate-every": 4,
        "finetune-epochs": 1,
        "outputs-dir": str(tmp_path),
    }
    flower_dispatch.restore_message_dispatch()
    engine = simulate(overrides, num_nodes=4)
    assert InMemoryLinkState.get_message_ins is flower_dispatch.get_message_ins
    local, again = run_local(overrides, 4), run_local(overrides, 4)
    errors = [[r.server["theta-error"] for r in rep.rounds] for rep in (engine, local, again)]
    assert len(errors[0]) == 5
    np.testing.assert_allclose(errors[0], errors[1], rtol=1e-6)
    assert errors[1] == errors[2]
    assert engine.final["personal-loss"] == pytest.approx(local.final["personal-loss"], rel=1e-6)
    assert local.final["personal-loss"] == again.final["personal-loss"]
