"""Crash recovery in process (``pflower.checkpoint``): a run whose server dies in round k + 1,
after the clients trained and stored their state for that round, resumed from its checkpoint
of round k, ends with exactly the shared parameters and history of the run that never died.
"""

from __future__ import annotations

import pytest
import torch

from pflower import checkpoint
from pflower.client_app import build_client_app
from pflower.config import Config, ConfigError
from pflower.server_app import run
from pflower.testbed.local_grid import LocalGrid

BASE = {
    "dataset": "digits",
    "model": "mlp",
    "split": "head",
    "partitioner": "pathological",
    "batch-size": 32,
    "max-train-samples": 60,
    "num-server-rounds": 4,
    "fraction-train": 0.5,
    "evaluate-every": 2,
    "finetune-epochs": 1,
    "checkpoint-every": 1,
    "checkpoint-keep": 2,
}
CASES = {
    # stateful clients (v kept between rounds), the sampler and the server's plain mean
    "fedalt": {"algorithm": "fedalt"},
    # FFGG with a server Adam: its moments and step count must survive the crash
    "ffgg": {"algorithm": "ffgg", "server-optimizer": "adam", "server-lr": 0.01},
}


class ServerDied(Exception):
    """The SuperLink (and the ServerApp in it) died."""


class DyingGrid(LocalGrid):
    """A ``LocalGrid`` whose server dies once the training replies of ``dies_in`` are back:
    the clients have trained and stored their state for a round the server never commits."""

    dies_in: int | None = None

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        train = [m for m in messages if m.metadata.message_type == "train"]
        if train and int(train[0].content["config"]["server-round"]) == self.dies_in:
            raise ServerDied(f"round {self.dies_in}")
        return replies


def _run(overrides, grid):
    return run(grid, Config.from_run_config(overrides))


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_killed_after_round_k_and_resumed_equals_the_uninterrupted_run(tmp_path, algorithm):
    # two runs compared bit for bit: a reproducible sample (the secret one's resume:
    # test_sampling.py)
    overrides = {**BASE, **CASES[algorithm], "sample-seed": 0}
    whole = _run(
        {**overrides, "outputs-dir": str(tmp_path / "whole")},
        LocalGrid(build_client_app(overrides), 4, seed=0),
    )

    devices = DyingGrid(build_client_app(overrides), 4, seed=0)  # they outlive the server
    devices.dies_in = 3
    with pytest.raises(ServerDied):
        _run({**overrides, "outputs-dir": str(tmp_path / "crashed")}, devices)
    (crashed,) = (tmp_path / "crashed").iterdir()
    kept = sorted(p.name for p in (crashed / "checkpoints").iterdir())
    assert kept == ["round-1.pt", "round-2.pt"]  # checkpoint-keep = 2, atomic: no temp file

    devices.dies_in = None
    resumed = _run(
        {**overrides, "outputs-dir": str(tmp_path / "resumed"), "resume-from": str(crashed)},
        devices,
    )
    assert set(resumed.shared) == set(whole.shared)
    for name, tensor in whole.shared.items():
        assert torch.equal(resumed.shared[name], tensor), name  # bit for bit
    assert [r.round for r in resumed.rounds] == [1, 2, 3, 4]  # rounds 1-2 from the checkpoint
    for mine, theirs in zip(resumed.rounds, whole.rounds):
        assert mine.train == theirs.train and mine.evaluate == theirs.evaluate, mine.round
        # the checkpointed rounds' bytes too (issue 50: written after the checkpoint)
        assert mine.wire == theirs.wire and mine.wire, mine.round
    assert resumed.clients == whole.clients


def test_a_resumed_run_must_be_the_same_run(tmp_path):
    overrides = {**BASE, "algorithm": "fedalt", "num-server-rounds": 1}
    first = _run(
        {**overrides, "outputs-dir": str(tmp_path)}, LocalGrid(build_client_app(overrides), 4)
    )
    found = checkpoint.read(first.path)
    assert isinstance(found, checkpoint.Checkpoint) and found.round == 1
    with pytest.raises(ConfigError, match=r"'lr' = 0.1 \(checkpoint: 0.05\)"):
        _run(
            {**overrides, "lr": 0.1, "resume-from": str(first.path)},
            LocalGrid(build_client_app(overrides), 4),
        )
    with pytest.raises(ConfigError, match="no round-<r>.pt checkpoint"):
        checkpoint.read(tmp_path)


def test_a_checkpoint_without_buckets_resumes_with_a_bucket_size_of_one(tmp_path):
    """A bucket size of 0 (resolved: none) and of 1 compute the same: a run checkpointed when
    FFGG's default had no buckets resumes with ``robust-bucket-size = 1``, not under today's
    default (buckets of 2, another computation)."""
    then = Config.from_run_config({"algorithm": "ffgg", "robust-bucket-size": 1}).to_flat()
    old = checkpoint.Checkpoint(tmp_path, 3, 10, {}, {**then, "robust-bucket-size": 0}, {}, True)
    old.check(Config.from_run_config({"algorithm": "ffgg", "robust-bucket-size": 1}))
    with pytest.raises(ConfigError, match=r"'robust-bucket-size' = 2 \(checkpoint: 0\)"):
        old.check(Config.from_run_config({"algorithm": "ffgg"}))


def test_checkpoint_every_auto_is_every_round_in_deployment_only():
    cfg = Config.from_run_config({})
    assert checkpoint.interval(cfg, LocalGrid(build_client_app({}), 1)) == 0

    class GrpcGrid:  # any grid that is neither Flower's simulation engine nor LocalGrid
        pass

    assert checkpoint.interval(cfg, GrpcGrid()) == 1
    assert checkpoint.interval(Config.from_run_config({"checkpoint-every": -1}), GrpcGrid()) == 0
    assert checkpoint.interval(Config.from_run_config({"checkpoint-every": 5}), GrpcGrid()) == 5


def test_state_with_a_sent_record_pickles_and_reads_back():
    """An Array that went out in a message caches memoryview chunks (Flower deflates it to
    send); the personal-init record every client gets after pre-training is one, and a
    deployment's first checkpoint after pre-training failed on it ("cannot pickle memoryview
    objects"). The checkpoint pickles Arrays by their fields and reads them back equal."""
    import pickle

    import numpy as np
    from flwr.app import Array, ArrayRecord

    record = ArrayRecord({"head.weight": Array(np.arange(6.0).reshape(2, 3))})
    for array in record.values():
        array.deflate()  # as sending it does: caches the memoryview chunks
    with pytest.raises(TypeError, match="memoryview"):
        pickle.dumps({"personal_init": record})  # what the checkpoint did before
    back = pickle.loads(checkpoint.dumps_state({"personal_init": record}))["personal_init"]
    np.testing.assert_array_equal(back["head.weight"].numpy(), np.arange(6.0).reshape(2, 3))


def test_resume_from_resolves_where_the_outputs_went(tmp_path, monkeypatch):
    """Issue 50: under ``flwr run`` a relative ``outputs-dir`` lands under ``~/pflower``, and
    ``resume-from='outputs/<run>'`` (docs/deploy.md's command) must find it there, not in
    the SuperLink's working directory; in process both are the working directory."""
    from pflower import report

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg = Config.from_run_config({**BASE, "algorithm": "fedalt", "outputs-dir": "outputs"})
    home_outputs = tmp_path / "home" / "pflower" / "outputs"
    assert report.outputs_root(cfg, "f" * 64) == home_outputs
    assert (
        report.resolve("outputs/20261128-1-fedalt", "f" * 64) == home_outputs / "20261128-1-fedalt"
    )
    assert report.outputs_root(cfg) == tmp_path / "outputs"
    assert report.resolve("outputs/x") == tmp_path / "outputs" / "x"
    assert report.resolve(str(tmp_path / "abs"), "f" * 64) == tmp_path / "abs"


def test_a_run_from_a_fab_resumes_from_a_relative_run_directory(tmp_path, monkeypatch):
    """A run with a FAB hash (as under ``flwr run``) and ``resume-from='outputs/<run>'``
    continues the checkpoint written under ``~/pflower/outputs/<run>``."""
    import pflower.server_app as server_app

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # the SuperLink's directory: no outputs/ here
    monkeypatch.setattr(server_app, "fab_hash_of", lambda grid: "f" * 64)
    overrides = {**BASE, "algorithm": "fedalt", "num-server-rounds": 2, "outputs-dir": "outputs"}
    first = _run(overrides, LocalGrid(build_client_app(overrides), 4, seed=0))
    assert first.path.parent == tmp_path / "home" / "pflower" / "outputs"
    resumed = _run(
        {**overrides, "resume-from": f"outputs/{first.path.name}"},
        LocalGrid(build_client_app(overrides), 4, seed=0),
    )
    assert [r.round for r in resumed.rounds] == [1, 2]  # both from the checkpoint
