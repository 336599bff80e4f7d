"""FFGG's §3.2 baselines (Scaffold, L2GD, Local GD) on the synthetic problem, each against a
NumPy re-derivation of its paper's update from the closed-form gradients, run through the
real strategy and ClientApp on a ``LocalGrid``."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord
from helpers import OUTPUTS_DIR

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.strategies import build_run_model, make_strategy, wire_split
from pflower.task import linear
from pflower.task.split import get_tensors
from pflower.testbed.local_grid import LocalGrid

M, N, DT, DW = 4, 30, 5, 3
BASE = {
    "dataset": "synthetic-linear",
    "model": "synthetic-linear",
    "linear-n": N,
    "linear-dtheta": DT,
    "linear-dw": DW,
    "batch-size": 2 * N,  # one minibatch = the whole local set: gradient descent
    "fraction-train": 1.0,
    "evaluate-every": 100,
    "finetune-epochs": 1,
    "split": "none",
}


def rows():
    """Each client's data as (X, y) in float64; the mean loss is ||X x - y||^2 / (2 * 2N)."""
    return [linear.make_client(m, n=N, d_theta=DT, d_w=DW, seed=0).rows() for m in range(M)]


def grad(xy, x):
    X, y = xy
    return X.T @ (X @ x - y) / len(y)


def run(overrides, rounds):
    """Run ``rounds`` rounds on a LocalGrid; return the final shared vector [theta, w] and
    the strategy."""
    # the exact rule: the default defence clips (tests/test_default_defence.py)
    overrides = {"robust-aggregator": "none", **overrides, "num-server-rounds": rounds}
    cfg = Config.from_run_config({**BASE, **overrides})
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    strategy = make_strategy(cfg, split.shared)
    grid = LocalGrid(build_client_app(cfg.to_flat()), M, seed=3)
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(get_tensors(model, split.shared)), num_rounds=rounds
    )
    arrays = {k: a.numpy().astype(np.float64).ravel() for k, a in result.arrays.items()}
    return np.concatenate([arrays["theta.weight"], arrays["w.weight"]]), strategy, grid


@pytest.mark.parametrize("control", ["local-steps", "full-gradient"])
def test_scaffold_matches_the_papers_update(control):
    K, lr, lr_g, R = 3, 0.5, 0.5, 3
    got, strategy, grid = run(
        {
            "algorithm": "scaffold",
            "local-steps": K,
            "lr": lr,
            "server-lr": lr_g,
            "scaffold-control": control,
        },
        R,
    )
    data = rows()
    x, c, c_i = np.zeros(DT + DW), np.zeros(DT + DW), [np.zeros(DT + DW) for _ in range(M)]
    for _ in range(R):
        dys, dcs = [], []
        for m in range(M):
            y = x.copy()
            for _ in range(K):
                y -= lr * (grad(data[m], y) - c_i[m] + c)
            new = c_i[m] - c + (x - y) / (K * lr) if control == "local-steps" else grad(data[m], x)
            dys.append(y - x)
            dcs.append(new - c_i[m])
            c_i[m] = new
        x = x + lr_g * np.mean(dys, axis=0)
        c = c + (M / M) * np.mean(dcs, axis=0)
    np.testing.assert_allclose(got, x, rtol=2e-4, atol=1e-6)
    server_c = np.concatenate([strategy.control[k].ravel() for k in ("theta.weight", "w.weight")])
    np.testing.assert_allclose(server_c, c, rtol=2e-4, atol=1e-6)
    # c_i stays in each client's own store and never in a reply
    for context in grid.contexts.values():
        assert "pflower.scaffold-control" in context.state.array_records


def test_scaffold_with_one_step_option_two_is_option_one():
    """With K = 1, (x - y) / eta = g_i(x) - c_i + c, so option II's c_i^+ is g_i(x)."""
    common = {"algorithm": "scaffold", "local-steps": 1, "lr": 0.3, "server-lr": 1.0}
    a, _, _ = run({**common, "scaffold-control": "local-steps"}, 3)
    b, _, _ = run({**common, "scaffold-control": "full-gradient"}, 3)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_l2gd_matches_coin_by_coin_iteration():
    """The grouped rounds (a averaging steps, then k local steps) equal L2GD run one coin at
    a time from the same coin sequence, with alpha, lambda, p as in Hanzely & Richtárik."""
    alpha, lam, p, R = 2.0, 0.05, 0.25, 5
    got, strategy, grid = run(
        {"algorithm": "l2gd", "lr": alpha, "l2gd-lambda": lam, "l2gd-p": p}, R
    )
    coins = np.random.default_rng([0, 2020])
    data = rows()
    xs = [np.zeros(DT + DW) for _ in range(M)]
    for _ in range(strategy.iterations):
        if coins.random() < p:
            bar = np.mean(xs, axis=0)
            xs = [x - alpha * lam / (M * p) * (x - bar) for x in xs]
        else:
            xs = [x - alpha / (M * (1 - p)) * grad(d, x) for x, d in zip(xs, data)]
    np.testing.assert_allclose(got, np.mean(xs, axis=0), rtol=2e-4, atol=1e-6)
    assert strategy.iterations > R  # several local steps per communication
    # every client keeps its own x_m (its personalized model) in its store
    stored = [
        np.concatenate(
            [
                c.state.array_records["pflower.l2gd-model"][k].numpy().ravel()
                for k in ("theta.weight", "w.weight")
            ]
        )
        for c in sorted(grid.contexts.values(), key=lambda c: c.node_config["partition-id"])
    ]
    for mine, ref in zip(stored, xs):
        np.testing.assert_allclose(mine, ref, rtol=2e-4, atol=1e-6)


def test_l2gd_refuses_an_averaging_step_beyond_x_bar():
    with pytest.raises(ValueError, match="key 'lr'"):
        run({"algorithm": "l2gd", "lr": 100.0, "l2gd-lambda": 1.0, "l2gd-p": 0.5}, 1)


def test_l2gd_needs_full_participation():
    with pytest.raises(ValueError, match="fraction-train"):
        Config.from_run_config(
            {**BASE, "algorithm": "l2gd", "fraction-train": 0.5, "local-steps": 5}
        )


def test_local_gd_is_fedavg_of_gradient_descent():
    K, lr, R = 4, 0.4, 2
    got, _, _ = run({"algorithm": "local-gd", "local-steps": K, "lr": lr}, R)
    data, x = rows(), np.zeros(DT + DW)
    for _ in range(R):
        ends = []
        for d in data:
            y = x.copy()
            for _ in range(K):
                y -= lr * grad(d, y)
            ends.append(y)
        x = np.mean(ends, axis=0)  # equal data sizes: the weighted mean is the mean
    np.testing.assert_allclose(got, x, rtol=2e-4, atol=1e-6)


def test_server_reports_the_closed_form_errors_every_round():
    """The ServerApp's evaluate_fn: ||theta - theta*||^2 and ||F(theta)||^2 from round 0."""
    from pflower.testbed.local_grid import run_local

    report = run_local(
        {
            **BASE,
            "algorithm": "ffgg",
            "split": "head",
            "ffgg-solver": "cg",
            "personal-steps": DW,
            "server-lr": 50.0,
            "num-server-rounds": 3,
            "outputs-dir": OUTPUTS_DIR,
        },
        M,
    )
    errors = [r.server["theta-error"] for r in report.rounds if "theta-error" in r.server]
    assert len(errors) == 4  # rounds 0..3
    ref = linear.Reference.build(
        [linear.make_client(m, n=N, d_theta=DT, d_w=DW, seed=0) for m in range(M)]
    )
    assert errors[0] == pytest.approx(float(ref.theta_star @ ref.theta_star))  # theta^0 = 0
    assert errors[-1] < errors[0]
