"""RobustFedAvg: pflower's robust rules inside a plain Flower strategy."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from pflower.strategies.aggregators import Mean, make_aggregator
from pflower.strategies.robust_fedavg import RobustFedAvg
from pflower.testbed.local_grid import LocalGrid

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


def test_a_rule_that_cannot_take_the_kept_replies_falls_back_to_the_clip():
    """Krum (f = 1) needs 3 replies; 6 of 8 nodes send NaN. The 2 kept replies keep their f,
    which Krum cannot take: the default defence's clip does (2 replies, no majority: nothing
    clipped, their mean), never a skipped round."""
    strategy = RobustFedAvg(aggregator=make_aggregator("krum"), byzantine=1, fraction_evaluate=0.0)
    w = run(strategy, {i: "nan" for i in range(6)}, rounds=2)
    target = (TARGETS[6] + TARGETS[7]) / 2
    expected = 5.0
    for _ in range(2):
        expected = expected - 0.5 * (expected - target)
    np.testing.assert_allclose(w, np.full(4, expected), rtol=1e-6)
    assert strategy.dropped == {"non-finite values": 12} and strategy.fallbacks == 2


# --- a drop-in for Flower's robust strategies (issue 31, item 6) -----------------------------
#: a model with a 0-dim (scalar) parameter, a float64 and an integer tensor besides a matrix
LAYOUT = {
    "w": ((2, 3), np.float32),
    "scale": ((), np.float32),
    "bias": ((3,), np.float64),
    "steps": ((), np.int64),
}


def _model(value: float) -> dict[str, np.ndarray]:
    return {k: np.full(shape, value, dtype) for k, (shape, dtype) in LAYOUT.items()}


def _replies(models, messages=None) -> list[Message]:
    """Train replies carrying ``models`` (to ``messages``, or to messages never configured)."""
    from flwr.app import MessageType

    if messages is None:
        messages = [
            Message(RecordDict(), dst_node_id=100 + i, message_type=MessageType.TRAIN)
            for i in range(len(models))
        ]
    return [
        Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in m.items()}),
                    "metrics": MetricRecord({"num-examples": 10}),
                }
            ),
            reply_to=msg,
        )
        for m, msg in zip(models, messages)
    ]


RULES = ["mean", "median", "trimmed-mean", "krum", "multi-krum", "geometric-median",
         "centered-clipping"]  # fmt: skip


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("configured", [True, False])
def test_every_array_keeps_its_shape_and_dtype(rule, configured, task_identity):
    """A scalar parameter comes back 0-dim (np.ascontiguousarray made it shape (1,))."""
    strategy = RobustFedAvg(aggregator=make_aggregator(rule), fraction_train=1.0)
    models = [_model(v) for v in (1.0, 2.0, 3.0, 4.0, 5.0)]
    messages = None
    if configured:
        start = ArrayRecord({k: Array(v) for k, v in _model(0.0).items()})

        class Nodes:
            def get_node_ids(self):
                return [1, 2, 3, 4, 5]

        messages = list(strategy.configure_train(1, start, ConfigRecord(), Nodes()))
    arrays, _ = strategy.aggregate_train(1, _replies(models, messages))
    assert arrays is not None, strategy.dropped
    got = {k: (tuple(a.shape), np.dtype(a.dtype)) for k, a in arrays.items()}
    assert got == {k: (shape, np.dtype(dtype)) for k, (shape, dtype) in LAYOUT.items()}
    for k, a in arrays.items():
        assert a.numpy().shape == LAYOUT[k][0] and a.numpy().dtype == LAYOUT[k][1]


def _flower(strategy, models):
    arrays, _ = strategy.aggregate_train(1, _replies(models))
    return {k: a.numpy() for k, a in arrays.items()}


def test_replies_alone_are_aggregated_as_flowers_own_rules_aggregate_them(task_identity):
    """Weights in, weights out, with no configure_train: the same values as Flower's
    FedMedian, FedTrimmedAvg, Krum, MultiKrum and (equal counts) FedAvg on the same replies."""
    from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg, Krum, MultiKrum

    rng = np.random.default_rng(0)
    models = [
        {"w": rng.normal(size=(2, 3)).astype(np.float32), "s": np.asarray(rng.normal(), np.float32)}
        for _ in range(10)
    ]  # 10: beta N = 2 replies trimmed at each end by both (Flower floors beta N, pflower ceils)
    models[3] = {"w": np.full((2, 3), 50.0, np.float32), "s": np.asarray(-40.0, np.float32)}
    pairs = [
        (FedAvg(), Mean(), 0),
        (FedMedian(), make_aggregator("median"), 1),
        (FedTrimmedAvg(beta=0.2), make_aggregator("trimmed-mean", beta=0.2), 1),
        (Krum(num_malicious_nodes=1), make_aggregator("krum"), 1),
        (MultiKrum(num_malicious_nodes=1, num_nodes_to_select=3), make_aggregator("krum", m=3), 1),
    ]
    for flower, rule, byzantine in pairs:
        expected = _flower(flower, models)
        got = _flower(RobustFedAvg(aggregator=rule, byzantine=byzantine), models)
        assert set(got) == set(expected)
        for k in expected:
            assert got[k].shape == models[0][k].shape, (type(flower).__name__, k)
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6)


def test_replies_alone_with_a_malformed_minority_are_checked_against_the_majority_layout(
    task_identity,
):
    models = [_model(v) for v in (1.0, 2.0, 3.0)] + [{"w": np.zeros((3, 2), np.float32)}]
    strategy = RobustFedAvg(aggregator=make_aggregator("median"))
    arrays, _ = strategy.aggregate_train(1, _replies(models))
    np.testing.assert_allclose(arrays["w"].numpy(), 2.0)
    assert arrays["scale"].numpy().shape == ()
    assert sum(strategy.dropped.values()) == 1
    assert next(iter(strategy.dropped)).startswith("names/shapes/dtypes differ")
    # nothing usable: None, as Flower's strategies answer a round without replies
    assert RobustFedAvg(aggregator=Mean()).aggregate_train(1, []) == (None, None)


def test_a_rule_that_cannot_take_its_f_at_the_planned_round_size_is_refused_before_any_message():
    """The library page's example (median of buckets of 2, byzantine = 2) at 5 replies a
    round of 8 nodes: refused in one line naming the size that works (9), no message sent;
    at every node a round (8 replies: 4 buckets, median tolerates 1) still refused; a rule
    the size takes runs."""
    sent = []

    def counting(msg, context):
        sent.append(msg)
        return quickstart_app({})(msg, context)

    for fraction in (0.6, 1.0):
        strategy = RobustFedAvg(
            aggregator=make_aggregator("median", bucket_size=2),
            byzantine=2,
            fraction_train=fraction,
            fraction_evaluate=0.0,
        )
        grid = LocalGrid(counting, len(TARGETS))
        start = ArrayRecord({"w": Array(np.full(4, 5.0, np.float32))})
        with pytest.raises(ValueError, match=r"byzantine=2\).*a round of 9 replies or more") as e:
            strategy.start(grid=grid, initial_arrays=start, num_rounds=3)
        assert "\n" not in str(e.value)
        assert not sent
    plain_median = RobustFedAvg(
        aggregator=make_aggregator("median"),
        byzantine=2,
        fraction_train=0.75,
        fraction_evaluate=0.0,
    )
    w = run(plain_median, {0: "huge", 7: "huge"}, rounds=3)
    assert np.abs(w).max() < 5.0


def test_the_library_pages_example_learns_on_flowers_quickstart_clientapp():
    """docs/library.md's RobustFedAvg (geometric median of buckets of 2, byzantine = 2, every
    node of 10 a round) on the quickstart's own Flower ClientApp: runs, and its global model
    learns (chance 0.1; 40 rounds, 3 seeds: 84.30 % against FedAvg's 87.14 %,
    benchmarks/results/robust-fedavg-clean.json)."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "quickstart"))
    from quickstart_app.flower_client_app import app
    from quickstart_app.task import Net

    torch.manual_seed(0)
    strategy = RobustFedAvg(
        aggregator=make_aggregator("geometric-median", bucket_size=2),
        byzantine=2,
        fraction_train=1.0,
    )
    grid = LocalGrid(app, 10, {"batch-size": 32, "local-epochs": 1})
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=10,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    final = result.evaluate_metrics_clientapp[10]
    assert final["eval_acc"] > 0.5, final
    assert strategy.fallbacks == 0 and not strategy.dropped
