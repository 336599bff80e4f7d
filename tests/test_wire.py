"""What crosses the wire: only shared parameters; malformed replies are dropped and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.strategies import ALGORITHMS, FedAvg, personal_split, wire_split
from pflower.strategies.fedalt import HEAD_ALIASES
from pflower.task.data import dataset_info
from pflower.task.models import build_model
from pflower.task.split import get_tensors

SMALL = {"dataset": "digits", "model": "mlp", "batch-size": 64, "finetune-epochs": 1}


def _server_side(overrides):
    cfg = Config.from_run_config(overrides)
    info = dataset_info(cfg)
    model = build_model(cfg.model, info.input_shape, info.num_classes, seed=cfg.seed)
    return model, wire_split(model, cfg), personal_split(model, cfg)


def _names_in(content: RecordDict) -> set[str]:
    names = set(content.keys())
    for record in content.values():
        names |= set(record.keys())
    return names


WIRE_CASES = [
    (algorithm, split)
    for algorithm in sorted(ALGORITHMS)
    for split in ("head", "input")
    if not ((algorithm in HEAD_ALIASES or algorithm in ("pflego", "fedbabu")) and split != "head")
]


# what some algorithms need besides the shared arrays: run config, round config, records
RUN_EXTRA = {
    "l2gd": {"fraction-train": 1.0, "local-steps": 5},
    "br-ffgg": {"robust-aggregator": "median"},
}
ROUND_EXTRA = {
    "l2gd": {"l2gd-mix": 0.5, "l2gd-steps": 2},
    "pflego": {"pflego-head-lr": 0.1},
    "apfl": {"apfl-round": 1},
}
REPLY_EXTRA = {"scaffold": {"control-delta"}}


@pytest.mark.parametrize("algorithm, split", WIRE_CASES)
def test_client_replies_carry_no_personal_parameter(task_identity, algorithm, split):
    overrides = {**SMALL, "algorithm": algorithm, "split": split, **RUN_EXTRA.get(algorithm, {})}
    model, wire, personal = _server_side(overrides)
    app = build_client_app(overrides)
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 1, "num-partitions": 4},
        state=RecordDict(),
        run_config={},
    )
    shared = ArrayRecord(get_tensors(model, wire.shared))
    private = set(wire.personal) | set(personal.personal) - set(wire.shared)
    for server_round, kind in [
        (1, MessageType.TRAIN),
        (2, MessageType.TRAIN),
        (2, MessageType.EVALUATE),
    ]:
        config = {"server-round": server_round, "lr": 0.05, **ROUND_EXTRA.get(algorithm, {})}
        content = RecordDict({"arrays": shared, "config": ConfigRecord(config)})
        if algorithm == "scaffold" and kind == MessageType.TRAIN:
            content["control"] = ArrayRecord(
                {k: Array(np.zeros_like(a.numpy())) for k, a in shared.items()}
            )
        msg = Message(content=content, dst_node_id=7, message_type=kind)
        reply = app(msg, context)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        names = _names_in(reply.content)
        assert not names & private, f"{algorithm}: {sorted(names & private)} left the client"
        if kind == MessageType.TRAIN:
            half = ALGORITHMS[algorithm].client
            expected = {half.reply_key, *REPLY_EXTRA.get(algorithm, ())}
            assert set(reply.content.array_records) == expected
            assert list(reply.content[half.reply_key].keys()) == list(wire.shared)
        else:
            assert not reply.content.array_records  # evaluation sends metrics only
            metrics = reply.content["metrics"]
            assert 0 <= metrics["personal-accuracy"] <= 1 and metrics["num-examples"] > 0


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def _reply(msg: Message, arrays: dict | None, metrics: dict | None, key="arrays") -> Message:
    content = RecordDict()
    if arrays is not None:
        content[key] = ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


def test_malformed_replies_are_dropped_and_counted(task_identity):
    # the papers' mean (no default defence: it would clip the larger of the 2 replies kept of
    # 9, 4 x the other, to 2 x it: tests/test_default_defence.py)
    strategy = FedAvg(fraction_train=1.0, clipping=False)
    strategy.num_rounds = 1
    current = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid(range(1, 10))))
    assert len(msgs) == 9
    good1 = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}
    good2 = {"w": 4 * np.ones((2, 3), np.float32), "b": 4 * np.ones(3, np.float32)}
    nan = {"w": np.full((2, 3), np.nan, np.float32), "b": np.ones(3, np.float32)}
    replies = [
        _reply(msgs[0], good1, {"num-examples": 30}),
        _reply(msgs[1], good2, {"num-examples": 10}),
        _reply(msgs[2], nan, {"num-examples": 10}),  # NaN
        _reply(msgs[3], {"w": np.ones((3, 2), np.float32), "b": good1["b"]}, {"num-examples": 10}),
        _reply(msgs[4], good1, {"num-examples": 10}, key="gradient"),  # wrong key
        _reply(msgs[5], {"w": good1["w"]}, {"num-examples": 10}),  # missing array
        _reply(msgs[6], good1, {"loss": 1.0}),  # no num-examples
        _reply(msgs[7], {**good1, "head.weight": np.ones(2, np.float32)}, {"num-examples": 5}),
        Message(Error(code=0, reason="boom"), reply_to=msgs[8]),  # client error
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    # weighted by num-examples over the two good replies: (30 * 1 + 10 * 4) / 40 = 1.75
    assert np.allclose(new["w"].numpy(), 1.75) and np.allclose(new["b"].numpy(), 1.75)
    assert metrics["applied"] == 2 and metrics["dropped"] == 7
    assert sum(strategy.history[-1].dropped.values()) == 7


def test_a_round_with_only_bad_replies_keeps_the_model(task_identity):
    strategy = FedAvg()
    strategy.num_rounds = 2  # not the last round: a phase that applied nothing fails there
    arrays = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    (msg,) = strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid([5]))
    new, metrics = strategy.aggregate_train(
        1, [_reply(msg, {"w": np.array([np.inf, 0], np.float32)}, {"num-examples": 3})]
    )
    assert new is arrays and metrics["dropped"] == 1  # the model is kept as it was


def test_sampling_is_without_replacement_and_seeded():
    a = FedAvg(fraction_train=0.3, sample_seed=1)  # a reproducible sample
    b = FedAvg(fraction_train=0.3, sample_seed=1)
    grid = FakeGrid(range(100, 120))
    for _ in range(5):
        s = a.nodes.sample(grid, 0.3)
        assert len(s) == len(set(s)) == 6
        assert s == b.nodes.sample(grid, 0.3)
    assert a.nodes.sample(grid, 0.3, everyone=True) == list(range(100, 120))


def test_evaluation_summary_statistics():
    from pflower.strategies.history import summarize_clients

    rows = [
        {
            "num-examples": 10,
            "personal-accuracy": 0.9,
            "personal-loss": 0.1,
            "global-accuracy": 0.5,
            "global-loss": 1.0,
        },
        {
            "num-examples": 30,
            "personal-accuracy": 0.5,
            "personal-loss": 0.7,
            "global-accuracy": 0.6,
            "global-loss": 0.9,
        },
    ]
    s = summarize_clients(rows)
    assert s["personal-accuracy"] == pytest.approx((9 + 15) / 40)  # pooled over examples
    assert s["personal-accuracy-mean"] == pytest.approx(0.7)
    assert s["personal-accuracy-worst"] == 0.5 and s["clients-hurt"] == 1
    assert s["global-accuracy"] == pytest.approx((5 + 18) / 40)


def test_evaluation_summary_of_alpha_and_the_local_part():
    """APFL's per-client alpha summarized as its mean, min and max over the clients; the
    local part pooled as the other models; an alpha outside [0, 1] is a reply to drop."""
    from pflower.strategies.history import summarize_clients
    from pflower.wire import metrics_problem

    rows = [
        {"num-examples": 10, "personal-loss": 0.1, "local-part-accuracy": 0.9, "alpha": 0.0},
        {"num-examples": 30, "personal-loss": 0.7, "local-part-accuracy": 0.5, "alpha": 0.8},
        {"num-examples": 20, "personal-loss": 0.2, "local-part-accuracy": 0.8, "alpha": 0.1},
    ]
    for r in rows:
        r["local-part-loss"] = 1 - r["local-part-accuracy"]
    s = summarize_clients(rows)
    assert (s["alpha-mean"], s["alpha-min"], s["alpha-max"]) == pytest.approx((0.3, 0.0, 0.8))
    assert s["local-part-accuracy"] == pytest.approx((9 + 15 + 16) / 60)
    assert s["local-part-accuracy-worst"] == 0.5
    without = {k: v for k, v in rows[1].items() if k != "alpha"}
    assert "alpha-min" not in summarize_clients([rows[0], without])  # not every client's
    assert metrics_problem({"num-examples": 3, "alpha": 1.0}) == ""
    assert "outside [0, 1]" in metrics_problem({"num-examples": 3, "alpha": 1.5})
    assert "outside [0, 1]" in metrics_problem({"num-examples": 3, "alpha": -0.1})


def test_sampling_follows_partition_ids_not_node_ids():
    """Node ids are random per run; with the partition map the same clients are drawn."""
    a = FedAvg(fraction_train=0.3, sample_seed=1)  # a reproducible sample
    b = FedAvg(fraction_train=0.3, sample_seed=1)
    a.nodes.partition_of = {100 + p: p for p in range(10)}  # run 1: node ids 100..109
    b.nodes.partition_of = {900 - 7 * p: p for p in range(10)}  # run 2: other ids, other order
    for _ in range(5):
        pa = [a.nodes.partition_of[n] for n in a.nodes.sample(FakeGrid(a.nodes.partition_of), 0.3)]
        pb = [b.nodes.partition_of[n] for n in b.nodes.sample(FakeGrid(b.nodes.partition_of), 0.3)]
        assert pa == pb


def test_held_out_clients_never_train_but_are_evaluated():
    strategy = FedAvg(fraction_train=1.0, holdout_fraction=0.25, seed=0)
    grid = FakeGrid(range(100, 108))
    strategy.nodes.partition_of = {100 + i: 7 - i for i in range(8)}  # node 100 is partition 7
    for _ in range(3):
        trained = strategy.nodes.sample(grid, 1.0, train=True)
        assert sorted(strategy.nodes.partition_of[n] for n in trained) == list(range(6))
    assert len(strategy.nodes.sample(grid, 1.0, everyone=True)) == 8
    assert len(strategy.nodes.sample(grid, 1.0)) == 8  # evaluation samples every client


@pytest.mark.parametrize(
    "algorithm", ["fedalt", "fedsim", "local-ffgg", "ffgg", "fedavg", "pflego", "apfl"]
)
def test_clients_step_at_the_messages_learning_rates(algorithm):
    """One road for step sizes: the server's schedule in the message (``lr``, ``lr-scale``),
    not the client's copy of the run config. With both 0 nothing the client trains moves
    (the run config's lr is 0.05): the reply and the personal part stay at what was sent."""
    from helpers import job_for

    from pflower.strategies import get_algorithm
    from pflower.wire import DELTA, GRADIENT

    overrides = {"algorithm": algorithm, "lr": 0.05, "personal-lr": 0.05, "local-steps": 3}
    if "ffgg" in algorithm:
        overrides["ffgg-init"] = "received"  # w starts at the shared init: checkable
    job = job_for(overrides)
    half = get_algorithm(algorithm).client
    sent = {k: v.clone() for k, v in get_tensors(job.model, job.split.shared).items()}
    config = {"lr": 0.0, "lr-scale": 0.0, "pflego-head-lr": 0.0, "apfl-round": 1}
    records, key, _ = half.reply(job, config)
    reply = records[key].to_torch_state_dict()
    if key == DELTA:
        assert all(float(reply[k].abs().max()) == 0.0 for k in reply)
    elif key != GRADIENT:
        assert all(torch.equal(reply[k], sent[k]) for k in sent)
    if algorithm in ("fedalt", "fedsim", "ffgg", "local-ffgg"):  # personal part: at its init
        personal = get_tensors(job.model, job.split.personal)
        assert all(torch.equal(personal[k], job.init_personal[k]) for k in personal)
    # and at the message's non-zero rates the same client learns
    before = get_tensors(job.model, [*job.split.shared, *job.split.personal])
    before = {k: v.clone() for k, v in before.items()}
    half.train(job, {**config, "lr": 0.05, "lr-scale": 1.0, "pflego-head-lr": 0.05})
    moved = get_tensors(job.model, list(before))
    assert any(not torch.equal(moved[k], before[k]) for k in moved)


@pytest.mark.parametrize(
    "value",
    [
        np.random.default_rng(0).random((3, 4)).astype(np.float32),
        np.arange(5, dtype=np.int64),
        np.array(3.5),  # 0-dim stays 0-dim
        np.random.default_rng(1).random((2, 3, 4)),
        np.zeros((0, 3), np.float32),
        np.random.default_rng(2).random(4).astype(">f8"),  # big-endian
        np.asfortranarray(np.random.default_rng(3).random((3, 5))),
        torch.randn(4, 2, generator=torch.Generator().manual_seed(0)),
    ],
)
def test_fast_array_conversion_equals_flowers(value):
    """wire.to_array / array_view / to_torch (the cached-header paths every message uses)
    against Flower's own Array.from_numpy_ndarray / Array.numpy: the same bytes for a
    C-ordered array, the same values, dtype and shape for every array."""
    from pflower.wire import array_view, to_array, to_record, to_torch

    ref_np = value.numpy() if isinstance(value, torch.Tensor) else value
    ref = Array.from_numpy_ndarray(np.asarray(ref_np))
    mine = to_array(value)
    if ref_np.flags.c_contiguous:
        assert mine.data == ref.data
    assert (mine.dtype, tuple(mine.shape)) == (ref.dtype, tuple(ref.shape))
    for array in (mine, ref):  # either bytes read back by the fast reader
        view = array_view(array)
        assert view.dtype == ref.numpy().dtype and view.shape == ref.numpy().shape
        np.testing.assert_array_equal(view, ref.numpy())
    back = to_torch(to_record({"x": value}))["x"]
    assert back.shape == tuple(ref_np.shape)
    np.testing.assert_array_equal(back.numpy(), ref_np)
    back += 1  # writable, and not the record's bytes


def test_one_pass_yields_the_dataloaders_batches():
    """task.data.loaders.one_pass on a ``batched`` loader: the batches the DataLoader yields,
    in order, and the generator left in the same state (the next pass equal too)."""
    from torch.utils.data import TensorDataset

    from pflower.task.data.loaders import batched, one_pass

    data = TensorDataset(torch.arange(70.0).reshape(35, 2), torch.arange(35))
    fast = batched(data, 8, shuffle=True, generator=torch.Generator().manual_seed(5))
    slow = batched(data, 8, shuffle=True, generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        got, want = list(one_pass(fast)), list(slow)
        assert len(got) == len(want) == 5
        for (a, b), (c, d) in zip(got, want):
            assert torch.equal(a, c) and torch.equal(b, d)
    assert torch.equal(fast.generator.get_state(), slow.generator.get_state())


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(0).random((3, 4)).astype(np.float32),  # the fast path
        np.random.default_rng(1).random((3, 4)),  # float64 into float32: cast
        np.random.default_rng(2).random((3, 4)).astype(">f4"),  # big-endian
        np.asfortranarray(np.random.default_rng(3).random((3, 4)).astype(np.float32)),
    ],
)
def test_parameters_load_from_a_messages_read_only_views(values):
    """split.set_tensors takes a message's bytes as read-only NumPy views (what a client
    receives) and leaves each parameter equal to ``torch.tensor(values)`` cast to its dtype:
    one copy into a CPU parameter of the same dtype, a cast otherwise; autograd sees the
    write (the version counter moves), and the message's bytes are untouched."""
    from pflower.task.split import set_tensors
    from pflower.wire import array_view, to_array

    model = torch.nn.Linear(4, 3, bias=False)
    array = Array.from_numpy_ndarray(values)  # Flower's own bytes, byte order kept
    before = bytes(array.data)
    view = array_view(array)
    assert not view.flags.writeable
    version = model.weight._version
    set_tensors(model, {"weight": view})
    want = torch.tensor(values.astype(values.dtype.newbyteorder("="))).to(torch.float32)
    assert torch.equal(model.weight.detach(), want)
    assert model.weight._version > version
    assert array.data == before
    with pytest.raises(ValueError, match="shape"):
        set_tensors(model, {"weight": array_view(to_array(np.zeros((4, 3), np.float32)))})


def test_the_settings_fingerprint_is_computed_once_per_settings_and_follows_them():
    """The handshake's fingerprint (cached per frozen settings object) equals the uncached
    hash and changes with a shared key, not with a server-only one."""
    from pflower.wire import _fingerprint, settings_fingerprint

    base = Config.from_run_config({})
    assert settings_fingerprint(base) == _fingerprint(base) == settings_fingerprint(base)
    other = Config.from_run_config({"batch-size": 7})
    assert settings_fingerprint(other) == _fingerprint(other) != settings_fingerprint(base)
    server_only = Config.from_run_config({"num-server-rounds": 7})
    assert settings_fingerprint(server_only) == settings_fingerprint(base)
