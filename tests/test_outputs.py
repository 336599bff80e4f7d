"""Outputs where the user expects them, with provenance (issue 31, item 5): the FAB's hash in
``config.json`` when the run came from ``flwr run``, a relative ``outputs-dir`` that does not
depend on the SuperLink's working directory, clients.csv's unambiguous columns, and
pre-training marked on ``accuracy.png``."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from pflower import report
from pflower.config import Config
from pflower.report import plots, results
from pflower.server_app import run
from pflower.testbed.client_app import experiment_client_app
from pflower.testbed.local_grid import LocalGrid

RUN = {
    "algorithm": "fedalt",
    "dataset": "digits",
    "partitioner": "pathological",
    "split": "head",
    "pretrain-rounds": 1,
    "num-server-rounds": 1,
    "evaluate-every": 1,
    "fraction-train": 1.0,
    "finetune-epochs": 0,
}
#: what Flower's run info carries for a run from a FAB (a SHA-256 of the FAB file)
FAB_HASH = "3f" * 32


class FabGrid(LocalGrid):
    """A ``LocalGrid`` whose run info says what Flower's says under ``flwr run``: the run
    came from a FAB with ``FAB_HASH``."""

    @property
    def run(self):
        empty = super().run
        return dataclasses.replace(empty, fab_id="pflower/pflower", fab_hash=FAB_HASH)


def _run(grid_type, overrides) -> report.RunReport:
    cfg = Config.from_run_config(overrides)
    return run(grid_type(experiment_client_app(overrides), 2, seed=cfg.seed), cfg)


def test_a_run_from_a_fab_records_its_hash_and_writes_under_the_stable_home(
    tmp_path, monkeypatch, capsys
):
    """Under ``flwr run`` the working directory is the SuperLink's (any project's): a
    relative ``outputs-dir`` goes under ``FAB_OUTPUTS_HOME``, and ``config.json`` names the
    FAB, there being no git commit of the installed copy to name."""
    home, superlink_cwd = tmp_path / "home", tmp_path / "another-project"
    superlink_cwd.mkdir()
    monkeypatch.setattr(results, "FAB_OUTPUTS_HOME", home)
    monkeypatch.chdir(superlink_cwd)
    done = _run(FabGrid, RUN)
    assert done.path.parent == home / "outputs"
    assert not any(superlink_cwd.iterdir())  # nothing in the SuperLink's directory
    produced = json.loads((done.path / "config.json").read_text())["produced-by"]
    assert produced["fab-hash"] == FAB_HASH
    assert f"results: {done.path}" in capsys.readouterr().out
    # clients.csv: the test count is num-test beside num-train, no ambiguous num-examples
    with open(done.path / "clients.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:3] == ["partition-id", "num-train", "num-test"]
    assert "num-examples" not in reader.fieldnames
    for row, client in zip(rows, sorted(done.clients, key=lambda c: c["partition-id"])):
        assert float(row["num-test"]) == client["num-examples"]  # the evaluation's count
    # an absolute outputs-dir is used as it is
    absolute = _run(FabGrid, {**RUN, "outputs-dir": str(tmp_path / "mine")})
    assert absolute.path.parent == tmp_path / "mine"


def test_a_run_in_process_writes_under_the_working_directory_without_a_fab_hash(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(results, "FAB_OUTPUTS_HOME", tmp_path / "home")
    monkeypatch.chdir(tmp_path)
    done = _run(LocalGrid, RUN)
    assert done.path.parent == tmp_path / "outputs"
    produced = json.loads((done.path / "config.json").read_text())["produced-by"]
    assert produced["fab-hash"] is None and "git-commit" in produced
    assert report.outputs_root(Config.from_run_config(RUN)) == tmp_path / "outputs"


def test_a_grid_without_run_info_counts_as_a_run_in_process():
    from pflower.server_app import fab_hash_of

    class NoRunInfo:
        @property
        def run(self):
            raise RuntimeError("no run set")

    assert fab_hash_of(NoRunInfo()) == ""


def _pretraining_lines(fig) -> list[tuple[float, str]]:
    return [
        (line.get_xdata()[0], line.get_label())
        for ax in fig.axes
        for line in ax.get_lines()
        if "pre-training" in line.get_label()
    ]


@pytest.mark.parametrize("pretrain", [0, 2])
def test_accuracy_plot_marks_where_pretraining_ends(pretrain):
    """A vertical line between rounds P and P + 1 on both panels, labelled, when
    ``pretrain-rounds`` P > 0; none without pre-training."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pflower.strategies.history import RoundLog

    cfg = Config.from_run_config({**RUN, "pretrain-rounds": pretrain, "num-server-rounds": 3})
    rounds = [
        RoundLog(
            round=r,
            train={"train-loss": 1.0 / r},
            evaluate={"personal-accuracy": 0.1 * r, "global-accuracy": 0.05 * r},
        )
        for r in range(1, cfg.total_rounds + 1)
    ]
    made = report.RunReport(cfg=cfg, split="head", num_nodes=2, rounds=rounds, clients=[],
                            seconds=1.0)  # fmt: skip
    fig = plots.rounds_figure(made)
    try:
        marks = _pretraining_lines(fig)
        if pretrain:
            assert marks == [(pretrain + 0.5, "pre-training ends (after round 2)")] * 2
            for ax in fig.axes:  # in the legend, where a reader looks for it
                assert "pre-training ends (after round 2)" in ax.get_legend_handles_labels()[1]
        else:
            assert marks == []
    finally:
        plt.close(fig)


def test_the_label_plot_leaves_room_above_its_tallest_bar(tmp_path, monkeypatch):
    """Issue 49, item 4: labels.png's tallest (stacked) bar touched the frame. The plot of
    the digits' partition: the y axis ends 8% above the tallest stack, counted here from the
    partitions' own sizes."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure

    from pflower.task import data

    cfg = Config.from_run_config(RUN)
    made = report.RunReport(cfg=cfg, split="head", num_nodes=4, rounds=[], clients=[],
                            seconds=1.0)  # fmt: skip
    seen = {}
    save = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        seen["ylim"] = fig.axes[0].get_ylim()
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plots._plot_labels(made, tmp_path / "labels.png")
    assert (tmp_path / "labels.png").exists()
    partitioner = data._source(cfg, 4).partitioner
    tallest = max(len(partitioner.load_partition(i)) for i in range(4))
    assert seen["ylim"][1] == pytest.approx(1.08 * tallest)


def test_a_round_without_a_training_loss_says_why_once(caplog):
    """Issue 49, item 4: FFGG's rounds print "train loss –"; the first such line is followed
    by one line saying why, and no other."""
    with caplog.at_level("INFO", logger="flwr"):
        _run(LocalGrid, {**RUN, "algorithm": "ffgg", "num-server-rounds": 2})
    lines = [r.getMessage() for r in caplog.records]
    notes = [i for i, x in enumerate(lines) if x.startswith("(train loss –: ffgg's clients")]
    assert len(notes) == 1
    before = lines[notes[0] - 1]
    assert before.startswith("round 2/3 ") and "train loss        –" in before
    first = next(x for x in lines if x.startswith("round 1/3 "))  # pre-training: a loss
    assert "train loss        –" not in first
