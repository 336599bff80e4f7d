"""The default defence's node history (``robust-node-history``: ``AdaptiveClipping.trust``).

A node's standing is the median clip factor of its last 8 replies (rounds of 3 or more); its
trust ``min(1, standing / 0.5)`` weighs its say in the round's centre, radius and mean. The
rule is checked against a NumPy statement of it (no pflower code on the reference side:
``reference_trust`` here, ``reference_voted_clip`` the shared-vote test's statement of the
weighted clip), and attacked the way the benchmark's adaptive attacker does: three nodes of
ten that send their honest update turned around at 100 x its size in every round they are
sampled, a majority of some rounds."""

from __future__ import annotations

import numpy as np
import pytest
from test_default_defence import mean_of_clipped, reference_voted_clip, split

from pflower.strategies.combine import AdaptiveClipping, ClippedMean, clip_step
from pflower.strategies.rounds import Round

ROUNDS, LEVEL, PAD, FAR = 8, 0.5, 3, 0.25  # the statement's constants (docs/threat-model.md)


def reference_trust(records: list[list[float]]) -> np.ndarray:
    """Each node's trust from its clip factors, oldest first: min(1, median / 0.5) of the
    last 8, fewer than 3 padded with 1s to 3 (no record: 1)."""
    out = []
    for r in records:
        r = r[-ROUNDS:] + [1.0] * max(0, PAD - len(r))
        out.append(min(1.0, float(np.median(r)) / LEVEL))
    return np.array(out)


def reference_history_clip(
    X: np.ndarray, trust: np.ndarray, w: np.ndarray, iterations=3, factor: float = 1.0
):
    """The clipped mean under node history, from its statement: each row's vote its trust
    (shared votes aside: the rows here are distinct) in the geometric median, the
    centered-clipping steps and the radius (the smallest d at which the votes of the rows up
    to it reach half); each row clipped into the ball, its claim's share s_i = min(1, w_m /
    w_i) shrinking its radius (``factor`` x the weighted lower median); the mean weighing
    each clipped row by w_i x t_i, and by 0 where its reach (1 within the radius, else
    tau / d_i) is below a quarter (every row a new node's). Returns (the mean, the radius)."""
    n = len(X)
    share = np.minimum(1.0, np.sort(w)[(n + 1) // 2 - 1] / w)

    def radius(v):
        d = np.linalg.norm(X - v, axis=1)
        order = np.argsort(d)
        reached = np.cumsum(trust[order])
        return d, factor * d[order[np.nonzero(reached >= reached[-1] / 2 - 1e-12)[0][0]]]

    v = X.mean(0)
    for _ in range(20000):  # Weiszfeld's iterations, each row weighing its trust
        inv = trust / np.maximum(np.linalg.norm(X - v, axis=1), 1e-15)
        new = inv @ X / inv.sum()
        if np.linalg.norm(new - v) <= 1e-14 * (1 + np.linalg.norm(v)):
            break
        v = new
    for _ in range(iterations):
        d, tau = radius(v)
        c = np.minimum(1.0, tau / d) * trust
        v = v + c @ (X - v) / trust.sum()
    d, tau = radius(v)
    applied = v + np.minimum(1.0, tau * share / d)[:, None] * (X - v)
    reach = np.where(d <= tau, 1.0, tau / np.maximum(d, 1e-300))
    weight = w * trust * (reach >= FAR)
    return weight @ applied / weight.sum(), tau


def test_trust_is_the_median_of_the_last_eight_clip_factors_over_one_half():
    rng = np.random.default_rng(0)
    clip = AdaptiveClipping(history=True)
    records: list[list[float]] = [[] for _ in range(12)]
    for _ in range(40):
        nodes = sorted(rng.choice(12, int(rng.integers(3, 8)), replace=False).tolist())
        np.testing.assert_allclose(
            clip.trust([n + 100 for n in nodes]), reference_trust([records[n] for n in nodes])
        )
        c = np.where(
            rng.random(len(nodes)) < 0.3,
            rng.uniform(0, 0.5, len(nodes)),
            rng.uniform(0.4, 1.0, len(nodes)),
        )
        clip.last_c = c
        clip.remember([n + 100 for n in nodes])
        for n, value in zip(nodes, c):
            records[n].append(float(value))
    assert AdaptiveClipping(history=False).trust([100, 101]) is None


def test_a_round_with_distrusted_nodes_is_the_stated_weighted_rule():
    """Trust t_i multiplies each reply's vote in the geometric median, the centered-clipping
    steps, the radius (the weighted lower median) and the algorithm's mean (w_i x vote_i x
    t_i): the NumPy statement of the shared-vote rule, with t_i in the votes."""
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(3, 11))
        X = rng.normal(rng.normal(0, 1, 10), rng.uniform(0.1, 2.0), (n, 10))
        if rng.random() < 0.5:  # else a round in which no reply would be clipped
            X[: int(rng.integers(1, n))] *= 10.0 ** rng.uniform(0, 3)
        w = rng.integers(20, 200, n).astype(float)
        trust = np.where(rng.random(n) < 0.5, rng.uniform(0, 1, n), 1.0)
        trust[int(rng.integers(n))] = 1.0  # a trusted reply at least
        rule = AdaptiveClipping(copies=True, history=True)
        beta, _ = rule.coefficients("x", [split(x) for x in X], w, trust=trust)
        got = (w / w.sum()) @ X if beta is None else beta @ X
        expected, tau = reference_history_clip(X, trust, w)
        if (trust < 1).any():
            assert rule.last_distrusted == int((trust < 1).sum())
            # the strategy stops Weiszfeld's iterations at 200 (a centre beside one reply
            # converges slowly), the statement runs them out; a radius of 0 (a trusted reply
            # with half the votes) leaves rounding only
            scale = 1e-3 * tau + 1e-10 * np.abs(X).max()
            np.testing.assert_allclose(got, expected, rtol=1e-3, atol=scale)


def test_a_distrusted_node_is_weighed_where_nothing_would_be_clipped():
    """At PFLEGO's radius (2 x the lower median distance) a tight round has no reply beyond
    the radius and would be the algorithm's own mean; with a distrusted node in it, the round
    is the stated rule's, its say shrunk."""
    rng = np.random.default_rng(9)
    for _ in range(30):
        X = rng.normal(rng.normal(0, 1, 8), 0.3, (5, 8))
        w = np.ones(5)
        plain = AdaptiveClipping(2.0)
        assert plain.coefficients("x", [split(x) for x in X], w)[0] is None
        trust = np.array([1.0, 1.0, 1.0, 1.0, 0.2])
        rule = AdaptiveClipping(2.0, history=True)
        beta, _ = rule.coefficients("x", [split(x) for x in X], w, trust=trust)
        expected, tau = reference_history_clip(X, trust, w, factor=2.0)
        assert beta is not None and rule.last_distrusted == 1
        np.testing.assert_allclose(beta @ X, expected, rtol=1e-4, atol=1e-4 * tau)


def test_a_round_of_distrusted_nodes_only_is_clipped_as_without_history():
    rng = np.random.default_rng(2)
    X = rng.normal(0, 1, (5, 6))
    plain, _ = mean_of_clipped(AdaptiveClipping(), X)
    rule = AdaptiveClipping(history=True)
    beta, _ = rule.coefficients("x", [split(x) for x in X], np.ones(5), trust=np.zeros(5))
    got = np.full(5, 0.2) @ X if beta is None else beta @ X
    np.testing.assert_array_equal(got, plain)
    assert rule.last_distrusted == 0


def attack_run(history: bool, rounds: int = 80, seed: int = 3, patient: bool = False):
    """Rounds of 5 replies from 10 nodes, nodes 0-2 Byzantine: each round's honest updates
    scatter around g (a unit direction), each Byzantine sends -100 g (distinct replies: its
    own noise), or, ``patient``, its honest update in every round its kind are a minority of.
    Returns per round (Byzantine replies in it, applied update . g, its norm)."""
    rng = np.random.default_rng(seed)
    g = np.ones(16) / 4.0
    clip = AdaptiveClipping(copies=True, history=history)
    combine = ClippedMean(clip)
    out = []
    for number in range(1, rounds + 1):
        nodes = sorted(rng.choice(10, 5, replace=False).tolist())
        bad = sum(n < 3 for n in nodes)
        X = g + rng.normal(0, 0.3, (5, 16))
        for i, n in enumerate(nodes):
            if n < 3 and not (patient and bad < 3):
                X[i] = -100 * g + rng.normal(0, 0.3, 16)
        rnd = Round(number, set(nodes), kind="x")
        rnd.nodes = [n + 1000 for n in nodes]
        update = combine(rnd, [split(x) for x in X], [1.0] * 5, None, "x")
        flat = np.concatenate([update["a"].ravel(), update["b"].ravel()])
        out.append((bad, float(flat @ g), float(np.linalg.norm(flat))))
    return out


def test_a_distrusted_majority_does_not_take_its_round():
    """The adaptive attacker over 80 rounds: without history every round of 3 Byzantine
    replies of 5 applies their vector (a step of about 100 against g); with it, once each
    has been clipped in the rounds it was a minority of, such a round is placed and sized by
    the two honest replies and still moves along g."""
    without = attack_run(history=False)
    taken = [step for bad, step, _ in without if bad >= 3]
    assert taken and min(taken) < -50  # the attack works where nothing remembers
    with_history = attack_run(history=True)
    late = [(s, size) for r, (bad, s, size) in enumerate(with_history) if bad >= 3 and r >= 20]
    assert late, "the sample has majority rounds after round 20"
    assert all(step > 0 and size < 3 for step, size in late)
    minority = [size for r, (bad, _, size) in enumerate(with_history) if bad < 3 and r >= 20]
    assert max(minority) < 3  # and the rounds they are a minority of as before: bounded


def test_the_patient_attacker_is_the_stated_limit():
    """An attacker that sends honest updates whenever it is a minority keeps its trust, and
    a majority round of it is still its own: the limit docs/threat-model.md states."""
    steps = [step for bad, step, _ in attack_run(history=True, patient=True) if bad >= 3]
    assert steps and min(steps) < -50


def test_honest_rounds_are_combined_as_without_history_bit_for_bit():
    """Heterogeneous honest rounds (replies clipped to half their length or more in most
    rounds, none to less than a quarter): every node keeps its whole trust, no reply is far
    off, and the run is the run without history."""
    rng = np.random.default_rng(4)
    a, b = AdaptiveClipping(copies=True, history=True), AdaptiveClipping(copies=True)
    ca, cb = ClippedMean(a), ClippedMean(b)
    for number in range(1, 60):
        nodes = sorted(rng.choice(20, 6, replace=False).tolist())
        X = rng.normal(rng.normal(0, 1, 12), rng.uniform(0.2, 1.0), (6, 12))
        if number % 4 == 0:  # a reply now and then clipped hard
            X[int(rng.integers(6))] *= 1.5
        outs = []
        for combine in (ca, cb):
            rnd = Round(number, set(nodes), kind="x")
            rnd.nodes = list(nodes)
            update = combine(rnd, [split(x) for x in X], [1.0] * 6, None)
            outs.append(update)
        assert all(np.array_equal(outs[0][k], outs[1][k]) for k in outs[0])
        assert a.last_distrusted == 0
    assert a.trust(list(range(20))).min() == 1.0
    reach = [c for r in a.standing.values() for c in r]
    assert min(reach) < 0.5 and min(reach) >= 0.25  # some clipped hard, none far off


def test_one_entry_per_round_and_the_standing_crosses_phases():
    """A round's further record (Scaffold's control delta) adds no entry and is weighed with
    the trust the round started with; the standing earned in pre-training holds after it."""
    clip = AdaptiveClipping(history=True)
    rng = np.random.default_rng(5)
    X = np.vstack([rng.normal(1, 0.1, (4, 8)), 1e4 * np.ones((1, 8))])
    for number, kind in enumerate(["pretrain"] * 3 + ["arrays"], start=1):
        rnd = Round(number, set(range(5)), kind=kind)
        rnd.nodes = list(range(5))
        for record in (kind, "c"):
            clip_step(clip, rnd, [split(x) for x in X], [1.0] * 5, None, record)
            assert clip.last_distrusted == (0 if number <= 2 else 1)  # two of three
    assert [len(clip.standing[n]) for n in range(5)] == [4] * 5
    assert clip.trust([4])[0] == pytest.approx(reference_trust([clip.standing[4]])[0])
    assert clip.trust([4])[0] < 0.01


def test_an_honest_node_clipped_hard_once_keeps_its_trust():
    """Its first reply clipped to nothing (a round the attackers held): the record [0] counts
    beside two clean entries; a second such reply of its first three distrusts it."""
    clip = AdaptiveClipping(history=True)
    for factors, trusted in (([0.0], True), ([0.0, 1.0], True), ([0.0, 0.1], False)):
        clip.standing = {7: list(factors)}
        assert bool(clip.trust([7])[0] == 1.0) is trusted


def test_a_checkpoint_from_before_the_history_restores():
    clip = AdaptiveClipping(history=True)
    for attr in ("standing", "last_distrusted", "last_c", "history"):
        clip.__dict__.pop(attr, None)
    rnd = Round(1, set(range(3)), kind="x")
    rnd.nodes = [0, 1, 2]
    clip_step(clip, rnd, [split(np.full(4, float(i))) for i in range(3)], [1.0] * 3, None, "x")
    assert clip.trust([0]) is None  # the old object had no history: it keeps none


def test_ffgg_gives_rounds_with_a_distrusted_node_to_the_clip():
    """FFGG's default (the geometric median) cannot shrink a node's say: a round with a
    node distrusted below a trust of 0.25 is the clip's, weighed by trust (the stated rule);
    the same round without history, or with a node merely clipped often, is the geometric
    median's."""
    from test_default_defence import _updates, geometric_median

    from pflower.strategies.ffgg import FFGG

    rng = np.random.default_rng(6)
    rows = np.vstack([rng.normal(0.5, 1.0, (4, 20)), rng.normal(0.5, 1.0, (1, 20)) * 30])
    for distrusted, record in ((False, None), (True, [0.0, 0.01, 0.0]), (False, [0.4] * 3)):
        ffgg = FFGG()
        clip = ffgg.pipeline.combine.clip
        assert clip.history  # the default
        if record:  # deeply distrusted (trust 0.02), or mildly (0.8): the median's still
            clip.standing = {4: list(record)}
        rnd = Round(ffgg.pretrain_rounds + 1, reply_key=ffgg.reply_key, kind=ffgg.reply_key)
        rnd.nodes = list(range(5))
        got = ffgg.pipeline.combine(rnd, [u.tensors for u in _updates(rows)], [1.0] * 5)["w"]
        exact = rows.astype(np.float32).astype(float)
        if distrusted:
            trust = reference_trust([[], [], [], [], [0.0, 0.01, 0.0]])
            expected, _, tau = reference_voted_clip(exact, trust, np.ones(5))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * tau)
            assert rnd.distrusted[ffgg.reply_key] == 1
        else:
            np.testing.assert_allclose(got, geometric_median(exact), rtol=1e-4, atol=1e-5)


def test_a_far_off_reply_weighs_nothing_even_as_a_new_nodes_first():
    """A node's first reply has no standing; boosted (a backdoor update scaled to just
    inside the accepted norm), clipped to the radius it still pulled by tau / N, which in
    PFLEGO planted the backdoor for the rest of the run. Clipped to less than a quarter of its
    length it weighs nothing in its round's mean: the round is the honest replies' clipped
    mean; without history it is not."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        honest = rng.normal(rng.normal(0, 1, 10), rng.uniform(0.1, 1.0), (4, 10))
        boosted = honest.mean(0) + rng.normal(0, 1, 10) * 10.0 ** rng.uniform(1.5, 4)
        X = np.vstack([honest, boosted])
        w = rng.integers(20, 200, 5).astype(float)
        rule = AdaptiveClipping(history=True)
        beta, _ = rule.coefficients("x", [split(x) for x in X], w, trust=np.ones(5))
        expected, tau = reference_history_clip(X, np.ones(5), w)
        assert rule.last_far >= 1 and rule.last_c[4] < FAR
        np.testing.assert_allclose(beta @ X, expected, rtol=1e-4, atol=1e-4 * tau)
        # its reply enters only through the centre (Weiszfeld's weight 1 / distance): a
        # bounded pull, whatever its size
        assert abs(beta[4]) * np.linalg.norm(boosted) < tau
        without, _ = mean_of_clipped(AdaptiveClipping(), X, w)
        assert not np.allclose(without, beta @ X, rtol=1e-6, atol=1e-9)


def test_an_established_node_is_judged_by_its_standing_not_cut():
    """A node with 3 or more entries in its standing is off probation: a far-off reply of it
    is clipped and weighed by its trust (here whole), not cut; a new node's is cut."""
    rng = np.random.default_rng(10)
    X = np.vstack([rng.normal(0, 0.5, (4, 10)), 40 * np.ones((1, 10))])
    for record, cut in (([1.0, 1.0, 1.0], False), ([1.0, 1.0], True)):
        rule = AdaptiveClipping(history=True)
        rule.standing = {4: list(record)}
        nodes = [0, 1, 2, 3, 4]
        beta, _ = rule.coefficients(
            "x", [split(x) for x in X], np.ones(5), nodes=nodes, trust=rule.trust(nodes)
        )
        assert rule.last_c[4] < FAR and rule.last_far == int(cut)
        if cut:  # the statement's far-off rule; uncut, the plain clip's mean
            expected, tau = reference_history_clip(X, np.ones(5), np.ones(5))
            np.testing.assert_allclose(beta @ X, expected, rtol=1e-4, atol=1e-4 * tau)
        else:
            plain, _ = mean_of_clipped(AdaptiveClipping(), X)
            np.testing.assert_allclose(beta @ X, plain, rtol=1e-9, atol=1e-12)


def test_a_large_claim_is_no_mark_against_a_node():
    """A node with 10 x the lower-median claim is clipped to a tenth of the radius in every
    round (its weight's share): its reach, not that clip, is its standing, and it keeps its
    whole trust and its (bounded) weight."""
    rng = np.random.default_rng(8)
    clip = AdaptiveClipping(history=True)
    combine = ClippedMean(clip)
    for number in range(1, 30):
        X = rng.normal(rng.normal(0, 1, 12), 0.5, (5, 12))
        X[0] = X[1:].mean(0) + (X[0] - X[1:].mean(0)) * 1.2  # a little farther out
        rnd = Round(number, set(range(5)), kind="x")
        rnd.nodes = list(range(5))
        combine(rnd, [split(x) for x in X], [1000.0, 100.0, 100.0, 100.0, 100.0], None)
        assert clip.last_far == 0 and clip.last_distrusted == 0
    assert clip.trust([0])[0] == 1.0
