"""RobustFedAvg: pflower's robust rules inside a plain Flower strategy."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from pflower.experiments.local_grid import LocalGrid
from pflower.strategies.aggregators import Mean, make_aggregator
from pflower.strategies.robust_fedavg import RobustFedAvg

TARGETS = np.linspace(-1.0, 1.0, 8)  # honest client i pulls w towards TARGETS[i]


def quickstart_app(bad: dict[int, str]) -> ClientApp:
    """A plain Flower ClientApp (no pflower): one step w <- w - 0.5 (w - t_i), or an attack."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        w = msg.content["arrays"]["w"].numpy()
        new = w - 0.5 * (w - TARGETS[pid])
        kind = bad.get(pid)
        if kind == "huge":
            new = np.full_like(w, 1e6)
        elif kind == "nan":
            new = np.full_like(w, np.nan)
        elif kind == "infs":  # +Inf and -Inf: their sum is NaN, each alone is Inf
            new = np.array([np.inf, -np.inf, 1.0, 1.0], w.dtype)
        elif kind == "shape":
            new = np.zeros(w.size + 1, w.dtype)
        elif kind == "raise":
            raise RuntimeError("device fell over")
        metrics = {"num-examples": 10 + pid}
        if kind == "list-count":
            metrics = {"num-examples": [10, 20]}
        elif kind == "list-metric":
            metrics["train-loss"] = [0.1, 0.2]
        elif kind == "zero-count":
            metrics = {"num-examples": 0}
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(new.astype(w.dtype))}),
                "metrics": MetricRecord(metrics),
            }
        )
        return Message(content=content, reply_to=msg)

    return app


def run(strategy, bad, rounds=15):
    grid = LocalGrid(quickstart_app(bad), len(TARGETS))
    start = ArrayRecord({"w": Array(np.full(4, 5.0, np.float32))})
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=rounds)
    return result.arrays["w"].numpy()


def test_mean_equals_the_unweighted_fedavg_step():
    w = run(RobustFedAvg(aggregator=Mean(), fraction_evaluate=0.0), {}, rounds=1)
    # every client returns 5 - 0.5 (5 - t_i): the mean is 5 - 0.5 (5 - mean t) = 2.5
    np.testing.assert_allclose(w, 2.5 + 0.5 * TARGETS.mean(), rtol=1e-6)


def test_median_resists_what_flowers_fedavg_does_not():
    bad = {0: "huge", 7: "huge"}
    robust = run(
        RobustFedAvg(aggregator=make_aggregator("median"), byzantine=2, fraction_evaluate=0.0),
        bad,
    )
    assert np.abs(robust).max() < 1.0  # inside the honest targets' range
    plain = run(FedAvg(fraction_evaluate=0.0), bad)
    assert np.abs(plain).max() > 1e4


def test_malformed_replies_are_dropped_and_counted_and_the_run_goes_on():
    strategy = RobustFedAvg(
        aggregator=make_aggregator("median", bucket_size=2), byzantine=1, fraction_evaluate=0.0
    )
    w = run(strategy, {0: "nan", 1: "shape", 2: "raise", 3: "infs"}, rounds=3)
    assert np.isfinite(w).all()
    assert sum(strategy.dropped.values()) == 4 * 3
    assert strategy.dropped["non-finite values"] == 2 * 3
    assert {r.split(":")[0] for r in strategy.dropped} == {
        "non-finite values",
        "names/shapes/dtypes differ from the shared parameters",
        "client error",
    }


def test_negative_byzantine_is_refused():
    with pytest.raises(ValueError, match="byzantine"):
        RobustFedAvg(aggregator=Mean(), byzantine=-1)


def test_malformed_counts_and_metrics_are_dropped_not_a_crash():
    strategy = RobustFedAvg(aggregator=make_aggregator("median"), fraction_evaluate=0.0)
    w = run(strategy, {0: "list-count", 1: "list-metric", 2: "zero-count"}, rounds=2)
    assert np.isfinite(w).all()
    assert strategy.dropped == {
        "metric 'num-examples' is not a number": 2,
        "metric 'train-loss' is not a number": 2,
        "num-examples is not a positive integer": 2,
    }


def test_a_round_with_too_few_replies_for_the_rule_is_skipped():
    """Krum needs 3 replies; 6 of 8 nodes send NaN: each round is skipped, w unchanged."""
    strategy = RobustFedAvg(aggregator=make_aggregator("krum"), fraction_evaluate=0.0)
    w = run(strategy, {i: "nan" for i in range(6)}, rounds=2)
    np.testing.assert_array_equal(w, np.full(4, 5.0, np.float32))
    assert strategy.dropped == {"non-finite values": 12}
