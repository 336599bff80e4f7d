"""A bad client never stops, steers or spies on the run: bounded replies, crash-free
aggregation, refusal at the door, stored state that cannot wedge a client."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from helpers import OUTPUTS_DIR, job_for

from pflower.client_app import build_client_app
from pflower.config import Config, ConfigError
from pflower.strategies import ALGORITHMS, FedAvg
from pflower.strategies.aggregators import make_aggregator
from pflower.strategies.apfl import ALPHA_KEY, V_KEY, APFLClient
from pflower.strategies.fedalt import HEAD_ALIASES
from pflower.task.state import DirectoryStore
from pflower.testbed.local_grid import LocalGrid, run_local
from pflower.wire import ALPHA

RUN = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "batch-size": 64,
    "finetune-epochs": 1,
    "pretrain-rounds": 0,
    "num-server-rounds": 2,
    "evaluate-every": 2,
    "fraction-train": 1.0,
    "outputs-dir": OUTPUTS_DIR,
}
NODES = 5


def tampering_app(overrides, tamper_train=None, tamper_evaluate=None) -> ClientApp:
    """pflower's ClientApp whose replies ``tamper_*(partition, round, reply)`` may change."""
    honest = build_client_app(overrides)
    app = ClientApp()

    def round_of(msg: Message) -> int:
        return int(msg.content["config"].get("server-round", 0))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if tamper_train:
            tamper_train(int(context.node_config["partition-id"]), round_of(msg), reply)
        return reply

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if tamper_evaluate:
            tamper_evaluate(int(context.node_config["partition-id"]), round_of(msg), reply)
        return reply

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return honest(msg, context)

    return app


def reasons(report) -> Counter:
    """Drops over the run by reason, numbers stripped (``update norm 1e+31 > ...``)."""
    out: Counter = Counter()
    for entry in report.rounds:
        for reason, count in entry.dropped.items():
            out[reason.split(" ")[0] + " " + reason.split(" ")[1]] += count
    return out


def shared_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def set_everywhere(value):
    def tamper(pid, rnd, reply):
        if pid == 0:
            key = next(k for k in ("arrays", "delta", "gradient") if k in reply.content)
            record = reply.content[key]
            reply.content[key] = ArrayRecord(
                {k: Array(np.full_like(a.numpy(), value)) for k, a in record.items()}
            )

    return tamper


@pytest.mark.parametrize("algorithm", ["fedavg", "fedalt", "ffgg", "pflego"])
def test_one_huge_finite_reply_is_dropped_and_steers_nothing(algorithm):
    """1e30 everywhere: finite, so it passes the NaN check; the update-norm bound drops it,
    and the run equals the one in which that node never answered."""
    run = {**RUN, "algorithm": algorithm}
    bad = run_local(run, NODES, client_app=tampering_app(run, set_everywhere(1e30)))
    silent_grid = LocalGrid(build_client_app(run), NODES, silent=[0])
    from pflower.server_app import run as run_on

    silent = run_on(silent_grid, Config.from_run_config(run))
    assert reasons(bad)["update norm"] == 2  # once per round
    assert reasons(silent)["no reply"] >= 2
    assert all(np.isfinite(v).all() for v in bad.shared.values())
    if algorithm != "pflego":  # PFLEGO's alpha counts the examples of the nodes that answer
        assert shared_equal(bad.shared, silent.shared)
    else:  # server Adam: its moments never saw the huge gradient
        assert max(float(np.abs(v).max()) for v in bad.shared.values()) < 10


def npy_bytes(a: np.ndarray) -> bytes:
    """NumPy's ``.npy`` bytes of ``a``, written here (not by pflower's wire code)."""
    import io

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


SPOOFS = {  # what the bytes hold, under a header stating the shared dtype and shape
    "one value": lambda a: npy_bytes(np.full(1, 0.5, a.dtype)),
    "complex": lambda a: npy_bytes(np.zeros(a.shape, np.complex64)),
    "short data": lambda a: npy_bytes(np.zeros(a.shape, a.dtype))[:-8],
    "transposed": lambda a: npy_bytes(np.zeros(a.shape[::-1], a.dtype)),
}


def spoofing(spoof):
    """Node 0 states the shared layout (``Array.dtype``, ``.shape``: what the layout
    check reads) over bytes that hold another array (Flower's constructor allows it)."""

    def tamper(pid, rnd, reply):
        if pid == 0:
            key = next(k for k in ("arrays", "delta", "gradient") if k in reply.content)
            reply.content[key] = ArrayRecord(
                {
                    k: Array(
                        dtype=a.dtype,
                        shape=tuple(a.shape),
                        stype="numpy.ndarray",
                        data=SPOOFS[spoof](a.numpy()),
                    )
                    for k, a in reply.content[key].items()
                }
            )

    return tamper


@pytest.mark.parametrize("spoof", sorted(SPOOFS))
@pytest.mark.parametrize(
    "algorithm, extra",
    [("fedavg", {}), ("ffgg", {}), ("ffgg", {"robust-aggregator": "median"})],
)
def test_bytes_that_are_not_the_stated_array_are_dropped(algorithm, extra, spoof):
    """A reply whose arrays state the shared layout but whose bytes hold one value (it
    broadcast into every coordinate of the mean, past a norm bound that saw one value),
    a complex array, too few bytes or the transposed shape: dropped in every round, no
    crash, and the run equals the one in which that node never answered."""
    from pflower.server_app import run as run_on
    from pflower.wire import UNDECODABLE

    run = {**RUN, "algorithm": algorithm, **extra}
    bad = run_local(run, 3, client_app=tampering_app(run, spoofing(spoof)))
    assert [e.dropped for e in bad.rounds] == [{UNDECODABLE: 1}] * 2
    silent = run_on(LocalGrid(build_client_app(run), 3, silent=[0]), Config.from_run_config(run))
    assert shared_equal(bad.shared, silent.shared)


def test_robust_fedavg_drops_bytes_that_are_not_the_stated_array():
    """``RobustFedAvg`` (a plain Flower project) decodes each reply straight into its row:
    a one-value reply under the stated shape is dropped, not broadcast, and no crash."""
    from test_robust_fedavg import quickstart_app

    from pflower.strategies.robust_fedavg import RobustFedAvg
    from pflower.wire import UNDECODABLE

    honest = quickstart_app({})
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if int(context.node_config["partition-id"]) == 0:
            spoofing("one value")(0, 0, reply)
        return reply

    start = ArrayRecord({"w": Array(np.full(4, 5.0, np.float32))})
    strategy = RobustFedAvg(aggregator=make_aggregator("median"), fraction_train=1.0)
    strategy.start(grid=LocalGrid(app, 3), initial_arrays=start, num_rounds=2)
    assert strategy.dropped == {UNDECODABLE: 2}


def test_the_norm_bound_keeps_an_honest_client_next_to_a_converged_majority():
    """Gradient replies (PFLEGO's): the round's median shrinks as clients converge, and a
    client sampled again after many rounds sends a gradient hundreds of times that median
    yet no longer than the run's early ones: kept. The reference never decreases, and a
    minority cannot raise it: 1e30 and 101 x the reference are dropped."""
    from pflower.strategies.rounds import Round
    from pflower.wire import GRADIENT, ClientUpdate

    strategy = FedAvg(reply_key=GRADIENT, max_update_norm=100.0)
    strategy.num_rounds = 10
    bound = strategy.pipeline.bound  # the stage, as the strategy built it
    # ||theta|| = 1, client lr 0.05: S = 20, the first rounds' bound (K R = K S / K)
    current = {"w": np.array([1.0, 0.0, 0.0, 0.0])}
    dropped = []

    class Watched(Round):
        def drop(self, node, reason):
            dropped.append((self.number, node))

    def bounded(number, updates):
        rnd = Watched(number, reply_key=GRADIENT, weights=False, kind=GRADIENT, current=current)
        rnd.step_factor = strategy.step_factor(number)
        return bound(rnd, updates)

    def replies(*norms):  # one reply per norm: a gradient of that length along one axis
        return [
            ClientUpdate(i, {"w": np.array([n, 0.0, 0.0, 0.0])}, {"num-examples": 10.0})
            for i, n in enumerate(norms)
        ]

    # R starts at S / K = 0.2 and follows the lower median 1.8 at most 2x per round
    for rnd in range(1, 10):
        kept = bounded(rnd, replies(1.8, 2.0, 1.2, 1.9))
        assert len(kept) == 4 and not dropped
    assert bound.norm.reference == {False: pytest.approx(1.8)}
    # a converged round: median 0.01, an honest returning client sends 15 (1500 x the median)
    kept = bounded(10, replies(0.01, 0.012, 0.008, 15.0))
    assert len(kept) == 4 and not dropped
    # a minority cannot raise the reference: 1e30 and 101 x 1.8 dropped, 99 x 1.8 kept
    kept = bounded(11, replies(0.01, 0.01, 0.01, 1e30, 101 * 1.8))
    assert dropped == [(11, 3), (11, 4)] and len(kept) == 3
    kept = bounded(12, replies(0.01, 0.01, 0.01, 99 * 1.8))
    assert len(kept) == 4 and bound.norm.reference == {False: pytest.approx(1.8)}


def test_a_lie_about_num_examples_is_capped_never_dropped():
    """Node 0 claims 1e12 training examples in every round, node 1 one more in round 2
    than in round 1 (a data set that "changes"): both replies are kept, node 0 weighing
    kappa x the lower median of the first claims, node 1 its first claim; with
    ``max-num-examples`` the cap is that number."""
    run = {**RUN, "algorithm": "fedavg"}
    sizes: dict[int, int] = {}

    def inflate(pid, rnd, reply):
        metrics = reply.content["metrics"]
        sizes.setdefault(pid, int(metrics["num-examples"]))
        if pid == 0:
            metrics["num-examples"] = 10**12
        if pid == 1 and rnd == 2:
            metrics["num-examples"] += 1

    for cap, expected_liar in ((0, None), (1000, 1000.0)):
        bad = run_local({**run, "max-num-examples": cap}, NODES, tampering_app(run, inflate))
        assert not any(e.dropped for e in bad.rounds)
        trains = [e.train for e in bad.rounds if e.train]
        assert [t["applied"] for t in trains] == [NODES, NODES]
        assert [t["claims-capped"] for t in trains] == [1, 2]
        firsts = sorted([1e12] + [float(n) for p, n in sizes.items() if p != 0])
        liar = expected_liar or 10.0 * firsts[(NODES + 1) // 2 - 1]  # kappa x lower median
        honest = sum(float(n) for p, n in sizes.items() if p != 0)
        assert [t["num-examples"] for t in trains] == [liar + honest] * 2


def test_bad_evaluate_replies_are_dropped_and_the_summary_stays_sane():
    run = {**RUN, "algorithm": "fedalt"}

    def spoil(pid, rnd, reply):
        metrics = reply.content["metrics"]
        if pid == 0:
            del metrics["personal-accuracy"]
        elif pid == 1:
            metrics["personal-accuracy"] = 1e6
        elif pid == 2:
            metrics["global-accuracy"] = float("nan")

    report = run_local(run, NODES, client_app=tampering_app(run, None, spoil))
    assert report.final["clients"] == NODES - 3
    assert 0 <= report.final["personal-accuracy"] <= 1
    drops = Counter(r for e in report.rounds for r in e.dropped)
    assert drops["metric 'personal-accuracy' missing"] == 1
    assert drops["metric 'personal-accuracy' = 1000000.0 outside [0, 1]"] == 1
    assert drops["metric 'global-accuracy' is not finite"] == 1


def lying_evaluation(lie, honest_rows: dict):
    """A tamper_evaluate: records each node's honest metrics of the final round in
    ``honest_rows``, then lets ``lie(metrics)`` change node 0's."""

    def tamper(pid, rnd, reply):
        metrics = reply.content["metrics"]
        honest_rows[pid] = dict(metrics)
        if pid == 0:
            lie(metrics)

    return tamper


def pooled(rows: dict, weights: dict, key: str) -> float:
    return sum(weights[p] * rows[p][key] for p in rows) / sum(weights.values())


def test_a_low_evaluation_claim_in_a_two_node_federation_moves_accuracy_by_its_share():
    """Issue 45: in a 2-node evaluation node 0 claimed 1 test example and accuracy 1.0; the
    honest node's claim was then above 100 x the claims' lower median, dropped, and the pooled
    accuracy read 1.00 (clean .86). Now both rows are kept, the honest one weighed
    min(n, kappa x 1): the pooled accuracy is the weighted mean computed here, within the
    liar's share 1 / (kappa + 1) of the honest node's own."""
    run = {**RUN, "algorithm": "fedavg", "num-server-rounds": 1, "evaluate-every": 1}
    rows: dict = {}

    def lie(metrics):
        metrics.update({"num-examples": 1, "personal-accuracy": 1.0, "global-accuracy": 1.0})

    report = run_local(run, 2, client_app=tampering_app(run, None, lying_evaluation(lie, rows)))
    final = report.final
    assert final["clients"] == 2 and final["claims-capped"] == 1
    assert not any(e.dropped for e in report.rounds)
    weights = {0: 1.0, 1: min(rows[1]["num-examples"], 10.0 * 1)}
    lied = {0: {**rows[0], "personal-accuracy": 1.0}, 1: rows[1]}
    assert final["personal-accuracy"] == pytest.approx(pooled(lied, weights, "personal-accuracy"))
    move = final["personal-accuracy"] - rows[1]["personal-accuracy"]
    assert 0 <= move <= 1 / 11 + 1e-12


def test_a_high_evaluation_claim_moves_the_pooled_accuracy_by_its_bounded_share():
    """Issue 45: one node of ten claiming 95 x its test set with accuracy 1.0 moved the
    pooled accuracy .60 -> .96. Its claim is capped at kappa x the lower median of the
    first evaluation claims (computed here): the pooled accuracy is the mean with those
    weights, and moves from the honest pooled one by at most the liar's share, at most
    kappa m / (kappa m + sum of the honest min(n, m))."""
    run = {**RUN, "algorithm": "fedavg", "num-server-rounds": 1, "evaluate-every": 1}
    rows: dict = {}

    def lie(metrics):
        metrics["num-examples"] *= 95
        metrics["personal-accuracy"] = 1.0

    report = run_local(run, 10, client_app=tampering_app(run, None, lying_evaluation(lie, rows)))
    final = report.final
    sizes = {p: float(r["num-examples"]) for p, r in rows.items()}
    claims = sorted([95 * sizes[0], *(n for p, n in sizes.items() if p != 0)])
    m = claims[5 - 1]  # the lower median of ten
    weights = {**sizes, 0: min(95 * sizes[0], 10 * m)}
    lied = {**rows, 0: {**rows[0], "personal-accuracy": 1.0}}
    assert final["personal-accuracy"] == pytest.approx(pooled(lied, weights, "personal-accuracy"))
    honest = {p: r for p, r in rows.items() if p != 0}
    clean = pooled(honest, {p: sizes[p] for p in honest}, "personal-accuracy")
    share = weights[0] / sum(weights.values())
    assert share <= 10 * m / (10 * m + sum(min(sizes[p], m) for p in honest))
    assert 0 <= final["personal-accuracy"] - clean <= share + 1e-12
    assert final["claims-capped"] == 1


def test_a_loss_below_zero_is_dropped_and_a_huge_one_counts_at_most_c_times_an_honest_one():
    """Issue 45: one node of ten, its size truthful, moved the pooled loss from 1.50 to
    -4.95 (or anywhere it chose): a loss below 0 is now dropped and counted. A loss of 1e6
    is clipped at LOSS_CLIP x the lower median of the round's losses (computed here): the
    pooled loss rises above the honest one by at most the liar's share x LOSS_CLIP x the
    largest honest loss. In a 2-node federation, claiming 1e9 test examples too, it
    still counts for at most LOSS_CLIP x the honest node's loss."""
    from pflower.strategies.history import LOSS_CLIP

    run = {**RUN, "algorithm": "fedavg", "num-server-rounds": 1, "evaluate-every": 1}
    rows: dict = {}
    below = run_local(
        run,
        10,
        client_app=tampering_app(
            run, None, lying_evaluation(lambda m: m.update({"personal-loss": -4.95}), rows)
        ),
    )
    assert reasons(below)["metric 'personal-loss'"] == 1 and below.final["clients"] == 9
    honest = {p: r for p, r in rows.items() if p != 0}
    sizes = {p: float(r["num-examples"]) for p, r in rows.items()}
    clean = pooled(honest, {p: sizes[p] for p in honest}, "personal-loss")
    assert below.final["personal-loss"] == pytest.approx(clean)

    huge = run_local(
        run,
        10,
        client_app=tampering_app(
            run, None, lying_evaluation(lambda m: m.update({"personal-loss": 1e6}), rows)
        ),
    )
    losses = sorted([1e6, *(r["personal-loss"] for r in honest.values())])
    ceiling = LOSS_CLIP * losses[5 - 1]
    clipped = {**rows, 0: {**rows[0], "personal-loss": ceiling}}
    assert huge.final["personal-loss"] == pytest.approx(pooled(clipped, sizes, "personal-loss"))
    share = sizes[0] / sum(sizes.values())
    top = max(r["personal-loss"] for r in honest.values())
    assert huge.final["personal-loss"] - clean <= share * LOSS_CLIP * top
    assert huge.final["losses-clipped"] == 1

    rows.clear()
    two = run_local(
        run,
        2,
        client_app=tampering_app(
            run,
            None,
            lying_evaluation(lambda m: m.update({"personal-loss": 1e9, "num-examples": 1e9}), rows),
        ),
    )
    assert two.final["personal-loss"] <= LOSS_CLIP * rows[1]["personal-loss"] * (1 + 1e-9)


@pytest.mark.parametrize("nodes", [1, 2])
def test_an_evaluation_reply_without_an_accuracy_in_a_small_round_is_no_crash(nodes):
    """No majority to tell a missing metric in a 1- or 2-reply round: the reply is kept
    and the summary leaves out the statistics not every client reported (the run used to
    end in a KeyError at its final evaluation, with no results saved)."""
    run = {**RUN, "algorithm": "fedavg"}

    def omit(pid, rnd, reply):
        if pid == 0:
            del reply.content["metrics"]["personal-accuracy"]

    report = run_local(run, nodes, client_app=tampering_app(run, None, omit))
    assert report.final["clients"] == nodes
    assert "personal-accuracy" not in report.final  # hurt is then told by the losses
    assert 0 <= report.final["global-accuracy"] <= 1


def test_start_up_answers_that_are_no_counts_are_ignored_and_a_lie_is_bounded():
    """The start-up query (partition ids, PFLEGO's num-train): a NaN, fractional or
    negative partition id and an infinite num-train are no counts, ignored (``int(nan)``
    stopped the server before round 1); a num-train of 1e12 among nodes of ~300 is that
    node's first claim, and it enters PFLEGO's sum_j N_j capped at kappa x the lower median
    of the first claims (taken as it was, it scaled every honest gradient by ~1e-10)."""
    from flwr.app import MetricRecord

    from pflower.strategies.pflego import PFLEGO

    answers = {
        0: {"partition-id": float("nan"), "num-train": 1e12},
        1: {"partition-id": 1.5, "num-train": float("inf")},
        2: {"partition-id": -2, "num-train": 300},
        3: {"partition-id": 3, "num-train": 280},
        4: {"partition-id": 4, "num-train": 310},
    }
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        answer = answers[int(context.node_config["partition-id"])]
        return Message(RecordDict({"metrics": MetricRecord(answer)}), reply_to=msg)

    grid = LocalGrid(app, 5)
    node_of = {int(c.node_config["partition-id"]): n for n, c in grid.contexts.items()}
    strategy = PFLEGO()
    strategy.nodes.learn_partitions(grid, timeout=5)
    assert strategy.nodes.partition_of == {node_of[3]: 3, node_of[4]: 4}
    sizes = {node_of[0]: 1e12, node_of[2]: 300, node_of[3]: 280, node_of[4]: 310}
    assert strategy.nodes.num_train_of == sizes
    # kappa x the lower median (the 2nd smallest of 280, 300, 310, 1e12)
    assert strategy.num_train_total == 300 + 280 + 310 + 10 * 300
    run = {**RUN, "algorithm": "pflego"}  # and a run whose nodes answer so goes on
    honest = build_client_app(run)

    def lying(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if msg.metadata.message_type == MessageType.QUERY:
            pid = int(context.node_config["partition-id"])
            if pid in (0, 1):  # the lie and the infinity; node 2 answers its own size
                reply.content["metrics"]["num-train"] = answers[pid]["num-train"]
        return reply

    report = run_local(run, 3, client_app=lying)
    assert report.final["clients"] == 3 and all(not e.dropped for e in report.rounds)


@pytest.mark.parametrize("robust", [False, True])
def test_scaffold_control_deltas_meet_the_bound_and_the_robust_rule(monkeypatch, robust):
    """Scaffold's second reply record, the control delta, is applied to every client's
    every step through c. One node of 4 sending 1e30 in it (its delta honest) is dropped by
    the control delta's own norm bound in every round (it used to push c to 2.5e29, after
    which every honest update was dropped and the run stopped); and with the median, a
    control delta 30 x the honest ones, within the bound, no longer moves c beyond the
    honest nodes' scale (the rule combined the deltas only: c took a plain mean)."""
    from pflower.strategies.scaffold import Scaffold

    controls = []
    real = Scaffold.aggregate

    def recording(self, server_round, current, updates):
        out = real(self, server_round, current, updates)
        controls.append(max(float(np.abs(c).max()) for c in self.control.values()))
        return out

    monkeypatch.setattr(Scaffold, "aggregate", recording)
    run = {**RUN, "algorithm": "scaffold", "num-server-rounds": 3, "evaluate-every": 3}
    if robust:
        run.update({"robust-aggregator": "median", "robust-byzantine": 1})

    def huge(factor):
        def tamper(pid, rnd, reply):
            if pid == 0:
                record = reply.content["control-delta"]
                reply.content["control-delta"] = ArrayRecord(
                    {k: Array(factor(a.numpy())) for k, a in record.items()}
                )

        return tamper

    report = run_local(run, 4, client_app=tampering_app(run, huge(lambda a: np.full_like(a, 1e30))))
    assert reasons(report)["update norm"] == 3  # once per round: "update norm of control-delta"
    assert all("control-delta" in r for e in report.rounds for r in e.dropped)
    assert max(controls) < 1.0
    if robust:
        honest = run_local(run, 4, client_app=tampering_app(run))
        scale = max(controls[-3:])
        controls.clear()
        run_local(run, 4, client_app=tampering_app(run, huge(lambda a: 30 * a)))
        assert max(controls) < 3 * scale and all(not e.dropped for e in honest.rounds)


def test_a_client_cannot_write_megabytes_or_infinity_into_the_results():
    """A client's error text becomes a key of the drop counts: cut at REASON_CHARS. Finite
    metrics near 1e308 (they pass the finiteness check) overflow a weighted mean: the
    statistic is left out of the round's metrics and the summary, and results.json stays
    strict JSON (no ``Infinity``)."""
    import json

    from pflower.strategies.history import summarize_clients, weighted_mean_metrics
    from pflower.wire import REASON_CHARS

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise RuntimeError("x" * 10**6)

    report = run_local({**RUN, "algorithm": "fedavg", "max-failed-rounds": 0}, 2, app)
    keys = [r for e in report.rounds for r in e.dropped]
    assert keys and max(len(k) for k in keys) == REASON_CHARS
    rows = [
        {"num-examples": 10.0, "train-loss": 1.7e308, "x": 1.0},
        {"num-examples": 10.0, "train-loss": 1.7e308, "x": 3.0},
    ]
    assert weighted_mean_metrics(rows) == {"num-examples": 20.0, "x": 2.0}
    rows = [{"num-examples": 1e3, "personal-loss": 1e306, "personal-accuracy": 0.5}] * 2
    summary = summarize_clients(rows)
    assert "personal-loss" not in summary and summary["personal-accuracy"] == 0.5
    json.dumps(summary, allow_nan=False)


def test_krum_with_its_byzantine_dropped_falls_back_to_the_clip_not_a_skip():
    """Krum over 4 nodes (f = 0, the most 4 inputs tolerate): nodes 0 and 1 send NaN, 2
    replies are left (Krum needs 3). The default defence's clip takes the round (2 replies:
    their mean), every round applies, none is skipped (a skip once stopped the run after 3
    such rounds)."""
    run = {**RUN, "algorithm": "ffgg", "robust-aggregator": "krum"}
    nan = set_everywhere(np.nan)

    def two_nan(pid, rnd, reply):
        if pid < 2:
            nan(0, rnd, reply)

    report = run_local(run, 4, client_app=tampering_app(run, two_nan))
    assert [e.train["applied"] for e in report.rounds] == [2, 2]
    assert [e.train["rule-fallback"] for e in report.rounds] == [1, 1]
    assert reasons(report)["non-finite values"] == 4


def test_multi_krum_with_m_above_n_minus_f_is_refused_at_start():
    strategy = FedAvg(robust=make_aggregator("multi-krum", m=18), byzantine=3)
    with pytest.raises(ValueError, match="robust-krum-m.*m must be at most N - f = 17"):
        strategy.pipeline.combine.check_sample(20)
    FedAvg(robust=make_aggregator("multi-krum", m=17), byzantine=3).pipeline.combine.check_sample(
        20
    )
    with pytest.raises(ValueError, match="krum cannot combine 2 inputs"):
        FedAvg(robust=make_aggregator("krum")).pipeline.combine.check_sample(2)


@pytest.mark.parametrize(
    "algorithm",
    [a for a in ALGORITHMS if a not in HEAD_ALIASES and a not in ("br-ffgg", "async-ffgg")],
)
def test_no_stored_personal_value_appears_in_any_reply(algorithm):
    """Every metric of every reply against every value the clients keep in their stores
    (personal parameters, APFL's v and alpha, Scaffold's c_i, ...): none is equal, but for
    APFL's evaluation metric ``alpha``, the one stored scalar a reply reports by design
    (issue 47: alpha per client and round in the results; docs/privacy.md says so)."""
    run = {**RUN, "algorithm": algorithm, "evaluate-every": 1, "ffgg-init": "stored"}
    if algorithm == "l2gd":
        run["local-steps"] = 2
    seen: list[float] = []
    reported: list[float] = []

    def record(pid, rnd, reply):
        metrics = reply.content["metrics"]
        seen.extend(float(v) for k, v in metrics.items() if k != ALPHA)
        if algorithm == "apfl" and ALPHA in metrics:  # the one, exactly as stored
            reported.append(float(metrics[ALPHA]))

    app = tampering_app(run, record, record)
    grid = LocalGrid(app, 3)
    from pflower.server_app import run as run_on

    run_on(grid, Config.from_run_config(run))
    stored = set()
    for context in grid.contexts.values():
        for key, item in context.state.items():
            if key.startswith("pflower.") and isinstance(item, ArrayRecord):
                for array in item.values():
                    values = array.numpy().astype(np.float64).ravel()
                    stored |= {v for v in values.tolist() if v != int(v)}  # not counters
    leaked = stored & set(seen)
    assert not leaked, (algorithm, sorted(leaked)[:3])
    assert algorithm != "apfl" or reported  # the exception is real: alpha is reported


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("seed", -1, "'seed' = -1: input should be greater than or equal to 0"),
        ("lr", float("inf"), "'lr' = inf: input should be a finite number"),
        ("server-lr", float("nan"), "'server-lr' = nan"),
        ("max-update-norm", 0.5, "'max-update-norm' = 0.5"),
    ],
)
def test_degenerate_values_are_refused_at_start(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Config.from_run_config({key: value})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algorithm": "fedalt", "split": "full"}, "'split' = 'full': leaves no shared"),
        ({"algorithm": "fedsim", "split-patterns": "*"}, "'split-patterns' = '\\*'"),
        ({"algorithm": "ffgg", "split": "none"}, "'split' = 'none': leaves no personal"),
        ({"algorithm": "pflego", "split": "none"}, "leaves no personal"),
    ],
)
def test_splits_that_leave_nothing_to_federate_or_personalize_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_local({**RUN, **overrides}, 2)


def test_unreadable_disk_data_names_the_key_and_the_path(tmp_path):
    from pflower.task.data import load_client_data

    (tmp_path / "part-0.parquet").write_bytes(b"not parquet at all")
    cfg = Config.from_run_config({"dataset": f"disk:{tmp_path}", "partitioner": "iid"})
    with pytest.raises(ValueError, match=f"key 'dataset' = 'disk:{tmp_path}': cannot read"):
        load_client_data(cfg, 0, 2)


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: {k: torch.full_like(v, float("nan")) for k, v in t.items()},
        lambda t: {k: v.to(torch.int64) for k, v in t.items()},
    ],
    ids=["nan", "integer"],
)
def test_broken_personal_state_means_a_fresh_start(tmp_path, bad):
    job = job_for({"algorithm": "fedalt"})
    job.store = DirectoryStore(tmp_path)
    job.store.save("personal", bad(job.init_personal))
    assert job.restore_personal() is False
    personal = {k: t for k, t in job.model.state_dict().items() if k in job.init_personal}
    assert all(torch.equal(personal[k], job.init_personal[k]) for k in personal)


def test_a_directory_in_place_of_the_state_file_is_moved_aside(tmp_path):
    store = DirectoryStore(tmp_path)
    (tmp_path / "personal.pt").mkdir()
    assert store.load("personal") is None
    store.save("personal", {"w": torch.ones(2)})
    assert torch.equal(store.load("personal")["w"], torch.ones(2))


@pytest.mark.parametrize(
    "alpha",
    [
        {"alpha": torch.tensor([2.0], dtype=torch.float64), "steps": torch.tensor([3])},
        {"alpha": torch.tensor([0.5], dtype=torch.float32), "steps": torch.tensor([3])},
        {"alpha": torch.tensor([float("nan")], dtype=torch.float64), "steps": torch.tensor([1])},
        {"steps": torch.tensor([3])},
    ],
    ids=["out-of-range", "dtype", "nan", "missing"],
)
def test_a_broken_apfl_alpha_is_reinitialised(alpha):
    job = job_for({"algorithm": "apfl"})
    half = APFLClient()
    half.train(job, {"lr": 0.05, "apfl-round": 1})
    job.store.save(ALPHA_KEY, alpha)
    assert half._state(job) is None  # a fresh start, not a failure every round
    half.train(job, {"lr": 0.05, "apfl-round": 2})
    v, a, steps = half._state(job)
    assert 0 <= a <= 1 and job.store.load(V_KEY) is not None


def test_numpy_client_matches_arrays_by_name():
    from pflower.numpy_client import PersonalizedNumPyClient, numpy_client_app

    job = job_for({**RUN, "algorithm": "fedalt"})

    def client_fn(context):
        return PersonalizedNumPyClient(
            job.model,
            job.split,
            job.train_loader,
            job.test_loader,
            "fedalt",
            run_config={"lr": 0.05},
            state=context.state,
        )

    app = numpy_client_app(client_fn)
    shared = {k: v.detach().numpy().copy() for k, v in job.model.named_parameters()}
    names = list(job.split.shared)

    def send(arrays: dict) -> Message:
        config = ConfigRecord({"lr": 0.0, "lr-scale": 0.0, "server-round": 1})
        content = RecordDict(
            {"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}), "config": config}
        )
        msg = Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)
        context = Context(1, 1, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})
        return app(msg, context)

    straight = send({k: shared[k] for k in names})
    swapped = send({k: shared[k] for k in reversed(names)})  # same names, other order
    for k in names:  # lr 0: each name comes back with its own value, whatever the order
        np.testing.assert_array_equal(straight.content["arrays"][k].numpy(), shared[k])
        np.testing.assert_array_equal(swapped.content["arrays"][k].numpy(), shared[k])
    renamed = {("other" if k == names[0] else k): shared[k] for k in names}
    with pytest.raises(ValueError, match="split differs"):
        send(renamed)


def test_a_silent_node_is_counted_as_dropped():
    run = {**RUN, "algorithm": "fedalt"}
    from pflower.server_app import run as run_on

    grid = LocalGrid(build_client_app(run), NODES, silent=[3])
    report = run_on(grid, Config.from_run_config(run))
    # 2 training rounds + 1 evaluation (evaluate-every = 2)
    assert reasons(report)["no reply"] == 3


def test_round_deadline_follows_the_work():
    """round-timeout 0 (the default): the first exchange may take 600 s, later ones 10 x the
    slowest complete exchange so far (at least 120 s); explicit timeouts pass through."""
    from pflower.strategies.exchange import RoundDeadline

    class Recorder:
        def __init__(self):
            self.timeouts, self.answer = [], True

        def send_and_receive(self, messages, *, timeout):
            self.timeouts.append(timeout)
            return list(messages) if self.answer else []

        def get_node_ids(self):
            return [1, 2]

    grid = Recorder()
    deadline = RoundDeadline(grid)
    deadline.send_and_receive(["a", "b"])
    assert grid.timeouts[-1] == 600.0 and deadline.slowest is not None
    deadline.slowest = 30.0  # a slow round seen
    grid.answer = False  # an exchange with a dead node: does not lengthen the deadline
    deadline.send_and_receive(["a", "b"])
    assert grid.timeouts[-1] == 300.0 and deadline.slowest == 30.0
    deadline.slowest = 1.0
    deadline.send_and_receive(["a"])
    assert grid.timeouts[-1] == 120.0  # the floor
    deadline.send_and_receive(["a"], timeout=5.0)
    assert grid.timeouts[-1] == 5.0
    assert deadline.get_node_ids() == [1, 2]
    assert Config.from_run_config({}).round_timeout == 0.0


def test_a_client_answering_just_before_the_deadline_cannot_stretch_it():
    """round-timeout 0: a client that answers each round just before the deadline made the
    next deadline 10 x as long, round after round (600 s, 6 000 s, 60 000 s...). An
    exchange now counts its slowest reply up to 10 x its lower-median one (and a 1-message
    exchange after the first counts nothing), so the deadline stays near the honest work;
    an honest straggler within 10 x the median is still waited for in full."""
    from pflower.strategies.exchange import RoundDeadline

    class Timed:  # a grid whose replies arrive at given seconds (as Window times them)
        def __init__(self):
            self.timeouts, self.times = [], []

        def send_and_receive(self, messages, *, timeout):
            self.timeouts.append(timeout)
            self.arrivals = [min(t, 0.99 * timeout) for t in self.times]
            return list(messages)

    grid = Timed()
    deadline = RoundDeadline(grid, first=600.0, factor=10.0, floor=1.0)
    for _ in range(6):  # 3 honest nodes at 0.5 s, the attacker just before the deadline
        grid.times = [0.5, 0.5, 0.5, float("inf")]
        deadline.send_and_receive(["a", "b", "c", "d"])
    assert grid.timeouts == [600.0] + [50.0] * 5  # 10 x min(594, 10 x 0.5)
    grid.times = [0.5, float("inf")]  # two replies: the lower median is the honest one
    deadline.send_and_receive(["a", "b"])
    grid.times = [float("inf")]  # alone in an exchange: lengthens nothing
    deadline.send_and_receive(["a"])
    deadline.send_and_receive(["a"])
    assert grid.timeouts[-3:] == [50.0] * 3
    honest = RoundDeadline(Timed(), first=600.0, factor=10.0, floor=1.0)
    honest.grid.times = [0.5, 0.6, 4.0]  # a straggler at 8 x the median: counted in full
    honest.send_and_receive(["a", "b", "c"])
    assert honest.limit == pytest.approx(40.0)


def test_window_times_its_replies():
    """``Window.arrivals``: seconds from the exchange's start to each reply, what
    RoundDeadline reads (Flower's engines always go through a Window)."""
    from pflower.strategies.exchange import Window

    grid = LocalGrid(build_client_app({**RUN, "algorithm": "fedavg"}), 3)
    queries = [
        Message(
            RecordDict({"config": ConfigRecord({"query": "partition-id"})}), n, MessageType.QUERY
        )
        for n in grid.get_node_ids()
    ]
    window = Window(grid, None, pull_interval=0.01)
    replies = list(window.send_and_receive(queries))
    assert len(replies) == 3 and len(window.arrivals) == 3
    assert all(0 <= t < 60 for t in window.arrivals)
