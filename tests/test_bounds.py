"""Bounds an adversary cannot walk around (``pflower.strategies.bound``): the update-norm
and claim bounds at every round size, a reference that grows at most ``g`` per round, the
robust rule in every phase, rule preconditions checked each round, the handshake, rounds
that apply nothing, and a node kept out by its own state brought back.

The adversaries adapt: they pick *when* (1-, 2-, 3-reply rounds, pre-training, after drops)
and *how much* (growing, just below the bound, lying from the first reply). Each test states
the guarantee it checks against numbers computed here, not by the code under test."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from helpers import answer_the_rest
from test_bad_clients import RUN  # digits, MLP, 2 rounds, every node every round

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.server_app import run as run_on
from pflower.strategies import FedAvg
from pflower.strategies.aggregators import Krum, Mean, make_aggregator
from pflower.strategies.bound import CLAIM_FACTOR, ClaimBound, UpdateNormBound, lower_median
from pflower.strategies.pipeline import ReplyPipeline
from pflower.strategies.robust_fedavg import RobustFedAvg
from pflower.strategies.rounds import Round
from pflower.strategies.server import PersonalizedStrategy
from pflower.strategies.settle import RunFailed
from pflower.testbed.local_grid import LocalGrid, run_local
from pflower.wire import ClientUpdate

#: the four kinds of reply the bounds see: weights (FedAvg), weights under server Adam
#: (FedAlt), gradients under server SGD (FFGG) and gradients under server Adam (PFLEGO)
ALGORITHMS = {
    "fedavg": {"algorithm": "fedavg"},
    "fedalt-adam": {"algorithm": "fedalt", "server-optimizer": "adam", "server-lr": 0.01},
    "ffgg": {"algorithm": "ffgg"},
    "pflego": {"algorithm": "pflego"},
}
REPLY_KEYS = ("arrays", "delta", "gradient")
#: kappa, the claim cap's multiple of the first claims' lower median (the threat model's 10)
KAPPA = 10.0
assert CLAIM_FACTOR == KAPPA


def attacking_app(overrides, attack=None, received=None, claim=None) -> ClientApp:
    """pflower's ClientApp; ``attack(pid, round, update, sent) -> update or None`` may
    replace a training reply's *update* (``theta - w`` for returned weights, else the vector)
    by another, as an adversary who knows the model it was ``sent`` and the message's config
    (``sent["config"]``) would; ``claim(pid, n)`` may
    replace its ``num-examples``. ``received`` collects (pid, round, config) of every
    training message."""
    honest = build_client_app(overrides)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        if received is not None:
            received.append((pid, rnd, dict(msg.content["config"])))
        reply = honest(msg, context)
        if reply.has_error():
            return reply
        key = next(k for k in REPLY_KEYS if k in reply.content)
        weights = key == "arrays"
        sent = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        vector = {
            k: (sent[k] - a.numpy()) if weights else a.numpy()
            for k, a in reply.content[key].items()
        }
        if claim is not None:
            metrics = reply.content["metrics"]
            metrics["num-examples"] = claim(pid, int(metrics["num-examples"]))
        sent_to_it = {**sent, "config": dict(msg.content["config"])}
        new = attack(pid, rnd, vector, sent_to_it) if attack is not None else None
        if new is not None:
            reply.content[key] = ArrayRecord(
                {
                    k: Array(((sent[k] - v) if weights else v).astype(vector[k].dtype))
                    for k, v in new.items()
                }
            )
        return reply

    return answer_the_rest(app, honest)


def scaled(factor_of_round, who=(0,)):
    """An attack: node(s) ``who`` multiply their honest update by ``factor_of_round(r)``."""

    def attack(pid, rnd, vector, sent):
        if pid in who:
            return {k: factor_of_round(rnd) * v for k, v in vector.items()}
        return None

    return attack


def drops(report, text: str) -> int:
    return sum(n for e in report.rounds for r, n in e.dropped.items() if text in r)


def norm(tensors) -> float:
    return float(np.sqrt(sum(np.square(np.asarray(v, np.float64)).sum() for v in tensors.values())))


# --- the statistics and the bounds, against numbers computed here -------------------------
def test_the_lower_median_is_honest_with_a_byzantine_minority_and_the_mean_median_is_not():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 9)
        f = rng.randint(0, n // 2)
        honest = [rng.uniform(0.1, 2.0) for _ in range(n - f)]
        byzantine = [rng.choice([0.0, 1e-12, 1e30, rng.uniform(0, 1e6)]) for _ in range(f)]
        values = honest + byzantine
        rng.shuffle(values)
        assert lower_median(values) <= max(honest)
    # the ordinary median of an even N (the mean of the middle two) is not: N = 2, f = 1
    assert float(np.median([1.0, 1e30])) > 1.0 and lower_median([1.0, 1e30]) == 1.0


def test_the_reference_grows_at_most_g_per_round_never_shrinks_and_ignores_lone_replies():
    bound = UpdateNormBound(factor=1000.0, growth=2.0)
    scale = 10.0  # S: the first rounds accept updates up to 10
    assert bound.bound([7.0], True, scale) == pytest.approx(10.0)  # a lone reply: S, unseeded
    assert bound.reference == {}
    assert bound.bound([1e30], True, scale) == pytest.approx(10.0)  # a lone liar seeds nothing
    # seeded by the first multi-reply round: max(S / K, lower median) = max(0.01, 0.6), the
    # ceil(3 / 2) = 2nd smallest of three
    assert bound.bound([0.5, 0.6, 1e30], True, scale) == pytest.approx(600.0)
    references = [bound.reference[True]]
    for _ in range(20):  # every reply huge, every round: R doubles, no faster
        bound.bound([1e30, 1e30, 1e30], True, scale)
        references.append(bound.reference[True])
    ratios = np.array(references[1:]) / np.array(references[:-1])
    assert np.allclose(ratios, 2.0)
    top = bound.reference[True]
    bound.bound([0.0, 1e-20, 1e-20], True, scale)  # tiny updates cannot pull it down
    bound.bound([1e30], True, scale)  # nor can a lone reply move it
    assert bound.reference[True] == top
    assert bound.reference.get(False) is None  # each reply kind has its own


def test_a_byzantine_minority_cannot_raise_the_reference_above_the_honest_norms():
    rng = random.Random(1)
    bound = UpdateNormBound(factor=1000.0, growth=2.0)
    largest_honest = 0.0
    for _ in range(300):  # rounds of 1 to 7 replies, up to floor(N/2) of them Byzantine
        n = rng.randint(1, 7)
        f = rng.randint(0, n // 2)
        honest = [rng.uniform(0.5, 1.5) for _ in range(n - f)]
        largest_honest = max([largest_honest, *honest])
        bound.bound(honest + [1e30] * f, False, scale=1.0)
        assert bound.reference.get(False, 0.0) <= max(1.0 / 1000, largest_honest)


def test_claims_are_capped_against_a_pool_that_liars_cannot_move_out_of_the_honest_range():
    """Rounds of 1 to 6 replies from 11 nodes, up to 5 of them liars claiming 1, 1e12 or
    anything, afresh each round (a liar may claim other than its first). Against numbers
    computed here: every weight is min(claim, the node's first claim, kappa x m), m the
    lower median of the first claims of the nodes seen so far, each once; while liars are
    fewer than half of those nodes m lies between two honest first claims, so a liar weighs
    at most kappa x the largest honest one and cannot get an honest weight capped below m;
    a round whose honest claims are all at least m gives its f liars at most
    f kappa / (f kappa + N - f) of the weights (the threat model's statement)."""
    rng = random.Random(3)
    for _ in range(300):
        bound = ClaimBound()
        liars = set(rng.sample(range(11), rng.randint(0, 5)))
        size = {n: float(rng.randint(10, 900)) for n in range(11)}
        first: dict[int, float] = {}
        for _ in range(8):
            nodes = rng.sample(range(11), rng.randint(1, 6))
            claims = {
                n: rng.choice([1.0, 1e12, rng.uniform(1, 1e6)]) if n in liars else size[n]
                for n in nodes
            }
            for n in nodes:
                first.setdefault(n, claims[n])
            pool = sorted(first.values())
            m = pool[math.ceil(len(pool) / 2) - 1]
            weights = bound.weigh(claims, {})
            for n in nodes:
                expected = min(claims[n], first[n], KAPPA * m)
                assert weights[n] == (expected, weights[n][1])
                assert bool(weights[n][1]) == (expected < claims[n])
            honest_first = [c for n, c in first.items() if n not in liars]
            if 2 * (len(first) - len(honest_first)) >= len(first):
                continue  # liars are half the nodes known or more: no statement
            assert min(honest_first) <= m <= max(honest_first)
            honest = [n for n in nodes if n not in liars]
            f = len(nodes) - len(honest)
            if all(size[n] >= m for n in honest):
                share = sum(weights[n][0] for n in nodes if n in liars)
                share /= sum(weights[n][0] for n in nodes)
                assert share <= f * KAPPA / (f * KAPPA + len(honest)) * (1 + 1e-12)


def test_max_num_examples_is_an_absolute_cap_and_start_up_claims_are_first_claims():
    bound = ClaimBound(max_num_examples=500)
    # the relative cap is off: a claim up to 500 weighs its claim, whatever the others say
    assert bound.weigh({1: 1.0, 2: 480.0}, {}) == {1: (1.0, ""), 2: (480.0, "")}
    weights = bound.weigh({3: 1e9, 1: 2.0}, {})
    assert weights[3][0] == 500.0 and weights[1][0] == 1.0  # node 1 stays at its first, 1
    assert bound.cap({}) == 500.0
    # a start-up size is the node's first claim and joins the pool (PFLEGO's sum_j N_j)
    bound = ClaimBound()
    known = {1: 100.0, 2: 120.0, 3: 1e12}
    assert bound.cap(known) == KAPPA * 120.0
    assert bound.weigh({3: 1e12, 2: 130.0}, known) == {
        3: (KAPPA * 120.0, bound.weigh({3: 1e12}, known)[3][1]),
        2: (120.0, bound.weigh({2: 130.0}, known)[2][1]),
    }


def test_multi_krum_refuses_m_above_n_minus_f_on_every_call():
    X = torch.randn(5, 3)
    with pytest.raises(ValueError, match="m must be at most N - f = 4"):
        Krum(m=5)(X, 1)
    Krum(m=4)(X, 1)  # m = N - f: fine


def test_a_round_that_cannot_tolerate_f_falls_back_to_the_clip_not_a_weaker_rule():
    """The median with f = 2 over 4 updates (it tolerates 1): not run with f = 1, not skipped
    (a skip let the f tolerated Byzantine clients stop the run), but clipped by the default
    defence around a robust centre; with a fifth update it runs with f = 2."""
    rule = FedAvg(robust=make_aggregator("median"), byzantine=2).pipeline.combine
    updates = [{"w": np.array([float(i)])} for i in (0, 1, 2, 1000)]
    rnd = Round(1)
    got = rule(rnd, updates, [1.0] * 4)["w"][0]
    assert rnd.fell_back == 1 and rnd.clipped["arrays"] >= 1 and abs(got) < 10  # not 250.75
    assert rule(Round(2), updates + [{"w": np.array([9.0])}], [1.0] * 5)["w"][0] == 2.0


# --- adaptive adversaries against whole runs ------------------------------------------------
@pytest.mark.parametrize("nodes", [1, 2, 3])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_small_rounds_are_bounded(algorithm, nodes):
    """1-, 2- and 3-reply rounds: node 0 multiplies its honest update by 1e6 (finite, so only
    the bound stands in its way). Dropped in every round, before a reference exists too;
    the run equals the one in which node 0 never answers (PFLEGO: its server Adam never
    sees the huge gradient)."""
    run = {**RUN, **ALGORITHMS[algorithm]}
    if nodes == 1:  # the only node is the attacker: no round applies a reply, a failed run
        with pytest.raises(RunFailed, match="applied no reply in any round.* update norm"):
            run_local(run, nodes, client_app=attacking_app(run, scaled(lambda r: 1e6)))
        return
    bad = run_local(run, nodes, client_app=attacking_app(run, scaled(lambda r: 1e6)))
    silent = run_on(
        LocalGrid(build_client_app(run), nodes, silent=[0]), Config.from_run_config(run)
    )
    assert drops(bad, "update norm") == 2  # once per round
    if nodes == 1 or algorithm != "pflego":  # PFLEGO's alpha counts the nodes that answer
        assert all(np.array_equal(bad.shared[k], silent.shared[k]) for k in bad.shared)
    else:
        assert max(float(np.abs(v).max()) for v in bad.shared.values()) < 10


def first_bound(sent: dict, adam_gradient: bool) -> float:
    """The bound before a reference exists, as an attacker who read checks.py computes it:
    S = max(||theta||, 0.1 sqrt(d)), over the message's lr for gradients under server Adam
    (server SGD at lr 1 otherwise, as in these runs)."""
    theta = {k: v for k, v in sent.items() if k != "config"}
    d = sum(np.asarray(v).size for v in theta.values())
    scale = max(norm(theta), 0.1 * np.sqrt(d))
    return scale / float(sent["config"]["lr"]) if adam_gradient else scale


@pytest.mark.parametrize("robust", [False, True])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_just_below_bound_attacker(monkeypatch, algorithm, robust):
    """Node 0 of 5 sends, every round, an update of 0.99 x S, the bound before a reference
    exists (it knows the rule), against the honest direction. It is accepted in round 1 (the
    bound holds what it states, no less); without a robust rule the reference never exceeds
    max(S / K, the largest honest norm) (a minority cannot raise it); with the coordinate
    median (f = 1) nothing is dropped and every coordinate of every round's aggregate lies
    within the honest updates' range."""
    gradient = algorithm in ("ffgg", "pflego")
    adam_gradient = algorithm == "pflego"

    def attack(pid, rnd, vector, sent):
        if pid != 0:
            return None
        target = 0.99 * first_bound(sent, adam_gradient)
        return {k: -target / norm(vector) * v for k, v in vector.items()}

    seen: list = []  # per round: the server's current theta, the replies kept, the aggregate
    real_pipeline, real_combine = ReplyPipeline.updates, PersonalizedStrategy.combine

    def keep_updates(self, rnd, replies):
        kept = real_pipeline(self, rnd, replies)
        seen.append({"current": rnd.current, "kept": kept, "pipeline": self})
        return kept

    def keep_combined(self, vectors, weights, center=None):
        seen[-1]["out"] = out = real_combine(self, vectors, weights, center)
        seen[-1]["strategy"] = self
        return out

    monkeypatch.setattr(ReplyPipeline, "updates", keep_updates)
    monkeypatch.setattr(PersonalizedStrategy, "combine", keep_combined)
    run = {**RUN, **ALGORITHMS[algorithm], "num-server-rounds": 3, "evaluate-every": 3}
    if robust:
        run.update({"robust-aggregator": "median", "robust-byzantine": 1})
    report = run_local(run, 5, client_app=attacking_app(run, attack))
    assert len(seen[0]["kept"]) == 5  # round 1: the attacker is inside the bound S
    if robust:
        assert drops(report, "update norm") == 0 and [len(r["kept"]) for r in seen] == [5] * 3
    strategy = seen[-1]["strategy"]
    honest_norms = []
    for r in seen:
        vectors = {
            strategy.nodes.partition_of[u.node_id]: {
                k: t if gradient else r["current"][k] - t for k, t in u.tensors.items()
            }
            for u in r["kept"]
        }
        honest = [v for p, v in vectors.items() if p != 0]
        honest_norms += [norm(v) for v in honest]
        if r is seen[0]:
            assert norm(vectors[0]) > 5 * max(norm(v) for v in honest)  # a real outlier
        if robust:
            for k, out in r["out"].items():
                low = np.min([h[k] for h in honest], axis=0)
                high = np.max([h[k] for h in honest], axis=0)
                assert np.all(out >= low - 1e-6) and np.all(out <= high + 1e-6)
    if not robust:
        first = {**seen[0]["current"], "config": {"lr": Config.from_run_config(run).lr}}
        (reference,) = strategy.pipeline.bound.norm.reference.values()
        assert reference <= max(first_bound(first, gradient) / 1000, max(honest_norms)) * (1 + 1e-9)


def test_a_growing_attacker_cannot_walk_the_reference_up(monkeypatch):
    """No robust rule; node 0's update grows x3 per round from 1 x its honest one. Each
    round the reference grows at most 2x, so the attacker is dropped once it outgrows it,
    and every round's step is at most that round's bound (a mean of updates within it)."""
    rounds = []
    real = UpdateNormBound.bound

    def recording(self, norms, kind, scale):
        out = real(self, norms, kind, scale)
        rounds.append((list(norms), out))
        return out

    monkeypatch.setattr(UpdateNormBound, "bound", recording)
    thetas = []
    real_pipeline = ReplyPipeline.updates

    def keep_theta(self, rnd, replies):
        thetas.append({k: v.copy() for k, v in rnd.current.items()})
        return real_pipeline(self, rnd, replies)

    monkeypatch.setattr(ReplyPipeline, "updates", keep_theta)
    run = {**RUN, "algorithm": "fedavg", "num-server-rounds": 10, "evaluate-every": 10}
    report = run_local(run, 5, client_app=attacking_app(run, scaled(lambda r: 3.0 ** (r - 1))))
    thetas.append(report.shared)
    bounds = [b for _, b in rounds]
    assert all(b2 <= 2 * b1 * (1 + 1e-12) for b1, b2 in zip(bounds[1:], bounds[2:]))
    for (_, bound), before, after in zip(rounds, thetas, thetas[1:]):
        step = norm({k: after[k] - before[k] for k in before})
        assert step <= bound * (1 + 1e-6)
    # the attacker (node 0: the largest norm from round 3 on) ends up dropped every round
    assert drops(report, "update norm") >= 3
    honest_medians = [sorted(n)[len(n) // 2 - 1] for n, _ in rounds]  # 4 honest of 5
    assert max(b / m for b, m in zip(bounds, honest_medians)) <= 1000 * 2


def test_a_lone_attacker_before_seeding_cannot_raise_the_scale(monkeypatch):
    """The honest nodes miss rounds 1-5 (errors: slow or crashed devices look alike); node
    0, alone in them, sends w = theta + 0.99 max(||theta||, 0.1 sqrt d) e each round (e on
    the first layer's column for pixel 0, always 0 in digits: honest training never
    notices). While the reference is unseeded every round's bound stays at most S_1 (it
    was S_t, which each accepted reply raised, and the reference seeded from it grew a
    millionfold in 20 such rounds); once the honest nodes are back the seeded reference is
    at most max(S_1 / K, the largest honest norm) (the threat model's guarantee). The
    update-norm bound alone (``robust-aggregator = "none"``); a round that drops node 0's
    reply is taken (settle.Rollback), theta back to the last good round's. The default
    defence would apply none of node 0's replies here, no other node's norm vouching for them
    (tests/test_default_defence.py)."""
    rounds = []
    real = UpdateNormBound.bound

    def recording(self, norms, kind, scale):
        out = real(self, norms, kind, scale)
        rounds.append((list(norms), scale, out, dict(self.reference)))
        return out

    monkeypatch.setattr(UpdateNormBound, "bound", recording)
    late = 5

    def attack(pid, rnd, vector, sent):
        if rnd > late:
            return None
        if pid != 0:
            raise RuntimeError("late")
        params = {k: v for k, v in sent.items() if k != "config"}
        size = sum(v.size for v in params.values())
        c = 0.99 * max(norm(params), 0.1 * np.sqrt(size))
        new = {k: np.zeros_like(v) for k, v in vector.items()}
        new["1.weight"][:, 0] = -c / np.sqrt(new["1.weight"].shape[0])  # theta - w
        return new

    run = {**RUN, "algorithm": "fedavg", "num-server-rounds": late + 3, "evaluate-every": 100}
    run["robust-aggregator"] = "none"
    run["max-failed-rounds"] = 0  # rounds of dropped replies and errors only: the run goes on
    report = run_local(run, 3, client_app=attacking_app(run, attack))
    s_1 = rounds[0][1]
    unseeded = [out for _, _, out, ref in rounds if not ref]
    assert len(unseeded) == late and max(unseeded) <= s_1 * (1 + 1e-12)
    assert max(scale for _, scale, _, _ in rounds[:late]) > 1.05 * s_1  # S_t did grow
    # each growth past S_1 is dropped, and its round (1 dropped for its size, 0 kept) undone:
    # theta goes back to the last good round's, so node 0 never builds on its own replies
    taken = [e for e in report.rounds if e.train and e.train.get("model-taken")]
    assert drops(report, "update norm") >= 2 and len(taken) == drops(report, "update norm")
    assert all(e.train["rolled-back-to"] == e.round - 1 for e in taken)
    honest = max(n for norms, *_ in rounds[late:] for n in norms)
    assert rounds[-1][3][True] <= max(s_1 / 1000, honest) * (1 + 1e-12)


@pytest.mark.parametrize("claim", [1, 10**9])
def test_a_liars_claim_in_a_two_node_federation_is_capped_and_the_honest_node_kept(claim):
    """Node 0 claims ``claim`` from its first reply on, in 2-reply rounds (FedAvg, no robust
    rule: the mean is exact). A claim of 1 used to get the honest node dropped every round
    (.86 -> .10; the claims' lower median was the liar's). Now nothing is dropped, and the
    mean weighs the updates min(claim, kappa m) and min(n, kappa m), m the smaller claim:
    the liar holds kappa / (kappa + 1) of the weight with a high claim, and with a low one
    the honest node holds that much."""
    run = {**RUN, "algorithm": "fedavg", "num-server-rounds": 1, "robust-aggregator": "none"}
    run["evaluate-every"] = 1
    updates, sizes, sent_model = {}, {}, {}

    def watch(pid, rnd, vector, sent):
        updates[pid] = vector
        sent_model.update({k: v for k, v in sent.items() if k != "config"})

    def lie(pid, n):
        sizes[pid] = n
        return claim if pid == 0 else n

    report = run_local(run, 2, client_app=attacking_app(run, watch, claim=lie))
    (entry,) = [e for e in report.rounds if e.train]
    assert not entry.dropped and entry.train["applied"] == 2 and entry.train["claims-capped"] == 1
    m = min(claim, sizes[1])
    w = {0: min(claim, KAPPA * m), 1: min(sizes[1], KAPPA * m)}
    share = w[0] / (w[0] + w[1])
    assert share == pytest.approx(KAPPA / (KAPPA + 1) if claim > sizes[1] else 1 / (KAPPA + 1))
    for k, theta in sent_model.items():
        mean = (w[0] * updates[0][k].astype(np.float64) + w[1] * updates[1][k]) / (w[0] + w[1])
        np.testing.assert_allclose(report.shared[k], theta - mean, rtol=1e-5, atol=1e-6)


def test_low_claims_do_not_seed_the_update_norm_reference(monkeypatch):
    """Issue 45: 2 of the first 4 repliers claimed 1 and sent updates at half the first
    round's bound S; the honest claims were then above 100 x the claims' lower median and
    dropped before the norm statistics, and R was seeded by the liars' norms (9 324 x the
    largest honest update's). Now a claim drops nothing, the norms' lower median sees all
    four replies, and R is at most the largest honest update norm."""
    run = {**RUN, "algorithm": "fedavg", "robust-aggregator": "none"}
    honest_norms: list[float] = []

    def attack(pid, rnd, vector, sent):
        if pid >= 2:
            honest_norms.append(norm(vector))
            return None
        target = 0.5 * first_bound(sent, False)
        return {k: target / norm(vector) * v for k, v in vector.items()}

    pipelines = []
    real = ReplyPipeline.updates

    def keep(self, rnd, replies):
        pipelines.append(self)
        return real(self, rnd, replies)

    monkeypatch.setattr(ReplyPipeline, "updates", keep)
    app = attacking_app(run, attack, claim=lambda pid, n: 1 if pid < 2 else n)
    report = run_local(run, 4, client_app=app)
    assert not any(e.dropped for e in report.rounds)
    (reference,) = pipelines[-1].bound.norm.reference.values()
    assert reference <= max(honest_norms)


def test_byzantine_clients_during_pretraining_meet_the_robust_rule():
    """Two sign-flip (x4) clients of 7 in the FedAvg pre-training rounds: with Krum (f = 2)
    the model pre-trains as the clean run does; without a rule it does not (so the test
    can tell). Every round of the run is pre-training here."""
    run = {
        **RUN,
        "algorithm": "fedalt",
        "pretrain-rounds": 4,
        "num-server-rounds": 5,
        "evaluate-every": 5,
    }
    flip = scaled(lambda r: -4.0 if r <= 4 else 1.0, who=(0, 1))
    clean = run_local(run, 7)
    robust = {**run, "robust-aggregator": "krum", "robust-byzantine": 2}
    defended = run_local(robust, 7, client_app=attacking_app(robust, flip))
    plain = {**run, "robust-aggregator": "none"}  # the mean (the default defence clips)
    attacked = run_local(plain, 7, client_app=attacking_app(plain, flip))
    accuracy = "global-accuracy"
    assert defended.final[accuracy] >= clean.final[accuracy] - 0.05
    assert attacked.final[accuracy] < clean.final[accuracy] - 0.1


def test_an_outlier_under_multi_krum_after_drops_is_never_averaged_in():
    """Multi-Krum m = 4, f = 2 over 8 nodes; node 0 sends NaN (dropped: a failure, not one of
    the f), node 1 a 50x outlier: Multi-Krum runs on the 7 kept replies with f = 2 and leaves
    the outlier out. The model ends near the one of the run where node 1 sent NaN too (its 6
    honest replies, which Krum's scores cannot take with f = 2, 2f + 3 = 7: the clip does),
    far from the plain mean's with the outlier in."""
    run = {
        **RUN,
        "algorithm": "ffgg",
        "robust-aggregator": "multi-krum",
        "robust-krum-m": 4,
        "robust-byzantine": 2,
    }

    def tamper(outlier):
        def attack(pid, rnd, vector, sent):
            if pid == 0 or (pid == 1 and not outlier):
                return {k: np.full_like(v, np.nan) for k, v in vector.items()}
            if pid == 1:
                return {k: 50.0 * v for k, v in vector.items()}
            return None

        return attack

    report = run_local(run, 8, client_app=attacking_app(run, tamper(True)))
    assert all(e.train["applied"] == 7 for e in report.rounds if e.train)
    assert not any(e.train.get("rule-fallback") for e in report.rounds if e.train)
    without = run_local(run, 8, client_app=attacking_app(run, tamper(False)))
    assert all(e.train.get("rule-fallback") == 1 for e in without.rounds if e.train)
    plain = {**run, "robust-aggregator": "none", "robust-byzantine": 0}
    mean = run_local(plain, 8, client_app=attacking_app(plain, tamper(True)))

    def apart(a, b):
        return math.sqrt(sum(float(np.sum((a[k] - b[k]).numpy() ** 2)) for k in a))

    assert apart(report.shared, without.shared) < 0.1 * apart(mean.shared, without.shared)


@pytest.mark.parametrize(
    "client_keys, reason",
    [
        ({"algorithm": "fedsim"}, "the server runs algorithm 'fedalt', this client 'fedsim'"),
        ({"seed": 1}, "client settings (fingerprint"),
    ],
)
def test_a_mismatched_client_is_counted_and_the_run_stops(client_keys, reason):
    """Server FedAlt; clients of another algorithm, or another seed: each reply is counted as
    a config mismatch naming both sides, and after max-failed-rounds the run stops."""
    run = {**RUN, "algorithm": "fedalt", "num-server-rounds": 5, "max-failed-rounds": 3}
    grid = LocalGrid(build_client_app({**run, **client_keys}), 3)
    strategy_failed = pytest.raises(RunFailed, match="3 consecutive training rounds")
    with strategy_failed as failed:
        run_on(grid, Config.from_run_config(run))
    assert "config mismatch" in str(failed.value) and reason in str(failed.value)


def test_a_run_whose_every_reply_is_dropped_stops_with_the_reasons():
    run = {**RUN, "algorithm": "fedavg", "lr": 1e30, "num-server-rounds": 4}
    run["max-failed-rounds"] = 2
    with pytest.raises(RunFailed, match="2 consecutive .* non-finite values"):
        run_local(run, 3)


@pytest.mark.parametrize("max_update_norm", [1000.0, 0.0])
def test_non_finite_replies_are_dropped_for_their_values_with_and_without_the_norm_bound(
    max_update_norm,
):
    """With the update-norm bound on, a reply's values are checked by its float64 norm (one
    pass, non-finite iff a value is); without it, by an isfinite pass. Either way a NaN and
    an Inf reply are dropped as "non-finite values", every round, and the two honest ones
    are applied (one alone would move nothing: a lone reply's norm has no other node's to be
    judged by, and a run whose model never moves fails)."""

    def poison(pid, rnd, vector, sent):
        if pid in (0, 1):
            bad = {k: v.copy() for k, v in vector.items()}
            first = next(iter(bad))
            bad[first].flat[pid * 7] = np.nan if pid == 0 else np.inf
            return bad
        return None

    run = {**RUN, "algorithm": "fedavg", "max-update-norm": max_update_norm}
    report = run_local(run, 4, client_app=attacking_app(run, poison))
    assert drops(report, "non-finite values") == 2 * 2
    assert drops(report, "update norm") == 0
    assert [e.train["applied"] for e in report.rounds if e.train] == [2, 2]


def test_a_node_dropped_for_its_values_twice_is_sent_personal_reset_and_recovers():
    """Node 0's replies are huge in rounds 1-2 (as its own poisoned state would make them):
    dropped twice, its round-3 message carries personal-reset, nobody else's does, and once
    its reply is sane again it is applied and no longer reset."""
    received: list = []
    run = {**RUN, "algorithm": "fedalt", "num-server-rounds": 5, "evaluate-every": 5}
    app = attacking_app(run, scaled(lambda r: 1e6 if r <= 2 else 1.0), received)
    report = run_local(run, 3, client_app=app)
    resets = sorted((pid, rnd) for pid, rnd, cfg in received if cfg.get("personal-reset"))
    assert resets == [(0, 3)]
    assert drops(report, "update norm") == 2
    assert [e.train["applied"] for e in report.rounds if e.train][2:] == [3, 3, 3]


def test_robust_fedavg_counts_timeouts_and_keeps_the_last_good_model():
    """A plain Flower project: one node never answers (counted), and when no round can
    aggregate (every reply bad) the result is the initial model, not an empty one."""
    from test_robust_fedavg import quickstart_app

    start = ArrayRecord({"w": Array(np.full(4, 5.0, np.float32))})
    strategy = RobustFedAvg(aggregator=make_aggregator("median"), fraction_train=1.0)
    grid = LocalGrid(quickstart_app({}), 4, silent=[3])
    strategy.start(grid=grid, initial_arrays=start, num_rounds=2, timeout=5)
    assert strategy.dropped["no reply within the round timeout"] == 2
    nothing = RobustFedAvg(aggregator=make_aggregator("median"), fraction_train=1.0)
    grid = LocalGrid(quickstart_app({i: "nan" for i in range(4)}), 4)
    result = nothing.start(grid=grid, initial_arrays=start, num_rounds=2)
    np.testing.assert_array_equal(result.arrays["w"].numpy(), np.full(4, 5.0, np.float32))


def test_robust_fedavg_bounds_a_lone_huge_reply():
    """RobustFedAvg with the mean, 2 nodes, one sending 1e6: dropped by the norm bound from
    the first round (S = ||w|| = 10), so the model follows the honest node only."""
    from test_robust_fedavg import TARGETS, quickstart_app

    start = ArrayRecord({"w": Array(np.full(4, 5.0, np.float32))})
    strategy = RobustFedAvg(aggregator=Mean(), fraction_train=1.0)
    result = strategy.start(
        grid=LocalGrid(quickstart_app({0: "huge"}), 2), initial_arrays=start, num_rounds=1
    )
    assert sum(n for r, n in strategy.dropped.items() if "update norm" in r) == 1
    # node 1 alone: w <- w - 0.5 (w - t_1), t_1 = TARGETS[1]
    np.testing.assert_allclose(result.arrays["w"].numpy(), 5.0 - 0.5 * (5.0 - TARGETS[1]))


def test_client_update_norms_in_the_bound_are_those_computed_here():
    """The norm the bound compares is the update's: ``theta - w`` for weights, the vector
    otherwise (a reply of weights equal to theta has norm 0, not ||theta||)."""
    from pflower.strategies.bound import update_norms

    current = {"a": np.array([3.0, 4.0]), "b": np.array([[12.0]])}
    same = ClientUpdate(1, {k: v.copy() for k, v in current.items()}, {"num-examples": 1})
    other = ClientUpdate(2, {"a": np.zeros(2), "b": np.zeros((1, 1))}, {"num-examples": 1})
    assert list(update_norms(current, [same, other], weights=True)) == [0.0, 13.0]
    assert list(update_norms(current, [same], weights=False)) == [13.0]


def test_update_norms_and_means_equal_an_independent_computation():
    """The server's per-reply arithmetic, which reuses float64 buffers across replies and
    layers (issue 29): each update norm against math.fsum over Python floats of the float32
    difference, and the weighted means bit for bit against the plain formulas
    ``sum_i w_i a_i`` and ``c - sum_i w_i a_i`` in float64 with normalized weights, the
    latter to float64 rounding against the mean of the updates ``sum_i w_i (c - a_i)``."""
    from pflower.strategies.bound import update_norms
    from pflower.strategies.combine import weighted_mean, weighted_mean_of_updates

    rng = np.random.default_rng(4)
    # "big": a layer of ~50 k values (the buffers' sizes), one reply's in Fortran order
    shapes = {"w": (5, 7), "b": (5,), "s": (), "big": (3, 16391)}
    current = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    replies = [
        {k: (c + rng.standard_normal(c.shape)).astype(np.float32) for k, c in current.items()}
        for _ in range(4)
    ]
    replies[1]["big"] = np.asfortranarray(replies[1]["big"])  # a client may send Fortran order
    updates = [ClientUpdate(i, r, {"num-examples": 1}) for i, r in enumerate(replies)]
    for weights in (True, False):
        got = update_norms(current, updates, weights)
        for norm, reply in zip(got, replies):
            values = [
                float(x)
                for k in shapes
                for x in np.ravel(current[k] - reply[k] if weights else reply[k])
            ]
            assert norm == pytest.approx(math.sqrt(math.fsum(x * x for x in values)), rel=1e-12)
            # and bit for bit the arithmetic before the buffers: float64 of the difference in
            # the arrays' dtype, squared and summed per layer, the layers summed in order
            vectors = [current[k] - reply[k] if weights else reply[k] for k in shapes]
            plain = np.sqrt(sum(np.square(v.astype(np.float64)).sum() for v in vectors))
            assert norm == plain
    w = [3.0, 1.0, 2.0, 5.0]
    norm_w = np.asarray(w) / sum(w)
    means = weighted_mean_of_updates(current, replies, w)
    plain = weighted_mean(replies, w)
    for k, c in current.items():
        c64 = c.astype(np.float64)
        want = sum(wi * r[k].astype(np.float64) for wi, r in zip(norm_w, replies))
        np.testing.assert_array_equal(plain[k], want)
        # the updates' mean: c - sum_i w_i a_i bit for bit, sum_i w_i (c - a_i) to rounding
        np.testing.assert_array_equal(means[k], c64 - want)
        updates = sum(wi * (c64 - r[k]) for wi, r in zip(norm_w, replies))
        np.testing.assert_allclose(means[k], updates, rtol=0, atol=1e-14)
        assert means[k].dtype == np.float64 and means[k].shape == c.shape


def test_server_sgd_at_lr_1_equals_torchs_step():
    """ServerOptimizer's FedAvg step (SGD, lr 1) is ``current - gradient`` in float64, bit for
    bit what the torch optimizer it skips computes."""
    from pflower.strategies.server_opt import ServerOptimizer

    rng = np.random.default_rng(5)
    current = {"a": rng.standard_normal((4, 3)).astype(np.float32), "s": np.float32(2.5)}
    current["s"] = np.asarray(current["s"])
    gradient = {k: rng.standard_normal(np.shape(v)) for k, v in current.items()}
    got = ServerOptimizer("sgd", 1.0).step(current, gradient)
    for k, v in current.items():
        p = torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True)
        p.grad = torch.from_numpy(gradient[k])
        torch.optim.SGD([p], lr=1.0).step()
        np.testing.assert_array_equal(got[k], p.detach().numpy())
        assert got[k].dtype == np.float64 and got[k].shape == np.shape(v)


def test_the_rule_is_checked_before_the_first_pretraining_round():
    """The robust rule runs in pre-training too, so a rule that cannot tolerate f over the
    sample is refused before the first training message, not after the pre-training."""
    run = {
        **RUN,
        "algorithm": "fedalt",
        "pretrain-rounds": 1,
        "num-server-rounds": 2,
        "robust-aggregator": "median",
        "robust-byzantine": 1,
    }
    received: list = []
    with pytest.raises(ValueError, match="median over 2 inputs tolerates at most 0"):
        run_local(run, 2, client_app=attacking_app(run, received=received))
    assert received == []


def test_a_phase_that_applied_nothing_fails_however_few_rounds_it_has():
    """Two pre-training rounds whose every reply is dropped (NaN) and a max-failed-rounds of
    3: the count never reaches 3 within the phase, and the phase's last round fails the run,
    naming the phase and the drops; with max-failed-rounds 0 (off) the run goes on."""
    run = {**RUN, "algorithm": "fedalt", "pretrain-rounds": 2, "num-server-rounds": 4}
    nan = ClientApp()
    honest = build_client_app(run)

    @nan.train()
    def train(msg, context):
        reply = honest(msg, context)
        if msg.content["config"].get("phase") == "pretrain":
            arrays = reply.content["arrays"]
            bad = {k: Array(np.full_like(a.numpy(), np.nan)) for k, a in arrays.items()}
            reply.content["arrays"] = ArrayRecord(bad)
        return reply

    @nan.evaluate()
    def evaluate(msg, context):
        return honest(msg, context)

    with pytest.raises(RunFailed, match=r"pre-training phase \(rounds 1-2\).*non-finite"):
        run_local({**run, "max-failed-rounds": 3}, 3, client_app=nan)
    report = run_local({**run, "max-failed-rounds": 0}, 3, client_app=nan)
    assert report.rounds[-1].train["applied"] > 0


def test_a_run_whose_shared_parameters_never_move_fails_at_its_last_round():
    """Clients that send back what they received (a loop that trains nothing): every reply
    is kept and applied, theta never changes: no success. Local's never move by design."""
    run = {**RUN, "algorithm": "fedavg", "num-server-rounds": 2}
    echo, honest = ClientApp(), build_client_app(run)

    @echo.train()
    def train(msg, context):
        reply = honest(msg, context)
        reply.content["arrays"] = msg.content["arrays"]
        return reply

    @echo.evaluate()
    def evaluate(msg, context):
        return honest(msg, context)

    with pytest.raises(RunFailed, match="never moved in 2 training rounds"):
        run_local(run, 3, client_app=echo)
    local = run_local({**RUN, "algorithm": "local", "num-server-rounds": 2}, 3)  # by design
    assert local.rounds[-1].train["applied"] == 3
