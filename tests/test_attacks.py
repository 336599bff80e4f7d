"""Byzantine client attacks (node config ``byzantine``) and BR-FFGG end to end."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from pflower import attacks
from pflower.config import Config, ConfigError
from pflower.local_grid import run_local


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


def test_br_ffgg_needs_a_robust_rule():
    with pytest.raises(ConfigError, match="robust-aggregator"):
        Config.from_run_config({"algorithm": "br-ffgg"})


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
    "outputs-dir": "/tmp/pflower-test-outputs",
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
    plain = run_local({**common, "algorithm": "ffgg"}, 10, node_configs=byz)
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
    byz = {i: {"byzantine": "label-flip"} for i in (0, 1)}
    report = run_local({**BASE, "algorithm": "fedavg", "split": "none"}, 5, node_configs=byz)
    assert report.final["clients"] == 5
