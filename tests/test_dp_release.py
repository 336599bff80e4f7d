"""Central DP as the run delivers it (issue 46 items 1, 2 and 8), end to end through the
server's own code path (``server_app.run`` on a ``LocalGrid``, pflower's ClientApp):

- **the sensitivity the accountant uses**: for every algorithm that runs under central DP,
  one client's replies replaced by adversarial ones (huge, NaN, far beyond any norm bound,
  an extreme claim, a wrong shape, an error) while the other clients' updates are fixed move
  each round's pre-noise sum by at most ``C`` from the run without that client (replace-one:
  at most ``2C`` from any other reply of it); each sum equals the one computed here from the
  bytes the clients sent, a dropped reply a zero over the planned divisor;
- **decisions local to the reply**: no update-norm reference, no claim median decides
  anything; the released outputs hold no raw norm of a shared update;
- **a secret sample**: two runs of one config sample differently, nothing a client receives
  and no output file reproduces the sample, the logs name no node; a seeded sample is
  accounted without amplification and the outputs say so.

The reference side is numpy (norms, clips, sums), ``random`` / ``SecretRandom`` replays and
dp-accounting called directly: nothing of ``pflower.strategies.privacy``."""

from __future__ import annotations

import json
import logging
import math
import random
import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from helpers import answer_the_rest, recording
from test_sampling import NODES as SAMPLING_NODES
from test_sampling import RUN as SAMPLING_RUN
from test_sampling import replayed

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.report import results as results_module
from pflower.report.terminal import privacy_line
from pflower.server_app import run
from pflower.settings import ConfigError
from pflower.strategies import ALGORITHMS
from pflower.strategies.nodes import NodeSampler, SecretRandom
from pflower.strategies.privacy import DPSettings, Mechanism
from pflower.strategies.scaffold import CONTROL_DELTA
from pflower.strategies.server_opt import ServerOptimizer
from pflower.testbed.local_grid import LocalGrid

C = 0.5  # dp-clip
NODES = 4  # all of them sampled in every round (fraction-train 1: L2GD needs it)
ADVERSARY = 0  # the partition whose replies the adversary writes
#: each honest partition's update norm, in units of C: two inside the clip, one far outside
HONEST_NORMS = {1: 0.4, 2: 2.5, 3: 0.8}
#: the adversary's reply in each round (2 pre-training rounds, then 5 of the algorithm),
#: adapting over the phases: what the update-norm bound would have dropped or what would have
#: moved its reference, a non-finite or malformed reply, an extreme claim, an error
SCHEDULE = ("far", "huge", "claim", "nan", "far", "layout", "error")
#: the algorithms central DP refuses (a robust rule; updates applied one at a time)
REFUSED = {"async-ffgg", "br-ffgg"}
#: digits, the MLP, 60 training examples a client (test_sampling's run), every node every round
RUN = {
    **SAMPLING_RUN,
    "local-epochs": 1,
    "pretrain-rounds": 2,
    "num-server-rounds": len(SCHEDULE) - 2,
    "evaluate-every": len(SCHEDULE),  # the final round only
    "fraction-train": 1.0,
    "sample-seed": 0,  # the same sample in both runs compared (everyone, here)
    "dp": "central",
    "dp-clip": C,
    "dp-noise": 0.0,  # the released mean is the pre-noise sum over m
    "console": "compact",
}


def under_central_dp() -> list[str]:
    """The algorithms that run under central DP: every registered one the config accepts."""
    accepted = []
    for name in sorted(ALGORITHMS):
        try:
            Config.from_run_config({**RUN, "algorithm": name})
        except ConfigError:
            continue
        accepted.append(name)
    return accepted


def test_every_algorithm_but_the_robust_and_asynchronous_ones_runs_under_central_dp():
    assert set(ALGORITHMS) - set(under_central_dp()) == REFUSED


@pytest.fixture
def quick(monkeypatch):
    """No plots (seconds of matplotlib per run) and no settling wait for nodes that a
    LocalGrid registers at once; everything else as the app runs."""
    for name in dir(results_module):
        if name.startswith("_plot_"):
            monkeypatch.setattr(results_module, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(
        NodeSampler,
        "wait_for_nodes",
        lambda self, grid, timeout, settle=1.0: sorted(grid.get_node_ids()),
    )


@pytest.fixture
def means(monkeypatch):
    """Every mean the mechanism releases, in float64, in the order of the rounds."""
    seen: list[dict[str, np.ndarray]] = []
    original = Mechanism.mean

    def spy(self, vectors, sampled, rng, center=None):
        out = original(self, vectors, sampled, rng, center)
        seen.append({k: np.array(v, dtype=np.float64) for k, v in out.items()})
        return out

    monkeypatch.setattr(Mechanism, "mean", spy)
    return seen


# --- the clients: fixed honest updates, one adversary ---------------------------------------
def flat(vector: dict) -> np.ndarray:
    return np.concatenate([np.ravel(vector[k]) for k in sorted(vector)])


def norm(vector: dict) -> float:
    return float(np.linalg.norm(flat(vector)))


def clip(vector: dict, bound: float) -> dict:
    n = norm(vector)
    scale = 1.0 if n <= bound else bound / n
    return {k: v * scale for k, v in vector.items()}


def name_of(record: str, array: str) -> str:
    """A reply's array as the mechanism's mean names it: Scaffold's control deltas join the
    delta's vector under ``control-delta/<name>``; every other reply has one record."""
    return f"{CONTROL_DELTA}/{array}" if record == CONTROL_DELTA else array


def fixed_update(layout: dict, pid: int, server_round: int) -> dict:
    """An honest partition's update of a round: a direction fixed by (partition, round), of
    norm ``HONEST_NORMS[pid] x C`` over all its records: the same in every run."""
    rng = np.random.default_rng([pid, server_round])
    raw = {
        name_of(k, n): rng.standard_normal(a.shape)
        for k, rec in layout.items()
        for n, a in rec.items()
    }
    return {k: v * HONEST_NORMS[pid] * C / norm(raw) for k, v in raw.items()}


def honest_sum(layout: dict, server_round: int) -> dict:
    updates = [fixed_update(layout, pid, server_round) for pid in HONEST_NORMS]
    return {k: sum(u[k] for u in updates) for k in updates[0]}


def seen_by_server(records: dict, sent: dict) -> dict:
    """The update vector the server reads from a reply's records (float64): ``sent -
    returned`` for returned weights (``arrays``), the arrays themselves otherwise."""
    out = {}
    for key, rec in records.items():
        for n, a in rec.items():
            a = np.asarray(a, dtype=np.float64)
            out[name_of(key, n)] = sent[n].astype(np.float64) - a if key == "arrays" else a
    return out


def as_records(update: dict, layout: dict, sent: dict) -> dict:
    """The reply records that carry ``update``, in the layout's dtypes."""
    out = {}
    for key, rec in layout.items():
        out[key] = {}
        for n, a in rec.items():
            u = update[name_of(key, n)]
            value = sent[n].astype(np.float64) - u if key == "arrays" else u
            out[key][n] = np.asarray(value, dtype=a.dtype)
    return out


def attack(kind: str, layout: dict, sent: dict, server_round: int) -> tuple[dict, float | None]:
    """The adversary's records and claim (None: its honest claim) for a round."""
    total = honest_sum(layout, server_round)
    aligned = {k: v / norm(total) for k, v in total.items()}  # moves the sum the most
    if kind == "far":  # 10^4 C: the update-norm bound (K = 1000) dropped it
        return as_records({k: 1e4 * C * v for k, v in aligned.items()}, layout, sent), None
    if kind == "huge":  # 1e30 in every entry
        return {
            k: {n: np.full_like(a, 1e30) for n, a in r.items()} for k, r in layout.items()
        }, None
    if kind == "claim":  # inside the clip, with a claim that outweighs everyone
        return as_records({k: 0.6 * C * v for k, v in aligned.items()}, layout, sent), 1e12
    records = as_records({k: 1e4 * C * v for k, v in aligned.items()}, layout, sent)
    key = next(iter(records))
    first = next(iter(records[key]))
    if kind == "nan":  # far, and one NaN
        records[key][first] = records[key][first].copy()
        records[key][first].flat[0] = np.nan
    elif kind == "layout":  # far, and one array one entry longer
        records[key][first] = np.zeros(records[key][first].size + 1, records[key][first].dtype)
    return records, None


def scripted_app(overrides: dict, adversary: bool, sent_log: dict) -> ClientApp:
    """pflower's ClientApp, except that each training reply carries the partition's fixed
    update (``fixed_update``), or the adversary's (``SCHEDULE``); ``sent_log[(round,
    partition)]``: the update the server reads from it (None: a reply it must drop)."""
    honest = build_client_app(overrides)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        reply = honest(msg, context)  # the algorithm's record layout, its client state
        pid = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"]["server-round"])
        sent = {n: a.numpy() for n, a in msg.content["arrays"].items()}
        layout = {
            k: {n: a.numpy() for n, a in r.items()} for k, r in reply.content.array_records.items()
        }
        claim = None
        if pid == ADVERSARY and adversary:
            kind = SCHEDULE[server_round - 1]
            if kind == "error":
                sent_log[(server_round, pid)] = None
                raise RuntimeError("the adversary's client fails")
            records, claim = attack(kind, layout, sent, server_round)
            dropped = kind in ("nan", "layout")
        else:
            records = as_records(fixed_update(layout, pid, server_round), layout, sent)
            dropped = False
        sent_log[(server_round, pid)] = None if dropped else seen_by_server(records, sent)
        for key, rec in records.items():
            reply.content[key] = ArrayRecord({n: Array(np.asarray(a)) for n, a in rec.items()})
        if claim is not None:
            (metrics,) = reply.content.metric_records.values()
            metrics["num-examples"] = claim
        return reply

    return answer_the_rest(app, honest)


def run_scripted(overrides: dict, out, adversary: bool, silent=()):
    sent_log: dict = {}
    cfg = Config.from_run_config({**overrides, "outputs-dir": str(out)})
    app = scripted_app(overrides, adversary, sent_log)
    grid = LocalGrid(app, NODES, run_config=overrides, seed=cfg.seed, silent=silent)
    return run(grid, cfg, out), sent_log, grid


@pytest.mark.parametrize("algorithm", under_central_dp())
def test_one_clients_replies_move_each_rounds_pre_noise_sum_by_at_most_the_clip(
    algorithm, quick, means, tmp_path, caplog
):
    """The adversary against the run without it (its node silent): in every round the two
    pre-noise sums (released mean x the planned m = 4, at z = 0) differ by at most C,
    exactly its clipped reply, or nothing for a reply the server must drop, and each sum is
    the one computed here from what the clients sent. The other clients' updates are the
    same in both runs, so any decision taken from the adversary's replies about theirs (a
    norm reference, a claim median, a divisor counting the kept replies) shows."""
    overrides = {**RUN, "algorithm": algorithm}
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        attacked, sent_a, grid = run_scripted(overrides, tmp_path / "a", adversary=True)
    released_a = list(means)
    means.clear()
    removed, sent_r, _ = run_scripted(
        overrides, tmp_path / "r", adversary=False, silent=[ADVERSARY]
    )
    released_r = list(means)
    m = round(RUN["fraction-train"] * NODES)  # the planned sample: the accountant's divisor
    rounds = [r for r in range(1, len(SCHEDULE) + 1) if (r, 1) in sent_a]
    # the mechanism ran once per round with shared parameters to release (Local shares none
    # after pre-training)
    if ALGORITHMS[algorithm].wire_split == "full":
        rounds = rounds[: RUN["pretrain-rounds"]]
    assert len(rounds) >= 2 and len(released_a) == len(released_r) == len(rounds)
    moved = {}
    for r, mean_a, mean_r in zip(rounds, released_a, released_r):
        # the honest sums of each run, from its own bytes (returned weights are float32: the
        # same update from another sent model rounds differently, by ~1e-8 a coordinate)
        sums = [
            {k: sum(u[k] for u in honest) for k in honest[0]}
            for honest in (
                [clip(sent[(r, pid)], C) for pid in HONEST_NORMS] for sent in (sent_a, sent_r)
            )
        ]
        bad = sent_a[(r, ADVERSARY)]
        contribution = clip(bad, C) if bad is not None else {k: 0 * v for k, v in sums[0].items()}
        expected_a = {k: sums[0][k] + contribution[k] for k in sums[0]}
        assert mean_a.keys() == expected_a.keys() == mean_r.keys()
        for k in expected_a:
            np.testing.assert_allclose(m * mean_a[k], expected_a[k], rtol=1e-7, atol=1e-9)
            np.testing.assert_allclose(m * mean_r[k], sums[1][k], rtol=1e-7, atol=1e-9)
        rounding = norm({k: sums[0][k] - sums[1][k] for k in sums[0]})
        assert rounding < 1e-4 * C
        size = norm({k: m * (mean_a[k] - mean_r[k]) for k in mean_a})
        moved[SCHEDULE[r - 1], r] = size - rounding, size + rounding
    for (kind, r), (low, size) in moved.items():
        assert size <= C * (1 + 1e-6), (kind, r, size)  # add/remove: C; replace-one: 2C
        if kind in ("far", "huge"):
            assert low > 0.999 * C, (kind, r, low)  # clipped, not dropped
        elif kind == "claim":
            assert 0.6 * C * (1 - 1e-5) < low <= size < 0.6 * C * (1 + 1e-5)  # not its claim
        else:
            assert size < 1e-4 * C, (kind, r, size)  # a dropped reply is a zero update
    # counted: the adversary's large replies applied (clipped), the malformed ones dropped
    for entry in attacked.rounds[: len(SCHEDULE)]:
        if not entry.train:
            continue
        kind = SCHEDULE[entry.round - 1]
        expected = NODES - 1 if kind in ("nan", "layout", "error") else NODES
        assert entry.train["applied"] == expected, (kind, entry.train)
    # the released outputs: no norm of an update, no reference, no clipped count
    results = json.loads((attacked.path / "results.json").read_text())
    for entry in results["rounds"]:
        assert not [k for k in entry["train"] if "norm" in k or k.startswith("clipped")]
        assert not [reason for reason in entry["dropped"] if "norm" in reason]
    # the logs name no node (under dp a line naming one tells that it was sampled)
    nodes = [str(n) for n in grid.get_node_ids()]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "dropped a reply" in text
    assert not [n for n in nodes if re.search(rf"\bnode {n}\b", text)]


# --- every decision about a reply depends on that reply alone --------------------------------
class FakeGrid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def reply_to(msg, records: dict, num_examples: float = 10.0, **metrics) -> Message:
    content = RecordDict(
        {
            k: ArrayRecord({n: Array(np.asarray(v)) for n, v in a.items()})
            for k, a in records.items()
        }
    )
    content["metrics"] = MetricRecord({"num-examples": num_examples, **metrics})
    return Message(content=content, reply_to=msg)


def private(cls, mode: str = "central", fraction: float = 1.0, noise: float = 0.0):
    settings = DPSettings(mode=mode, clip=1.0, noise=noise, seed=5)
    strategy = cls(fraction_train=fraction, privacy=settings, max_failed_rounds=0)
    strategy.num_rounds = 5
    return strategy


@pytest.mark.parametrize("algorithm", ["fedavg", "pflego"])
def test_the_server_step_takes_the_release_alone(algorithm, quick, means, tmp_path, monkeypatch):
    """Post-processing: in every round under central DP the server optimizer steps along the
    released mean itself, nothing computed from the replies beside it. PFLEGO's alpha-sum
    scales its mean by the mass (I / r_t) sum_i N_i / sum_j N_j, which the claims move (the
    adversary's claim of 1e12 in round 3): under central DP its Adam gets the release."""
    steps: list[dict[str, np.ndarray]] = []
    real = ServerOptimizer.step

    def spy(self, current, gradient):
        steps.append({k: np.array(v, dtype=np.float64) for k, v in gradient.items()})
        return real(self, current, gradient)

    monkeypatch.setattr(ServerOptimizer, "step", spy)
    # clients of unequal sizes (2 classes each, uncapped): the mass is 1 for equal ones
    unequal = {"partitioner": "pathological", "max-train-samples": 0}
    run_scripted({**RUN, **unequal, "algorithm": algorithm}, tmp_path, adversary=True)
    # the main phase's rounds (pre-training applies theta minus the release, no optimizer)
    assert len(means) == len(SCHEDULE) and len(steps) == RUN["num-server-rounds"]
    for step, release in zip(steps, means[-len(steps) :]):
        assert step.keys() == release.keys()
        for k in step:
            np.testing.assert_array_equal(step[k], release[k])


def test_under_central_dp_no_norm_reference_or_claim_median_decides_about_a_reply(task_identity):
    """FFGG (gradients), four nodes: three send tiny gradients with low claims, one an honest
    gradient 1e6 times longer with a large claim. Without DP the first round seeds the
    reference from their lower median; under central DP nothing is dropped for its norm, no
    reference exists, no claim is capped by the others' median (the large one would be,
    at 10 x it), and the round releases no norm of an update (FFGG's split diagnostic)."""
    from pflower.strategies import FFGG

    d = 50
    arrays = ArrayRecord({"w": Array(np.ones(d, np.float32))})
    for mode in ("none", "central"):
        strategy = FFGG(fraction_train=1.0, max_failed_rounds=0, robust=False, clipping=False)
        if mode == "central":
            strategy = private(FFGG)
        assert strategy.central_dp == (mode == "central")
        msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid(range(4))))
        tiny, big = np.full(d, 1e-6, np.float32), np.full(d, 1.0, np.float32)
        replies = [
            reply_to(
                msg,
                {"gradient": {"w": big if i == 3 else tiny}},
                500.0 if i == 3 else 1.0,
                **{"grad-norm": 1.0},
            )
            for i, msg in enumerate(msgs)
        ]
        _, metrics = strategy.aggregate_train(1, replies)
        if mode == "none":  # what central DP turns off: a statistic of the others decides
            assert strategy.pipeline.bound.norm.reference and metrics["claims-capped"] == 1
            assert "grad-norm-max" in metrics
            continue
        assert metrics["applied"] == 4 and metrics["dropped"] == 0
        assert strategy.pipeline.bound.norm.reference == {} and "claims-capped" not in metrics
        assert metrics["num-examples"] == 503.0  # each claim its own, capped by nothing else
        assert not [k for k in metrics if "norm" in k]


def test_one_reply_cannot_get_others_dropped_by_moving_the_norm_reference(task_identity, means):
    """The attack of issue 46: six nodes, honest gradients of norms 0.1, 0.1, 150, 150, 150
    (aligned), the adversary's tiny (1e-3) or huge (1e6). With the update-norm bound the
    adversary chose the round's lower median, 0.1 or 150, so the three honest outliers were
    dropped or kept: the pre-noise sum moved by 3.00 where the accountant assumes at most C =
    1 (2C replace-one). Under central DP all six count, and it moves by the adversary's own
    clipped difference, 1 - 1e-3 (computed here)."""
    from pflower.strategies import FFGG

    d = 50
    unit = np.full(d, 1 / math.sqrt(d))
    arrays = ArrayRecord({"w": Array(np.ones(d, np.float32))})
    sums = []
    for adversary in (1e-3, 1e6):
        strategy = private(FFGG)
        msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid(range(6))))
        sizes = {0: adversary, 1: 0.1, 2: 0.1, 3: 150.0, 4: 150.0, 5: 150.0}
        replies = [
            reply_to(
                msg,
                {"gradient": {"w": (sizes[msg.metadata.dst_node_id] * unit).astype(np.float32)}},
            )
            for msg in msgs
        ]
        _, metrics = strategy.aggregate_train(1, replies)
        assert metrics["applied"] == 6 and metrics["dropped"] == 0
        sums.append(6 * means[-1]["w"])
    clipped = [min(n, 1.0) * unit.astype(np.float32).astype(np.float64) for n in (1e-3, 1e6)]
    moved = float(np.linalg.norm(sums[1] - sums[0]))
    assert moved == pytest.approx(float(np.linalg.norm(clipped[1] - clipped[0])), rel=1e-6)
    assert moved <= 1.0


def test_central_dp_refuses_the_statistics_across_replies_of_a_rule_or_the_default_defence():
    from pflower.strategies import FedAvg
    from pflower.strategies.aggregators import CoordinateMedian
    from pflower.strategies.combine import AdaptiveClipping

    central = DPSettings(mode="central", clip=1.0, noise=1.0)
    for extra in ({"clipping": AdaptiveClipping()}, {"robust": CoordinateMedian()}):
        with pytest.raises(ValueError, match="'central'"):
            FedAvg(privacy=central, **extra)
    assert FedAvg(privacy=central).clipping is None  # the app's default under dp


def test_under_local_dp_a_replys_fate_is_the_fixed_allowance_alone(task_identity):
    """Local DP: an update is dropped if and only if it is longer than the allowance
    C (1 + z (sqrt(d) + 10)), computed here; the others' norms move no reference."""
    from pflower.strategies import FFGG

    d, z = 400, 0.5
    allowance = 1.0 * (1 + z * (math.sqrt(d) + 10))
    strategy = private(FFGG, mode="local", noise=z)
    arrays = ArrayRecord({"w": Array(np.zeros(d, np.float32))})
    unit = np.full(d, 1 / math.sqrt(d))
    for server_round, others in ((1, 1e-6), (2, 0.9 * allowance), (3, 1e-3)):
        msgs = list(
            strategy.configure_train(server_round, arrays, ConfigRecord(), FakeGrid(range(4)))
        )
        sizes = [others, others, 0.999 * allowance, 1.001 * allowance]
        replies = [
            reply_to(msg, {"gradient": {"w": (s * unit).astype(np.float32)}})
            for msg, s in zip(msgs, sizes)
        ]
        _, metrics = strategy.aggregate_train(server_round, replies)
        assert metrics["applied"] == 3 and metrics["dropped"] == 1, server_round
    assert strategy.pipeline.bound.norm.reference == {}


def test_scaffolds_control_moves_by_the_planned_sample_not_the_replies_kept(task_identity):
    """c += (1/N) sum over the sampled of dc_i (a dropped reply a zero): with 4 of 8 nodes
    sampled and one reply non-finite, c is the sum of the three kept dc_i over N = 8 (a
    factor counting the kept replies, 3/8 of their mean over 4, would scale the released c
    by how many were dropped)."""
    from pflower.strategies import Scaffold

    strategy = private(Scaffold, fraction=0.5)
    d = 6
    arrays = ArrayRecord({"w": Array(np.zeros(d, np.float32))})
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid(range(8))))
    assert len(msgs) == 4
    rng = np.random.default_rng(0)
    deltas = [rng.uniform(-0.1, 0.1, d).astype(np.float32) for _ in msgs]
    dcs = [rng.uniform(-0.1, 0.1, d).astype(np.float32) for _ in msgs]
    dcs[0] = np.full(d, np.nan, np.float32)  # dropped: a zero in the sum
    replies = [
        reply_to(msg, {"delta": {"w": delta}, CONTROL_DELTA: {"w": dc}})
        for msg, delta, dc in zip(msgs, deltas, dcs)
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["applied"] == 3
    expected = sum(dc.astype(np.float64) for dc in dcs[1:]) / 8
    np.testing.assert_allclose(strategy.control["w"], expected, rtol=1e-6)


# --- a secret sample under dp ---------------------------------------------------------------
#: test_sampling's run (8 nodes, 4 train in each of 4 rounds; the final round evaluates all)
SAMPLED = {
    **SAMPLING_RUN,
    "dp": "central",
    "dp-clip": 1.0,
    "dp-noise": 2.0,
    "console": "compact",
}


def recorded_run(overrides, out):
    """A run whose ClientApp records which partitions train in each round and every value a
    client receives (``helpers.recording``); partition 1 replies with a non-finite update
    when it trains (a drop the logs report)."""
    seen: dict[int, set[int]] = {}
    received: list = []
    record = recording(overrides, seen, received)

    def app(msg: Message, context) -> Message:
        reply = record(msg, context)
        if msg.metadata.message_type == "train" and context.node_config["partition-id"] == 1:
            arrays = reply.content["arrays"]
            reply.content["arrays"] = ArrayRecord(
                {n: Array(np.full_like(a.numpy(), np.nan)) for n, a in arrays.items()}
            )
        return reply

    cfg = Config.from_run_config({**overrides, "outputs-dir": str(out)})
    grid = LocalGrid(app, SAMPLING_NODES, run_config=overrides, seed=cfg.seed)
    return run(grid, cfg, out), seen, received, grid


def numbers_in(value) -> set[int]:
    """Every whole number in a JSON value (keys and strings included): seeds to try."""
    text = json.dumps(value)
    return {int(x) for x in re.findall(r"-?\d+", text) if len(x) < 60}


def test_under_dp_the_sample_is_secret_and_no_output_or_message_reveals_it(quick, tmp_path, caplog):
    """dp and sample-seed -1: two runs of one config sample differently; results.json holds
    no seed, no file of the run the secret one, no client receives it; no stream seeded by
    any number a client receives or an output file holds replays the sample; the logs name no
    node; the run is accounted with amplification and says so."""
    with caplog.at_level(logging.INFO, logger="flwr.pflower"):
        first, seen_a, received, grid = recorded_run(SAMPLED, tmp_path / "a")
    second, seen_b, _, _ = recorded_run(SAMPLED, tmp_path / "b")
    assert len(seen_a) == 4 and all(len(s) == 4 for s in seen_a.values())
    assert seen_a != seen_b  # (1/70)^4 that two secret samples agree
    secret = first.sampling["seed"]
    assert first.sampling["secret"] and secret != second.sampling["seed"]
    assert replayed(SecretRandom(secret), 4) == seen_a  # the seed the server drew (in memory)
    results = json.loads((first.path / "results.json").read_text())
    assert results["sampling"]["seed"] is None and results["sampling"]["secret"] is True
    assert "dp" in results["sampling"]["seed-withheld"]
    files = [p for p in first.path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"results.json", "config.json", "clients.csv"}
    for path in files:
        assert str(secret).encode() not in path.read_bytes(), path
    assert all(str(secret) not in str(value) for value in received)
    # what anyone holding the clients' messages or the outputs could try as a seed
    candidates = {int(v) for v in received if isinstance(v, (int, float)) and v == int(v)}
    for name in ("results.json", "config.json"):
        candidates |= numbers_in(json.loads((first.path / name).read_text()))
    assert {0, 1, 4, -1} <= candidates
    for x in candidates:
        assert replayed(random.Random(x), 4) != seen_a, x
        assert replayed(SecretRandom(max(x, 0)), 4) != seen_a, x
    # accounted with amplification, and the outputs say so
    assert results["privacy"]["amplified"] is True
    line = privacy_line(first)
    assert "reproducible" not in line and "replace-one" in line
    # a drop happened, and no log line names a node (sampled nodes are in every round's drops)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "dropped a reply: non-finite values" in text
    assert not [n for n in grid.get_node_ids() if re.search(rf"\bnode {n}\b", text)]
    assert "dp: results.json withholds it" in text


def test_under_dp_a_seeded_sample_is_accounted_without_amplification(quick, tmp_path):
    """sample-seed 3: the sample is Random(3)'s (anyone can replay it from the run config),
    so the run is accounted per client, the Gaussian at z / 2 over the rounds of the most
    sampled one (dp-accounting here), and results.json and the summary say so."""
    report, seen, _, _ = recorded_run({**SAMPLED, "sample-seed": 3}, tmp_path)
    assert seen == replayed(random.Random(3), 4)
    counts: dict[int, int] = {}
    for nodes in seen.values():
        for pid in nodes:
            counts[pid] = counts.get(pid, 0) + 1
    most = max(counts.values())
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    z, delta = SAMPLED["dp-noise"], 1e-5
    gaussian = dp_accounting.dp_event.GaussianDpEvent(z / 2)
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    exact = []
    for accountant in (RdpAccountant(neighboring_relation=relation), PLDAccountant(relation)):
        accountant.compose(gaussian, most)
        exact.append(accountant.get_epsilon(delta))
    spent = report.privacy
    assert spent["amplified"] is False and "reproducible" in spent["sampling"]
    assert spent["epsilon"] == pytest.approx(min(exact), rel=1e-2)
    assert "no amplification" in privacy_line(report)
    results = json.loads((report.path / "results.json").read_text())
    assert results["sampling"] == {"seed": 3, "secret": False, "generator": "random.Random"}
    # the same config with a secret sample is amplified: a smaller epsilon
    secret = recorded_run(SAMPLED, tmp_path / "secret")[0].privacy
    assert secret["amplified"] is True and secret["epsilon"] < spent["epsilon"]
