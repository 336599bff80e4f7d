"""What keeps a run with many clients linear: a bounded number of messages outstanding, a
sampled final evaluation, a data cache bounded by bytes, replies combined in a fixed order."""

from __future__ import annotations

import random

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from helpers import OUTPUTS_DIR

from pflower.client_app import build_client_app, parse_config
from pflower.server_app import run
from pflower.strategies import FedAvg
from pflower.strategies.exchange import Window
from pflower.task import data
from pflower.testbed.local_grid import LocalGrid, run_local
from pflower.wire import CONFIG, QUERY


class Counting(LocalGrid):
    """A LocalGrid that records how many messages were outstanding (pushed, not pulled)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outstanding, self.most = 0, 0

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        self.outstanding += len(ids)
        self.most = max(self.most, self.outstanding)
        return ids

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        self.outstanding -= len(replies)
        return replies


def queries(grid) -> list[Message]:
    content = RecordDict({CONFIG: ConfigRecord({QUERY: "partition-id"})})
    return [
        Message(content=content, message_type=MessageType.QUERY, dst_node_id=n)
        for n in grid.get_node_ids()
    ]


def test_a_window_keeps_at_most_its_size_outstanding_and_returns_every_reply():
    app = build_client_app({"dataset": "digits", "partitioner": "iid"})
    grid = Counting(app, 10, workers=2)
    replies = list(Window(grid, 3, pull_interval=0.001).send_and_receive(queries(grid)))
    assert sorted(r.metadata.src_node_id for r in replies) == sorted(grid.get_node_ids())
    assert grid.most == 3
    grid = Counting(app, 10, workers=2)
    list(grid.send_and_receive(queries(grid)))  # Flower's way: everything at once
    assert grid.most == 10


def test_a_window_stops_at_the_timeout_with_what_arrived():
    app = build_client_app({"dataset": "digits", "partitioner": "iid"})
    grid = LocalGrid(app, 6, silent=[0, 1, 2, 3, 4, 5])
    assert list(Window(grid, 2).send_and_receive(queries(grid), timeout=0.3)) == []


@pytest.mark.parametrize(
    ("fraction", "nodes", "expected"),
    [
        (0.0, 20, 1.0),
        (0.0, 100, 1.0),
        (0.0, 1000, 0.1),
        (0.0, 5000, 0.1),
        (0.0, 400, 0.25),
        (0.3, 20, 0.3),
    ],
)
def test_the_final_evaluation_samples_past_100_clients(fraction, nodes, expected):
    strategy = FedAvg(final_evaluate_fraction=fraction)
    assert strategy.evaluation.share_of_final(nodes) == pytest.approx(expected)


def test_final_evaluate_fraction_reaches_the_run():
    run_cfg = {
        "dataset": "digits",
        "partitioner": "iid",
        "algorithm": "fedavg",
        "num-server-rounds": 2,
        "evaluate-every": 2,
        "final-evaluate-fraction": 0.25,
        "outputs-dir": OUTPUTS_DIR,
    }
    report = run_local(run_cfg, 12)
    assert report.final["clients"] == 3 and len(report.clients) == 3


def test_the_data_cache_keeps_every_client_within_its_byte_budget(monkeypatch):
    cfg = parse_config(frozenset({"dataset": "synthetic-leaf", "partitioner": "natural"}.items()))
    data.client_arrays.cache_clear()
    calls = []
    original = data.client_arrays.fn
    monkeypatch.setattr(data.client_arrays, "fn", lambda *a: calls.append(a) or original(*a))
    first = [data.client_arrays(cfg, pid, 100) for pid in range(100)]
    assert len(calls) == 100 and len(data.client_arrays.entries) == 100  # not 64
    again = [data.client_arrays(cfg, pid, 100) for pid in range(100)]
    assert len(calls) == 100 and all(a is b for a, b in zip(first, again))
    per_client = data.client_arrays.nbytes / 100
    monkeypatch.setenv("PFLOWER_DATA_CACHE_MB", str(10.5 * per_client / 2**20))
    data.client_arrays(cfg, 0, 100)  # a hit, then the budget trims the least recent
    assert len(data.client_arrays.entries) == 10
    assert (cfg, 0, 100) in data.client_arrays.entries  # the one just used stays
    data.client_arrays.cache_clear()


def test_partitions_of_a_builtin_set_are_never_read_row_by_row(monkeypatch):
    """datasets >= 4 reads an unformatted column one Python call per row (37 s over
    synthetic-leaf's rows at 1 000 clients): the partitioner and the partitions see arrow."""
    from datasets.arrow_dataset import Column

    rows = []
    original = Column.__iter__
    monkeypatch.setattr(Column, "__iter__", lambda self: rows.append(1) or original(self))
    cfg = parse_config(frozenset({"dataset": "synthetic-leaf", "partitioner": "natural"}.items()))
    data.client_arrays.cache_clear()
    data._source.cache_clear()
    parts = [data.client_arrays(cfg, pid, 30) for pid in range(30)]
    assert rows == [] and sum(len(p.y_train) + len(p.y_test) for p in parts) > 30 * 500
    data.client_arrays.cache_clear()


class Shuffled(LocalGrid):
    """Replies in a random order, as they arrive on a real engine."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(super().send_and_receive(messages, timeout=timeout))
        random.Random(len(replies)).shuffle(replies)
        return replies


@pytest.mark.parametrize("algorithm", ["fedavg", "ffgg"])
def test_arrival_order_changes_no_bit_of_the_result(algorithm):
    """Replies are combined in partition order: float64 sums of a float64 model (FFGG's
    quadratic problem) come out the same bit for bit whatever order they arrived in."""
    run_cfg = {
        "sample-seed": 0,  # two runs compared: the same sample
        "dataset": "synthetic-linear",
        "model": "synthetic-linear",
        "linear-n": 200,
        "algorithm": algorithm,
        "num-server-rounds": 3,
        "evaluate-every": 3,
        "outputs-dir": OUTPUTS_DIR,
    }
    cfg = parse_config(frozenset(run_cfg.items()))
    in_order = run_local(run_cfg, 7)
    shuffled = run(Shuffled(build_client_app(run_cfg), 7, seed=cfg.seed), cfg)
    for name, value in in_order.shared.items():
        assert np.array_equal(value, shuffled.shared[name]), name


def test_the_streamed_mean_of_updates_is_the_mean_of_the_updates():
    from pflower.strategies.combine import weighted_mean, weighted_mean_of_updates

    rng = np.random.default_rng(0)
    current = {"a": rng.normal(size=(7, 3)).astype(np.float32), "b": rng.normal(size=5)}
    arrays = [{k: (v + rng.normal(size=v.shape)).astype(v.dtype) for k, v in current.items()}]
    arrays += [{k: (v * 3).astype(v.dtype) for k, v in current.items()} for _ in range(4)]
    weights = [3.0, 1.0, 7.0, 2.0, 5.0]
    wide = [{k: current[k].astype(np.float64) - a[k] for k in current} for a in arrays]
    expected = weighted_mean(wide, weights)
    got = weighted_mean_of_updates(current, arrays, weights)
    for k in current:  # c - sum_i w_i a_i: the mean of the updates up to float64 rounding
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.ones((2, 3))),
        np.zeros((0, 5), np.float32),
        np.arange(6, dtype=">f4"),
    ],
)
def test_a_reply_array_is_read_in_place(value):
    from flwr.app import Array

    from pflower.wire import array_view

    array = Array(value)
    view = array_view(array)
    copy = array.numpy()
    assert view.dtype == copy.dtype and view.shape == copy.shape and np.array_equal(view, copy)
    assert not view.flags.owndata and not view.flags.writeable  # the reply's bytes, not a copy


def test_a_window_without_a_limit_pushes_everything_at_once_and_pulls_every_reply():
    app = build_client_app({"dataset": "digits", "partitioner": "iid"})
    grid = Counting(app, 10, workers=2)
    replies = list(Window(grid, None, pull_interval=0.001).send_and_receive(queries(grid)))
    assert sorted(r.metadata.src_node_id for r in replies) == sorted(grid.get_node_ids())
    assert grid.most == 10
    with pytest.raises(ValueError, match="must be >= 1"):
        Window(grid, 0)
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        Window(grid, None, pull_interval=0.0)


class HttpGrid(Counting):
    """Stands for Flower's deployment grid (``ENGINE``: ``engine_of`` reports it so), whose
    own ``send_and_receive`` sleeps 3 s between pulls: never called."""

    ENGINE = "deployment"

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("Flower's 3 s pull loop was used")


def test_in_deployment_the_server_pulls_every_pull_interval_with_a_short_backoff(monkeypatch):
    from flwr.supercore.inflatable import inflatable_utils as objects

    from pflower.flower.grids import DEPLOYMENT, LOCAL, engine_of
    from pflower.flower.waits import pull_backoff

    for fn in (objects.pull_objects, objects.pull_and_inflate_object_from_tree):
        monkeypatch.setitem(fn.__kwdefaults__, "initial_backoff", 1)  # restored afterwards
    run_cfg = {
        "dataset": "digits",
        "partitioner": "iid",
        "algorithm": "fedalt",
        "num-server-rounds": 2,
        "evaluate-every": 2,
        "pull-interval": 0.02,
        "outputs-dir": OUTPUTS_DIR,
        "sample-seed": 0,  # compared with run_local's run: the same sample
    }
    cfg = parse_config(frozenset(run_cfg.items()))
    grid = HttpGrid(build_client_app(run_cfg), 6, seed=cfg.seed)
    assert engine_of(Window(grid, 2)) == DEPLOYMENT and engine_of(Counting(None, 1)) == LOCAL
    deployed = run(grid, cfg)
    assert grid.most == 6  # no limit in deployment: every message of a round at once
    assert pull_backoff() == 0.02  # the ServerApp's object pulls retry after pull-interval
    local = run_local(run_cfg, 6)
    assert deployed.final == local.final
