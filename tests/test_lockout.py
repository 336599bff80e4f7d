"""No lockout: a round whose replies show that the model was taken is not applied, and theta
goes back (``settle.Rollback``).

The attack: in one round a Byzantine majority of the replies kept (the honest devices of that
round failed) moves theta by just under the update-norm bound; on the taken model the honest
clients' updates are far beyond the bound (their loss grows faster than the distance), while
the attackers stay just under it. Without the rollback only hostile replies were applied from
then on, round after round, and the run ended "successfully"; with it the taken round is not
applied, theta goes back to the last good round's, and the honest clients train again. A run
whose rounds keep being taken fails loudly (``max-failed-rounds``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pflower.strategies import FedAvg
from pflower.strategies.bound import provisional_scale
from pflower.strategies.pipeline import ReplyPipeline
from pflower.strategies.settle import Rollback, RunFailed
from pflower.testbed.local_grid import LocalGrid

NODES, ATTACKERS, WRECK = 7, {0, 1, 2}, 3  # the attackers' majority round: the honest fail
TARGETS = {i: np.full(4, 1.0 + 0.1 * (i - 3), np.float32) for i in range(NODES)}


def accepted(strategy, sent: np.ndarray) -> float:
    """The largest update norm the round's bound accepts, as the attacker tracks it."""
    bound = strategy.pipeline.bound.norm
    reference = bound.reference.get(True)
    if reference is None:
        scale = provisional_scale({"w": sent}, 1.0)
        return min(scale, bound.first_scale.get(True, scale))
    return bound.factor * reference


def federation(box: dict, broken: bool = False) -> ClientApp:
    """Honest node i descends a loss that grows with the fourth power of ||w - t_i|| (its
    update grows much faster than the distance); the attackers send an update of 0.99 x the
    accepted norm in one direction, every round; in round ``WRECK`` the honest devices fail,
    and with ``broken`` send updates of 1e6 per coordinate in every round after it."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        w = msg.content["arrays"]["w"].numpy()
        if pid in ATTACKERS:
            size = 0.99 * accepted(box["strategy"], w)
            new = w - size * np.full(4, 0.5, np.float32)  # the update w - new: size, ones/2
        elif rnd == WRECK:
            raise RuntimeError("the device fell over")
        elif broken and rnd > WRECK:
            new = w - np.float32(1e6)
        else:
            d = w - TARGETS[pid]
            new = w - 0.5 * d * (1.0 + float(d @ d))
        records = {"arrays": ArrayRecord({"w": Array(new.astype(np.float32))})}
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({**records, "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context) -> Message:
        metrics = {"num-examples": 10, "personal-loss": 1.0, "personal-accuracy": 0.5}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def run(monkeypatch, rollback: bool, rounds: int = 10, broken: bool = False):
    """The run, and per round the partitions whose replies were applied and those dropped
    for their size."""
    box: dict = {}
    strategy = FedAvg(fraction_train=1.0, sample_seed=0, fraction_evaluate=0.5)
    strategy.pipeline.rollback = Rollback(enabled=rollback)
    box["strategy"] = strategy
    grid = LocalGrid(federation(box, broken), NODES)
    pid = {n: int(c.node_config["partition-id"]) for n, c in grid.contexts.items()}
    seen: list[dict] = []
    real = ReplyPipeline.updates

    def watch(self, rnd, replies):
        kept = real(self, rnd, replies)
        size = sum(n for r, n in rnd.dropped.items() if r.startswith("update norm"))
        seen.append({"round": rnd.number, "kept": {pid[n] for n in rnd.nodes}, "size": size})
        return kept

    monkeypatch.setattr(ReplyPipeline, "updates", watch)
    initial = ArrayRecord({"w": Array(np.ones(4, np.float32))})
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds)
    applied = {e.round: e.train.get("applied", 0) for e in strategy.history if e.train}
    for r in seen:
        r["applied"] = applied[r["round"]]
    return strategy, result.arrays["w"].numpy(), seen


def hostile_only(seen: list[dict]) -> list[int]:
    """Rounds in which only attackers' replies were applied while honest ones were dropped."""
    return [r["round"] for r in seen if r["applied"] and r["kept"] <= ATTACKERS and r["size"] > 0]


def test_without_the_rollback_the_attackers_lock_the_honest_clients_out(monkeypatch):
    _, theta, seen = run(monkeypatch, rollback=False)
    assert len(hostile_only(seen)) >= 5  # the lockout the rollback is there to end
    assert np.linalg.norm(theta - 1.0) > 50  # and theta is theirs


def test_a_taken_round_is_not_applied_and_theta_goes_back(monkeypatch):
    strategy, theta, seen = run(monkeypatch, rollback=True)
    assert hostile_only(seen) == []
    taken = [e for e in strategy.history if e.train.get("model-taken")]
    assert [e.round for e in taken] == [WRECK + 1]  # the round after the wreck, once
    assert taken[0].train["rolled-back-to"] == WRECK and taken[0].train["applied"] == 0
    # the honest clients train again: theta ends near their targets' mean (1.0), as a
    # minority of attackers clipped by the default defence leaves it
    assert np.linalg.norm(theta - 1.0) < 1.0
    assert math.isfinite(float(theta.sum()))


def test_rounds_that_keep_being_taken_fail_the_run_loudly(monkeypatch):
    """After the wreck the honest devices' updates stay beyond the bound whatever theta is
    (broken: 1e6 per coordinate): each round is taken, goes back, applies nothing, and the
    third in a row stops the run, naming why; without the rollback the attackers' replies
    alone were applied in each of those rounds and the run ended as a success."""
    with pytest.raises(RunFailed, match="3 consecutive training rounds applied no reply"):
        run(monkeypatch, rollback=True, broken=True)
    _, _, seen = run(monkeypatch, rollback=False, broken=True)
    assert hostile_only(seen) == list(range(WRECK + 1, 11))
