"""The reply pipeline (``pflower.strategies.pipeline``): one way through the server for every
round loop. pflower's synchronous strategies, ``RobustFedAvg`` (Flower's FedAvg) and
asynchronous FFGG run their replies through the same admit and bound stages, so a bad reply
meets the same check and is dropped for the same reason in each; the builder is the one
place where the modes compose; experiment stages attach from outside."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pflower.strategies import AsyncFFGG, FedAvg
from pflower.strategies.aggregators import make_aggregator
from pflower.strategies.combine import CentralDP, ClippedMean, Mean, RobustRule
from pflower.strategies.pipeline import build
from pflower.strategies.privacy import DPSettings
from pflower.strategies.robust_fedavg import RobustFedAvg
from pflower.strategies.rounds import Round
from pflower.strategies.server import RUN_DEFAULTS
from pflower.testbed.local_grid import LocalGrid
from pflower.wire import ClientUpdate

#: node -> what it sends in place of an honest update: the checks it must meet
BAD = {0: "nan", 1: "shape", 2: "huge", 3: "raise", 4: "no-count"}
NODES = 8


def replying(key: str) -> ClientApp:
    """A plain Flower ClientApp (no pflower) replying under ``key``: node i of ``BAD`` breaks
    its reply, the others send a small honest update (weights 0.1 below the ones sent, or a
    gradient of 0.1)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        w = msg.content["arrays"]["w"].numpy()
        value = w - 0.1 if key == "arrays" else np.full_like(w, 0.1)
        metrics = {"num-examples": 10}
        bad = BAD.get(pid)
        if bad == "nan":
            value = np.full_like(w, np.nan)
        elif bad == "shape":
            value = np.zeros(w.size + 1, w.dtype)
        elif bad == "huge":
            value = (w - 1e9) if key == "arrays" else np.full_like(w, 1e9)
        elif bad == "raise":
            raise RuntimeError("device fell over")
        elif bad == "no-count":
            metrics = {"train-loss": 1.0}
        content = {key: ArrayRecord({"w": Array(value.astype(w.dtype))})}
        return Message(RecordDict({**content, "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context) -> Message:
        metrics = {"num-examples": 10, "personal-loss": 1.0, "personal-accuracy": 0.5}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def reasons(dropped: dict[str, int]) -> set[str]:
    """The drop reasons without their numbers (the norm and bound of an update-norm drop)."""
    return {r.split(" 1e+09")[0].split(" 2e+09")[0].split(":")[0] for r in dropped}


def start(strategy, key: str, rounds: int = 2) -> None:
    grid = LocalGrid(replying(key), NODES)
    strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.ones(4, np.float32))}),
                   num_rounds=rounds)  # fmt: skip


def test_a_bad_reply_is_dropped_for_the_same_reason_by_every_round_loop(task_identity):
    ours = FedAvg(fraction_train=1.0, robust=False, clipping=False)
    start(ours, "arrays")
    theirs = RobustFedAvg(aggregator=make_aggregator("median"), fraction_train=1.0)
    start(theirs, "arrays")
    asynchronous = AsyncFFGG(concurrency=NODES, max_updates=2 * NODES, client_timeout=30.0)
    start(asynchronous, "gradient")
    seen = {
        "PersonalizedStrategy": {r: n for e in ours.history for r, n in e.dropped.items()},
        "RobustFedAvg": theirs.dropped,
        "AsyncFFGG": {r: n for e in asynchronous.history for r, n in e.dropped.items()},
    }
    expected = {
        "non-finite values",
        "names/shapes/dtypes differ from the shared parameters",
        "update norm",
        "client error",
        "metric 'num-examples' missing",
    }
    for loop, dropped in seen.items():
        found = reasons(dropped)
        # the update-norm drop names its kind's bound: the same words in every loop
        found = {"update norm" if r.startswith("update norm") else r for r in found}
        assert expected <= found, (loop, sorted(dropped))
    norm_drops = {
        loop: next(r for r in dropped if r.startswith("update norm"))
        for loop, dropped in seen.items()
    }
    assert all(" > max-update-norm x reference = " in r for r in norm_drops.values()), norm_drops


def test_the_builder_decides_which_modes_compose():
    app, none = RUN_DEFAULTS.resolved({}, {}), {}
    assert isinstance(build(app, none, seed=0).combine, ClippedMean)  # the default defence
    assert isinstance(build(app, none, seed=0, clipping=False).combine, Mean)
    rule = build(app, none, seed=0, robust=make_aggregator("median"), byzantine=1).combine
    assert isinstance(rule, RobustRule) and rule.clip is None and rule.byzantine == 1
    central = DPSettings(mode="central", clip=1.0, noise=0.5)
    dp = build(app, none, seed=0, privacy=central)
    assert isinstance(dp.combine, CentralDP) and dp.bound.replies_alone and dp.combine.clip is None
    with pytest.raises(ValueError, match="central DP's noise is calibrated"):
        build(app, none, seed=0, privacy=central, robust=make_aggregator("median"))
    local = build(app, none, seed=0, privacy=DPSettings(mode="local", clip=1.0, noise=0.5))
    assert local.bound.local_dp is local.privacy and not local.bound.replies_alone
    # FFGG's defence: its rule with the clip in the rounds too small for it
    ffgg = RUN_DEFAULTS.resolved({}, {"robust_aggregator": "geometric-median",
                                      "robust_small_rounds": "clip"})  # fmt: skip
    both = build(ffgg, none, seed=0).combine
    assert isinstance(both, RobustRule) and both.clip is not None
    # ... and under DP the algorithm's defaults without that defence
    assert isinstance(build(ffgg, none, seed=0, privacy=central).combine, CentralDP)


def test_a_stage_inserted_from_outside_runs_between_admission_and_the_bounds(task_identity):
    from flwr.app import MessageType

    pipeline = build(RUN_DEFAULTS.resolved({}, {}), {}, seed=0, clipping=False)
    seen = []

    def stage(rnd, updates):
        seen.append([u.node_id for u in updates])
        # node 0's update as an omniscient adversary might make it: far beyond the others
        scale = {0: 1e12}
        return [
            ClientUpdate(u.node_id, {"w": u.tensors["w"] * scale.get(u.node_id, 1.0)}, u.metrics)
            for u in updates
        ]

    pipeline.insert(stage)
    asked = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.TRAIN) for n in range(5)]

    def reply(msg: Message) -> Message:
        value = np.nan if msg.metadata.dst_node_id == 4 else 0.1
        gradient = ArrayRecord({"w": Array(np.full(4, value, np.float32))})
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({"gradient": gradient, "metrics": metrics}), reply_to=msg)

    replies = [reply(m) for m in asked]
    current = {"w": np.zeros(4, np.float32)}
    rnd = Round(
        1,
        asked={m.metadata.dst_node_id for m in asked},
        sent={m.metadata.message_id: m.metadata.dst_node_id for m in asked},
        weights=False,
        reply_key="gradient",
        kind="gradient",
        layout={"w": ((4,), "float32")},
        current=current,
    )
    kept = pipeline.updates(rnd, replies)
    # node 4's NaN dropped at admission (the stage never sees it), node 0's 1e11 at the bound
    assert seen == [[0, 1, 2, 3]] and [u.node_id for u in kept] == rnd.nodes == [1, 2, 3]
    assert sorted(rnd.dropped) == ["non-finite values", next(r for r in rnd.dropped if "norm" in r)]
    assert next(r for r in rnd.dropped if "norm" in r).startswith("update norm")


def test_the_production_server_app_never_simulates_an_attack(tmp_path):
    """``attack-simulation = true`` needs the testbed's ServerApp, which inserts the stage; the
    production one refuses it at start, naming the key and the component to use."""
    from helpers import BASE

    from pflower.config import Config, ConfigError
    from pflower.server_app import run
    from pflower.testbed.client_app import experiment_client_app

    overrides = {**BASE, "attack-simulation": True, "num-server-rounds": 1}
    grid = LocalGrid(experiment_client_app(overrides), 2)
    with pytest.raises(ConfigError, match="'attack-simulation' = true.*pflower.testbed.server_app"):
        run(grid, Config.from_run_config(overrides), tmp_path)
