"""Asynchronous FFGG (Alg. 3): counting, staleness, equivalence with sequential FFGG, and a
loop that survives failing and silent clients."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from pflower.config import Config, ConfigError
from pflower.server_app import server_evaluation
from pflower.strategies import build_run_model, make_strategy, wire_split
from pflower.strategies.async_ffgg import AsyncFFGG
from pflower.task.split import get_tensors
from pflower.testbed.client_app import experiment_client_app
from pflower.testbed.local_grid import LocalGrid, run_local
from pflower.testbed.stragglers import straggler_delay

LINEAR = {
    "dataset": "synthetic-linear",
    "model": "synthetic-linear",
    "linear-n": 40,
    "linear-dtheta": 6,
    "linear-dw": 3,
    "split": "head",
    "ffgg-solver": "cg",
    "personal-steps": 5,
    "server-lr": 0.2,
    "evaluate-every": 1000,
}


class ScriptedGrid:
    """A Grid whose replies arrive in a scripted order: ``order[k]`` is the index (in push
    order) of the message answered by the k-th pull; each reply's gradient is all ones."""

    def __init__(self, num_nodes: int, order: list[int]):
        self.nodes = list(range(1, num_nodes + 1))
        self.order, self.pushed, self.pulls = list(order), [], 0

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{len(self.pushed)}"
            self.pushed.append(msg)
            ids.append(f"m{len(self.pushed) - 1}")
        return ids

    def pull_messages(self, ids):
        if not self.order or f"m{self.order[0]}" not in ids:
            return []
        msg = self.pushed[self.order.pop(0)]
        grad = {k: np.ones_like(a.numpy()) for k, a in msg.content["arrays"].items()}
        content = RecordDict(
            {
                "gradient": ArrayRecord({k: Array(v) for k, v in grad.items()}),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        )
        return [Message(content=content, reply_to=msg)]

    def send_and_receive(self, messages, timeout=None):
        return []  # no partition answers, no evaluation: the test looks at theta only


@pytest.mark.parametrize("max_staleness", [-1, 1])
def test_staleness_and_steps_on_a_scripted_schedule(task_identity, max_staleness):
    # C = 2: m0, m1 sent at version 0. m0 arrives (s 0) -> v1, m2 sent at v1. m1 arrives
    # (s 1) -> v2, m3 sent at v2. m3 arrives (s 0) -> v3, m4 sent. m2 arrives: s = 3 - 1 = 2.
    grid = ScriptedGrid(4, [0, 1, 3, 2])
    strategy = AsyncFFGG(
        concurrency=2,
        max_updates=4,
        staleness_power=1.0,
        max_staleness=max_staleness,
        time_budget=2.0,  # ends the dropped case, whose 4th update never comes
        poll_interval=0.001,
        lr=0.1,
        # all-ones gradients on an all-zero model: no model scale to bound them by (the
        # bound has its own tests, tests/test_bounds.py); this test is about staleness
        max_update_norm=0,
        clip_factor=0,  # nor to clip them by (the clip's tests: below)
    )
    strategy.server_optimizer.lr = 1.0
    strategy.start(grid, ArrayRecord({"t": Array(np.zeros(3, np.float32))}), num_rounds=1)
    stale = [r.train["staleness"] for r in strategy.history if r.train]
    theta = strategy._current["t"].numpy()
    if max_staleness == -1:
        assert stale == [0, 1, 0, 2]
        np.testing.assert_allclose(theta, -(1 + 1 / 2 + 1 + 1 / 3), rtol=1e-6)
    else:  # the s = 2 update is dropped and counted; m4 never comes: the time budget ends it
        assert stale == [0, 1, 0]
        assert strategy.counts["dropped"] == 1
    counts = strategy.counts
    assert counts["replies"] == counts["applied"] + counts["dropped"]


def _run(overrides, num_nodes, **grid_kwargs) -> AsyncFFGG:
    cfg = Config.from_run_config(overrides)
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    strategy = make_strategy(cfg, split.shared)
    # stragglers and Byzantine nodes: the experiment ClientApp
    grid = LocalGrid(experiment_client_app(overrides), num_nodes, seed=cfg.seed, **grid_kwargs)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(get_tensors(model, split.shared)),
        num_rounds=cfg.total_rounds,
        timeout=30,
        evaluate_fn=server_evaluation(cfg, strategy, grid),
    )
    return strategy


def test_one_client_in_flight_equals_sequential_ffgg():
    """C = 1: every update has staleness 0 and the run is FFGG with one client per round
    (the same seeded draws): the same theta after 12 updates, bit for bit. Synchronous FFGG
    runs its paper's mean (its default defence holds a 1-reply federation's first reply,
    which no other node's norm vouches for; asynchronous FFGG's own clip, provisionally
    0.05 x ||theta|| there, leaves these honest gradients as they are)."""
    common = {**LINEAR, "num-server-rounds": 12, "sample-seed": 0}  # the same draws in both
    sync = {**common, "algorithm": "ffgg", "fraction-train": 1 / 6, "robust-aggregator": "none"}
    sync = run_local(sync, 6)
    strategy = _run({**common, "algorithm": "async-ffgg", "async-concurrency": 1}, 6)
    assert [r.train["staleness"] for r in strategy.history if r.train] == [0.0] * 12
    want = sync.rounds[-1].server["theta-error"]
    assert strategy.history[-1].server["theta-error"] == want
    assert want < sync.rounds[0].server["theta-error"]


def test_failing_and_silent_clients_do_not_stall_the_loop():
    """Nodes 0 and 3 never answer (their slots time out and go to others), node 1 raises
    (error replies, dropped), node 2 sends NaN (dropped): the loop still applies every
    update. Every client takes 0.2 s, so the run outlasts the 0.5 s timeout."""
    overrides = {
        **LINEAR,
        "algorithm": "async-ffgg",
        "num-server-rounds": 6,
        "async-concurrency": 3,
        "async-client-timeout-s": 0.5,
        "straggler-delay-s": 0.2,
    }
    byz = {1: {"byzantine": "alie"}, 2: {"byzantine": "nan"}}  # alie w/o simulation raises
    strategy = _run(overrides, 8, workers=3, silent=[0, 3], node_configs=byz)
    counts = strategy.counts
    assert counts["applied"] == 6 * 3
    assert counts["replies"] == counts["applied"] + counts["dropped"]
    assert counts["dropped"] >= 2 and counts["timed-out"] >= 1
    reasons = {r for entry in strategy.history for r in entry.dropped}
    assert any(r.startswith("client error") for r in reasons)
    assert "non-finite values" in reasons


def test_stragglers_are_drawn_by_seed_and_node_config_wins():
    cfg = Config.from_run_config(
        {"straggler-delay-s": 0.1, "straggler-fraction": 0.2, "straggler-factor": 10}
    )
    delays = [straggler_delay(cfg, {"partition-id": p, "num-partitions": 10}) for p in range(10)]
    assert sorted(delays) == pytest.approx([0.1] * 8 + [1.0] * 2)
    node = {"partition-id": 0, "num-partitions": 10, "delay-s": 0.3}
    assert straggler_delay(cfg, node) == 0.3
    assert straggler_delay(Config.from_run_config({}), node | {"delay-s": 0}) == 0.0


def test_async_refuses_pretraining_and_robust_rules():
    with pytest.raises(ConfigError, match="async-ffgg"):
        Config.from_run_config({"algorithm": "async-ffgg", "pretrain-rounds": 2})
    with pytest.raises(ValueError, match="concurrency"):
        AsyncFFGG(concurrency=-1)
