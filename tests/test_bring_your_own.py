"""A user's own problem through the front door: a regression data set saved with
``datasets.save_to_disk`` (a fixed train/test assignment, one ``client`` column), a model and
a loss imported by path, a pattern split over odd parameter names, all through the normal run
config. FFGG must land on the closed form computed here with NumPy alone (Mishchenko et al.
§3.1's operator for a loss quadratic in (theta, w)), under both weightings."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from flwr.app import Message
from user_data import D_SHARED, TEST_ROWS, M, make_clients, save_user_data
from user_models import D_PERSONAL

from pflower.client_app import build_client_app
from pflower.config import Config, ConfigError
from pflower.context_store import META
from pflower.testbed.local_grid import run_local


def operator_parts(clients, weighting: str, scale: float = 2.0):
    """F(theta) = J theta - c, in closed form. Client m's mean loss is
    (scale/2)/n_m ||P theta + Q w - t||^2; at w*(theta) = Q^+ (t - P theta) its theta-gradient
    is scale/n_m P^T Pi (P theta - t), Pi = I - Q Q^+. ``uniform``: mean over clients;
    ``num-examples``: weighted by n_m (= the gradient of the summed loss over all rows / N)."""
    Js, cs, ns = [], [], []
    for c in clients:
        P, Q, t = c["P"], c["Q"], c["t"]
        Pi = np.eye(len(t)) - Q @ np.linalg.pinv(Q)
        Js.append(scale / len(t) * P.T @ Pi @ P)
        cs.append(scale / len(t) * P.T @ Pi @ t)
        ns.append(len(t))
    weights = np.ones(len(ns)) if weighting == "uniform" else np.asarray(ns, dtype=float)
    weights = weights / weights.sum()
    J = sum(w * j for w, j in zip(weights, Js))
    c = sum(w * ci for w, ci in zip(weights, cs))
    return J, c


def ffgg_config(data_dir, tmp_path, weighting, rounds, server_lr, **extra):
    return {
        "algorithm": "ffgg",
        "dataset": f"disk:{data_dir}",
        "partitioner": "natural",
        "natural-column": "client",
        "label-column": "y",
        "model": "user_models:SharedPlusPersonal",
        "loss": "mse",
        "split-patterns": "per_user*",
        "ffgg-solver": "cg",
        "personal-steps": D_PERSONAL,  # CG is exact for a quadratic after d_w iterations
        "ffgg-init": "zeros",
        "ffgg-weighting": weighting,
        "fraction-train": 1.0,
        "batch-size": 1000,
        "server-lr": server_lr,
        "num-server-rounds": rounds,
        "evaluate-every": 10_000,
        "finetune-epochs": 1,
        "outputs-dir": str(tmp_path / "outputs"),
        "robust-aggregator": "none",  # the exact rule (the default defence clips)
        **extra,
    }


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    clients = make_clients()
    return clients, save_user_data(tmp_path_factory.mktemp("user-data") / "regression", clients)


@pytest.mark.parametrize("weighting", ["uniform", "num-examples"])
def test_ffgg_on_a_users_regression_data_lands_on_the_closed_form(user_data, tmp_path, weighting):
    clients, path = user_data
    J, c = operator_parts(clients, weighting)
    eigs = np.linalg.eigvalsh(J)
    gamma, rounds = 1.0 / eigs[-1], 0
    # enough rounds for the contraction (1 - mu/L)^R to reach 1e-11
    rounds = int(np.ceil(np.log(1e-11) / np.log(1 - eigs[0] / eigs[-1])))
    assert rounds < 400, "the generated problem should be well conditioned"
    report = run_local(ffgg_config(path, tmp_path, weighting, rounds, gamma), M)

    theta = report.shared["body_coefficients"].numpy()
    assert theta.dtype == np.float64 and set(report.shared) == {"body_coefficients"}
    reference = np.zeros(D_SHARED)
    for _ in range(rounds):
        reference = reference - gamma * (J @ reference - c)
    np.testing.assert_allclose(theta, reference, rtol=1e-10, atol=1e-12)
    theta_star = np.linalg.solve(J, c)
    np.testing.assert_allclose(theta, theta_star, rtol=1e-9, atol=1e-10)
    # the two objectives differ on unequal data: the options are not the same reading
    other = "num-examples" if weighting == "uniform" else "uniform"
    assert not np.allclose(theta_star, np.linalg.solve(*operator_parts(clients, other)))

    # regression reports loss and RMSE, no accuracy; each client's test rows are its own
    final = report.final
    assert "personal-rmse" in final and "personal-accuracy" not in final
    assert final["num-examples"] == M * TEST_ROWS
    from pflower.report import summary_table

    table = summary_table(report)
    assert "test RMSE" in table and "accuracy" not in table
    assert f"{final['personal-rmse']:.4g}" in table


def test_a_loss_of_your_own_by_import_path(user_data, tmp_path):
    """With the 1/2-squared-error loss the gradients are half those of ``mse``: one round
    is theta^1 = -gamma * (J theta^0 - c) with the operator at scale 1."""
    clients, path = user_data
    gamma = 0.3
    config = ffgg_config(
        path,
        tmp_path,
        "uniform",
        1,
        gamma,
        loss="user_models:half_squared_error",
        task="regression",
    )
    report = run_local(config, M)
    J, c = operator_parts(clients, "uniform", scale=1.0)
    expected = -gamma * (J @ np.zeros(D_SHARED) - c)
    np.testing.assert_allclose(
        report.shared["body_coefficients"].numpy(), expected, rtol=1e-11, atol=1e-13
    )


def test_fixed_assignment_by_a_test_column(tmp_path):
    """``test-column``: rows marked 'test' are the client's test split, whatever
    ``test-fraction`` says; train rows never leak into test."""
    rng = np.random.default_rng(0)
    n = 40
    ds = datasets.Dataset.from_dict(
        {
            "x": rng.normal(size=(n, 5)).tolist(),
            "y": rng.integers(0, 3, n).tolist(),
            "who": [i % 2 for i in range(n)],
            "side": ["test" if i % 5 == 0 else "train" for i in range(n)],
            "row": list(range(n)),
        }
    )
    ds.save_to_disk(tmp_path / "d")
    from pflower.task.data import client_arrays

    cfg = Config.from_run_config(
        {
            "dataset": f"disk:{tmp_path / 'd'}",
            "partitioner": "natural",
            "natural-column": "who",
            "test-column": "side",
            "feature-column": "x",
            "label-column": "y",
            "test-fraction": 0.5,
        }
    )
    for pid in range(2):
        a = client_arrays(cfg, pid, 2)
        assert len(a.x_test) == 4 and len(a.x_train) == 16  # 20 rows each, every 5th a test row
    with pytest.raises(ValueError, match="key 'test-column'"):
        bad = cfg.model_copy(update={"test_column": "nope"})
        client_arrays(bad, 0, 2)


def test_a_users_model_with_odd_names_and_a_pattern_split_keeps_its_part_home(tmp_path):
    """Through the normal config: nothing named or valued like the personal part of
    ``OddNames`` (``readout.*``) leaves a client, in any reply of a whole run."""
    overrides = {
        "algorithm": "fedalt",
        "dataset": "digits",
        "partitioner": "iid",
        "model": "user_models:OddNames",
        "split-patterns": "readout.*",
        "lr": 0.3,
        "num-server-rounds": 4,
        "fraction-train": 1.0,
        "evaluate-every": 2,
        "finetune-epochs": 1,
        "outputs-dir": str(tmp_path / "outputs"),
    }
    honest = build_client_app(overrides)
    seen: list[Message] = []
    contexts = {}

    def recording(msg, context):
        reply = honest(msg, context)
        seen.append(reply)
        contexts[context.node_id] = context
        return reply

    report = run_local(overrides, 3, client_app=recording)
    personal = {"readout.matrix", "readout.offset"}
    shared = {"encoder_kernel", "encoder_shift"}
    assert report.final["personal-accuracy"] > 0.5  # it learns
    assert set(report.shared) == shared
    assert any(r.content.array_records for r in seen), "training replies carry arrays"
    for reply in seen:
        assert not reply.has_error(), reply.error
        for record in reply.content.array_records.values():
            assert set(record) == shared, set(record)
    # each client kept its own readout, and they differ: personal values exist, at home only
    heads = [c.state.array_records["pflower.personal"] for c in contexts.values()]
    # besides the tensors, an entry records its scope (``META``: run tag, round, fingerprint)
    assert all(set(h) - {META} == personal for h in heads) and len(heads) == 3
    a, b = (h["readout.matrix"].numpy() for h in heads[:2])
    assert not np.allclose(a, b)


def test_user_choices_are_checked_at_start():
    with pytest.raises(ConfigError, match="key 'model'"):
        Config.from_run_config({"model": "not a path"})
    with pytest.raises(ConfigError, match="key 'loss'"):
        Config.from_run_config({"loss": "hinge"})
    with pytest.raises(ConfigError, match="key 'partitioner'"):
        Config.from_run_config({"dataset": "disk:/x", "loss": "mse"})  # pathological: labels
    with pytest.raises(ConfigError, match="key 'task'"):
        Config.from_run_config({"loss": "mse", "partitioner": "iid"})  # digits are classes
    from pflower.strategies import build_run_model

    cfg = Config.from_run_config({"model": "user_models:NoSuchModel", "dataset": "digits"})
    with pytest.raises(ValueError, match="key 'model'"):
        build_run_model(cfg)
    cfg = Config.from_run_config({"model": "no_such_module:Net", "dataset": "digits"})
    with pytest.raises(ValueError, match="cannot import"):
        build_run_model(cfg)


def test_a_users_model_is_built_identically_everywhere():
    from pflower.strategies import build_run_model

    cfg = Config.from_run_config({"model": "user_models:OddNames", "dataset": "digits"})
    a, b = build_run_model(cfg), build_run_model(cfg)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
