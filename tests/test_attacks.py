"""Byzantine client attacks (node config ``byzantine``) and BR-FFGG end to end."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import OUTPUTS_DIR

from pflower.config import Config, ConfigError
from pflower.strategies.settle import RunFailed
from pflower.testbed import attacks
from pflower.testbed.local_grid import run_local


def _record(value):
    return ArrayRecord(
        {"a": Array(np.full((2, 2), value, np.float32)), "b": Array(np.ones(3, np.float32))}
    )


def test_sign_flip_negates_the_update_for_weights_and_gradients():
    received, reply = _record(1.0), _record(0.5)  # update u = received - reply = 0.5
    out = attacks.corrupt(reply, received, True, "sign-flip", {"byzantine-scale": 2.0})
    np.testing.assert_allclose(out["a"].numpy(), 1.0 + 2.0 * 0.5)  # received - (-2 u)
    grad = attacks.corrupt(reply, received, False, "sign-flip", {})
    np.testing.assert_allclose(grad["a"].numpy(), -0.5)


@pytest.mark.parametrize("attack", ["nan", "inf"])
def test_non_finite_attacks(attack):
    out = attacks.corrupt(_record(0.5), _record(1.0), True, attack, {})
    assert not np.isfinite(out["a"].numpy()).any()


def test_wrong_shape_and_gaussian():
    out = attacks.corrupt(_record(0.5), _record(1.0), False, "wrong-shape", {})
    assert out["a"].numpy().shape == (5,)
    noisy = attacks.corrupt(_record(0.5), _record(1.0), False, "gaussian", {"byzantine-sigma": 3.0})
    assert noisy["b"].numpy().std() > 1.0 or noisy["a"].numpy().std() > 1.0


def test_unknown_attack_is_refused_with_the_key():
    with pytest.raises(ValueError, match="node config 'byzantine'"):
        attacks.attack_of({"byzantine": "alie2"})


def test_br_ffgg_needs_a_robust_rule_and_defaults_to_the_agnostic_one():
    cfg = Config.from_run_config({"algorithm": "br-ffgg"})
    assert (cfg.robust_aggregator, cfg.robust_bucket_size) == ("median", 2)
    # FFGG's default defence is the geometric median (of buckets of 2 where 5 or more
    # remain), in runs without DP, with the clip in its rounds of fewer than 5 replies
    # (tests/test_default_defence.py)
    ffgg = Config.from_run_config({"algorithm": "ffgg"})
    assert (ffgg.robust_aggregator, ffgg.robust_bucket_size) == ("geometric-median", 2)
    assert ffgg.robust_small_rounds == "clip"
    dp = Config.from_run_config({"algorithm": "ffgg", "dp": "central", "dp-noise": 1.0})
    assert dp.robust_aggregator == "adaptive-clipping" and dp.robust_small_rounds == "rule"
    # a rule the run names keeps its own keys (its small rounds: the rule's); every other
    # algorithm clips adaptively
    named = Config.from_run_config({"algorithm": "ffgg", "robust-aggregator": "trimmed-mean"})
    assert named.robust_bucket_size == 0 and named.robust_small_rounds == "rule"
    assert Config.from_run_config({"algorithm": "fedalt"}).robust_aggregator == "adaptive-clipping"
    with pytest.raises(ConfigError, match="robust-aggregator"):
        Config.from_run_config({"algorithm": "br-ffgg", "robust-aggregator": "none"})


BASE = {
    "dataset": "digits",
    "partitioner": "iid",
    "split": "head",
    "num-server-rounds": 3,
    "fraction-train": 1.0,
    "evaluate-every": 3,
    "finetune-epochs": 2,
    "local-epochs": 3,
    "lr": 0.1,
    "outputs-dir": OUTPUTS_DIR,
}


def test_br_ffgg_with_bucketed_median_resists_sign_flippers():
    """10 clients, 2 flip the sign of their (x10) gradient every round: BR-FFGG with bucketing
    + median keeps learning; plain FFGG's mean is dragged backwards."""
    byz = {i: {"byzantine": "sign-flip", "byzantine-scale": 10.0} for i in (0, 1)}
    common = {**BASE, "ffgg-init": "received", "server-lr": 0.5, "personal-epochs": 2}
    robust = run_local(
        {
            **common,
            "algorithm": "br-ffgg",
            "robust-aggregator": "median",
            "robust-bucket-size": 2,
            "robust-byzantine": 2,
        },
        10,
        node_configs=byz,
    )
    plain = run_local(
        {**common, "algorithm": "ffgg", "robust-aggregator": "none"}, 10, node_configs=byz
    )
    assert robust.final["personal-accuracy"] > plain.final["personal-accuracy"] + 0.1


def test_nan_and_wrong_shape_clients_are_dropped_and_counted():
    byz = {0: {"byzantine": "nan"}, 1: {"byzantine": "wrong-shape"}}
    report = run_local({**BASE, "algorithm": "fedalt"}, 10, node_configs=byz)
    assert report.dropped == 2 * 3
    assert all(r.train["applied"] == 8 for r in report.rounds if r.train)


def test_label_flip_trains_on_flipped_labels():
    import torch
    from torch.utils.data import TensorDataset

    flipped = attacks.flip_labels(TensorDataset(torch.zeros(3, 2), torch.tensor([0, 3, 9])), 10)
    assert flipped.tensors[1].tolist() == [9, 6, 0]
    # 3 of 5 clients learn y -> 9 - y: the global model is pulled to the flipped labels
    byz = {i: {"byzantine": "label-flip"} for i in (0, 1, 2)}
    honest = run_local(ATTACKED, 5)
    attacked = run_local(ATTACKED, 5, node_configs=byz)
    assert attacked.final["clients"] == 5
    good = honest.final["global-accuracy"]
    assert attacked.final["global-accuracy"] < good - 0.3, (good, attacked.final)


# --- omniscient attacks (ALIE, IPM), simulated on the server ---------------------------------


def test_alie_z_is_baruch_et_al_z_max():
    # Baruch et al. 2019, Sec. 3: n = 50 workers, m = 24 corrupted -> s = 2, z_max = 1.75
    # (Phi(z) = 48/50 = 0.96: Phi(1.75) = 0.9599 by any normal table).
    assert attacks.alie_z(50, 24) == pytest.approx(1.7507, abs=1e-4)
    # n = 20, f = 4: s = 7, Phi(z) = 13/20 = 0.65 -> z = 0.3853
    assert attacks.alie_z(20, 4) == pytest.approx(0.3853, abs=1e-4)
    # a Byzantine majority of a round (3 of 5: s = 0) takes s = 1, Phi(z) = 4/5 -> z = 0.8416
    assert attacks.alie_z(5, 3) == attacks.alie_z(5, 4) == pytest.approx(0.8416, abs=1e-4)


def test_alie_and_ipm_vectors_by_hand():
    import torch

    honest = torch.tensor([[1.0, 0.0], [3.0, 0.0], [5.0, 6.0]])
    # mean (3, 2), unbiased std (2, sqrt(12)); z = 1.5
    np.testing.assert_allclose(
        attacks.alie(honest, 5, 2, z=1.5).numpy(), [3 - 3.0, 2 - 1.5 * 12**0.5], rtol=1e-6
    )
    np.testing.assert_allclose(attacks.ipm(honest, 0.5).numpy(), [-1.5, -1.0])


def test_omniscient_nodes_refuse_without_the_simulation():
    assert attacks.omniscient_tag("sign-flip", {}, False) == {}
    with pytest.raises(ValueError, match="attack-simulation"):
        attacks.omniscient_tag("alie", {}, False)
    tag = attacks.omniscient_tag("ipm", {"byzantine-epsilon": 2.0}, True)
    assert (
        tag[attacks.OMNISCIENT_KEY] == attacks.OMNISCIENT["ipm"] and tag["byzantine-epsilon"] == 2
    )


def _update(node, value, tag=None, **extra):
    from pflower.wire import ClientUpdate

    metrics = {"num-examples": 10.0, **({attacks.OMNISCIENT_KEY: tag} if tag else {}), **extra}
    return ClientUpdate(node, {"w": np.asarray(value, np.float32)}, metrics)


@pytest.mark.parametrize("returns_weights", [True, False])
def test_server_replaces_tagged_replies_in_update_space(returns_weights):
    from pflower.strategies.fedavg import FedAvg
    from pflower.strategies.ffgg import FFGG
    from pflower.strategies.rounds import Round

    current = {"w": np.asarray([10.0, 10.0], np.float32)}
    rnd = Round(1, current=current, weights=returns_weights)
    honest = [[1.0, 2.0], [3.0, 2.0], [5.0, 8.0]]  # updates u_i
    sent = [(np.subtract(current["w"], u) if returns_weights else u) for u in honest]
    updates = [_update(i, v) for i, v in enumerate(sent)]
    updates += [
        _update(7, sent[0], tag=1, **{"byzantine-z": 1.0}),
        _update(8, sent[1], tag=2, **{"byzantine-epsilon": 0.5}),
    ]
    out = attacks.OmniscientAttack()(rnd, updates)  # the stage the testbed inserts
    assert [u.node_id for u in out] == [0, 1, 2, 7, 8]
    # ALIE, z = 1: mean (3, 4) - std (2, sqrt(12)); IPM: -0.5 * (3, 4)
    want = {7: [1.0, 4 - 12**0.5], 8: [-1.5, -2.0]}
    for u in out[3:]:
        got = current["w"] - u.tensors["w"] if returns_weights else u.tensors["w"]
        np.testing.assert_allclose(got, want[u.node_id], rtol=1e-5)
        assert attacks.OMNISCIENT_KEY not in u.metrics and u.tensors["w"].dtype == np.float32
    # without the simulation the server drops tagged replies rather than trust them
    plain = (FedAvg if returns_weights else FFGG)()
    assert [u.node_id for u in plain.pipeline.untagged(rnd, updates)] == [0, 1, 2]
    assert rnd.dropped == {"omniscient-attack tag without attack-simulation": 2}


ATTACKED = {
    **BASE,
    "algorithm": "fedavg",
    "split": "none",
    "partitioner": "iid",
    "fraction-train": 1.0,
    "local-epochs": 2,
    "lr": 0.3,
}


@pytest.mark.parametrize(
    "attack, strength", [("alie", {"byzantine-z": 20.0}), ("ipm", {"byzantine-epsilon": 5.0})]
)
def test_omniscient_attack_breaks_the_mean_and_the_rule_holds(attack, strength):
    """3 of 10 colluding Byzantines (strong settings): with the plain mean the model is
    ruined; coordinate median + the tolerance f = 3 stays near the honest run, and so does
    the default defence (adaptive clipping, no f to configure)."""
    byz = {i: {"byzantine": attack, **strength} for i in (0, 1, 2)}
    honest = run_local(ATTACKED, 10)
    simulated = {**ATTACKED, "attack-simulation": True}
    mean = run_local({**simulated, "robust-aggregator": "none"}, 10, node_configs=byz)
    default = run_local(simulated, 10, node_configs=byz)
    robust = {"robust-aggregator": "median", "robust-byzantine": 3, "attack-simulation": True}
    held = run_local({**ATTACKED, **robust}, 10, node_configs=byz)
    assert all(r.train["applied"] == 10 for r in mean.rounds if r.train)  # replaced, not dropped
    good, broken = honest.final["global-accuracy"], mean.final["global-accuracy"]
    assert good > 0.7  # measured 0.75
    assert broken < 0.3, broken  # measured 0.10 (ALIE), 0.01 (IPM): chance is 0.1
    # measured 0.64 (ALIE), 0.59 (IPM): the median of 7 honest clients is noisier than
    # their mean, and the attackers still shift it, but it learns
    assert held.final["global-accuracy"] > max(0.5, broken + 0.3), held.final
    # measured 0.65 (ALIE), 0.65 (IPM)
    assert default.final["global-accuracy"] > max(0.5, broken + 0.3), default.final


def test_omniscient_nodes_without_the_simulation_are_dropped_and_the_run_goes_on():
    byz = {0: {"byzantine": "ipm"}, 1: {"byzantine": "alie"}}
    refused = run_local(ATTACKED, 6, node_configs=byz)
    assert refused.dropped == 2 * 3
    assert all(r.train["applied"] == 4 for r in refused.rounds if r.train)


def test_attacks_and_delays_attach_only_through_the_experiment_client_app():
    """The production ClientApp carries no attack: a node configured as Byzantine or as a
    straggler is refused there (an error reply, dropped and counted: never a silently honest
    "attacker"); the experiment ClientApp, around the same app, attacks."""
    from pflower.client_app import build_client_app
    from pflower.testbed.client_app import experiment_client_app

    run = {**BASE, "algorithm": "fedavg", "num-server-rounds": 1, "evaluate-every": 1}
    run |= {"local-epochs": 1, "finetune-epochs": 0}
    nodes = {0: {"byzantine": "sign-flip"}, 1: {"delay-s": 0.0}}
    production = run_local(run, 4, client_app=build_client_app(run), node_configs=nodes)
    (entry,) = [r for r in production.rounds if r.train]
    assert production.dropped == 2 and entry.train["applied"] == 2
    assert all("experiment ClientApp" in reason for reason in entry.dropped), entry.dropped
    slow = {**run, "straggler-delay-s": 0.001}
    with pytest.raises(RunFailed, match="applied no reply in any round.*experiment ClientApp"):
        run_local(slow, 2, client_app=build_client_app(slow))  # every reply refused: failed
    attacked = run_local(run, 4, client_app=experiment_client_app(run), node_configs=nodes)
    assert attacked.dropped == 0 and attacked.final != production.final


# --- Min-Max and Min-Sum (Shejwalkar & Houmansadr, NDSS 2021) -------------------------------
def test_min_max_and_min_sum_gamma_by_hand():
    """Honest updates (0, 0), (2, 0), (0, 2), direction ``unit``: mu = (2/3, 2/3), p = (1,
    1) / sqrt 2, so m = t (1, 1) with t = 2/3 - gamma / sqrt 2. Min-Max: the largest
    distance, ||m - (2, 0)||^2 = 2 t^2 - 4 t + 4, at most the largest pairwise one (8): t >=
    1 - sqrt 3. Min-Sum: 6 t^2 - 8 t + 8 at most the largest row sum (12): t >= (2 -
    sqrt 10) / 3. The search stops within tau = 1e-5 of each gamma."""
    import torch

    honest = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    gammas = {
        "min-max": 2**0.5 * (2 / 3 - (1 - 3**0.5)),
        "min-sum": 2**0.5 * (2 / 3 - (2 - 10**0.5) / 3),
    }
    for objective, gamma in gammas.items():
        got = attacks.min_max_min_sum(honest, "unit", objective).numpy()
        t = 2 / 3 - gamma / 2**0.5
        np.testing.assert_allclose(got, [t, t], atol=2e-5)
        # and the found vector does satisfy the condition the search keeps
        d = ((honest.numpy() - got) ** 2).sum(axis=1)
        assert (d.max() if objective == "min-max" else d.sum()) <= (
            8 if objective == "min-max" else 12
        )
    # std and sign directions: mu - gamma sigma, mu - gamma sign(mu), on the same line
    for direction, p in (("std", honest.std(dim=0).numpy()), ("sign", np.ones(2))):
        got = attacks.min_max_min_sum(honest, direction, "min-max").numpy()
        gamma = (2 / 3 - got[0]) / p[0]
        assert gamma > 0.5
        np.testing.assert_allclose(got, 2 / 3 - gamma * p, rtol=1e-9)


def test_min_max_tag_is_replaced_on_the_server_and_directions_are_checked():
    from pflower.strategies.rounds import Round

    with pytest.raises(ValueError, match="byzantine-direction"):
        attacks.omniscient_tag("min-max", {"byzantine-direction": "up"}, True)
    tag = attacks.omniscient_tag("min-sum", {"byzantine-direction": "unit"}, True)
    current = {"w": np.zeros(2, np.float32)}
    rnd = Round(1, current=current, weights=False)
    honest = [[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]]
    updates = [_update(i, u) for i, u in enumerate(honest)] + [_update(9, honest[0], **tag)]
    (bad,) = [u for u in attacks.OmniscientAttack()(rnd, updates) if u.node_id == 9]
    t = 2 / 3 - (2 / 3 - (2 - 10**0.5) / 3)  # Min-Sum's m, above
    np.testing.assert_allclose(bad.tensors["w"], [t, t], atol=2e-5)
