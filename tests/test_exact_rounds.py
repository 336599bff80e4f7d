"""Whole rounds of FedAlt, FedSim, Local FFGG, Local GD, Scaffold and L2GD, run through the
real strategies and ClientApp (``LocalGrid``) on a user's float64 regression problem, against
the papers' updates re-derived here in NumPy from the data alone. Partial participation
(r < N) and unequal client sizes wherever the algorithm allows them, so that the factors
that are 1 at full participation (data-size weights, Scaffold's |S|/N) are visible. One
minibatch = the whole local set, so every local step is a deterministic gradient step.

Client m's mean loss is f_m(z) = ||X_m z - t_m||^2 / n_m with z = [theta, w] (loss "mse"),
so grad f_m(z) = 2 X_m^T (X_m z - t_m) / n_m.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord
from user_data import D_SHARED, M, make_clients, save_user_data
from user_models import D_PERSONAL

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.context_store import open_store
from pflower.strategies import build_run_model, make_strategy, wire_split
from pflower.task.split import get_tensors
from pflower.testbed.local_grid import LocalGrid

TOL = {"rtol": 1e-11, "atol": 1e-13}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    clients = make_clients(seed=21)
    path = save_user_data(tmp_path_factory.mktemp("rounds") / "regression", clients)
    X = [np.hstack([c["P"], c["Q"]]) for c in clients]
    return path, X, [c["t"] for c in clients]


def grad(X, t, z):
    return 2.0 * X.T @ (X @ z - t) / len(t)


def run(path, overrides, rounds):
    """Run on a LocalGrid; returns (final shared z or theta, {round: sampled pids}, grid)."""
    config = {
        "dataset": f"disk:{path}",
        "partitioner": "natural",
        "natural-column": "client",
        "label-column": "y",
        "model": "user_models:SharedPlusPersonal",
        "loss": "mse",
        "batch-size": 1000,
        "evaluate-every": 10_000,
        "finetune-epochs": 0,
        "num-server-rounds": rounds,
        "robust-aggregator": "none",  # the exact rule (the default defence clips)
        **overrides,
    }
    cfg = Config.from_run_config(config)
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    honest, sampled = build_client_app(config), {}

    def recording(msg, context):
        if msg.metadata.message_type == "train":
            r = int(msg.content["config"]["server-round"])
            sampled.setdefault(r, []).append(int(context.node_config["partition-id"]))
        return honest(msg, context)

    grid = LocalGrid(recording, M, seed=5)
    strategy = make_strategy(cfg, split.shared)
    start = ArrayRecord(get_tensors(model, split.shared))
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=rounds)
    shared = np.concatenate([result.arrays[n].numpy().ravel() for n in split.shared])
    assert shared.dtype == np.float64
    return shared, {r: sorted(p) for r, p in sampled.items()}, grid, strategy


def stored(grid, key):
    out = {}
    for context in grid.contexts.values():
        tensors = open_store(context.state, {}).load(key)
        if tensors is not None:
            out[int(context.node_config["partition-id"])] = {
                k: v.numpy().ravel() for k, v in tensors.items()
            }
    return out


PERSONAL = {"split-patterns": "per_user*"}
TH, W = slice(0, D_SHARED), slice(D_SHARED, D_SHARED + D_PERSONAL)


@pytest.mark.parametrize("weighting", ["num-examples", "uniform"])
def test_fedalt_rounds(data, weighting):
    """LocalAlt: tau_v steps on v (theta frozen), then tau_u on theta at the NEW v; v stays
    on the client; server: data-size weighted (or plain) mean of the returned theta."""
    path, X, t = data
    lr, plr, tau_v, tau_u, R = 0.05, 0.1, 2, 3, 3
    got, sampled, grid, _ = run(
        path,
        {
            **PERSONAL,
            "algorithm": "fedalt",
            "lr": lr,
            "personal-lr": plr,
            "personal-steps": tau_v,
            "local-steps": tau_u,
            "fraction-train": 0.5,
            "fedalt-weighting": weighting,
        },
        R,
    )
    theta, v = np.zeros(D_SHARED), [np.zeros(D_PERSONAL) for _ in range(M)]
    for r in range(1, R + 1):
        thetas, sizes = [], []
        for m in sampled[r]:
            z = np.concatenate([theta, v[m]])
            for _ in range(tau_v):
                z[W] -= plr * grad(X[m], t[m], z)[W]
            for _ in range(tau_u):
                z[TH] -= lr * grad(X[m], t[m], z)[TH]
            v[m] = z[W]
            thetas.append(z[TH])
            sizes.append(len(t[m]) if weighting == "num-examples" else 1.0)
        theta = np.average(thetas, axis=0, weights=sizes)
    assert len(sampled[1]) == 2 and any(sampled[r] != sampled[1] for r in sampled)
    np.testing.assert_allclose(got, theta, **TOL)
    for m, tensors in stored(grid, "personal").items():
        np.testing.assert_allclose(tensors["per_user_offset"], v[m], **TOL)


def test_fedsim_rounds(data):
    """LocalSim: joint steps, both gradients at the same point, lr for theta, personal-lr
    for v; server: data-size weighted mean."""
    path, X, t = data
    lr, plr, tau, R = 0.05, 0.2, 3, 2
    got, sampled, grid, _ = run(
        path,
        {
            **PERSONAL,
            "algorithm": "fedsim",
            "lr": lr,
            "personal-lr": plr,
            "local-steps": tau,
            "fraction-train": 0.5,
        },
        R,
    )
    theta, v = np.zeros(D_SHARED), [np.zeros(D_PERSONAL) for _ in range(M)]
    for r in range(1, R + 1):
        thetas, sizes = [], []
        for m in sampled[r]:
            z = np.concatenate([theta, v[m]])
            for _ in range(tau):
                g = grad(X[m], t[m], z)
                z[TH] -= lr * g[TH]
                z[W] -= plr * g[W]
            v[m] = z[W]
            thetas.append(z[TH])
            sizes.append(len(t[m]))
        theta = np.average(thetas, axis=0, weights=sizes)
    np.testing.assert_allclose(got, theta, **TOL)
    for m, tensors in stored(grid, "personal").items():
        np.testing.assert_allclose(tensors["per_user_offset"], v[m], **TOL)


@pytest.mark.parametrize("weighting", ["uniform", "num-examples"])
def test_local_ffgg_rounds(data, weighting):
    """Alg. 4: w from zeros, tau_w steps on w; then K pairs (w step, theta step at the new
    w) on the same batch; Delta = theta^r - theta^{r,K}; server theta - eta_g mean Delta."""
    path, X, t = data
    lr, plr, tau_w, K, eta_g, R = 0.05, 0.1, 2, 3, 0.7, 2
    got, sampled, _, _ = run(
        path,
        {
            **PERSONAL,
            "algorithm": "local-ffgg",
            "lr": lr,
            "personal-lr": plr,
            "personal-steps": tau_w,
            "local-steps": K,
            "ffgg-init": "zeros",
            "ffgg-weighting": weighting,
            "server-lr": eta_g,
            "fraction-train": 0.5,
        },
        R,
    )
    theta = np.zeros(D_SHARED)
    for r in range(1, R + 1):
        deltas, sizes = [], []
        for m in sampled[r]:
            z = np.concatenate([theta, np.zeros(D_PERSONAL)])
            for _ in range(tau_w):
                z[W] -= plr * grad(X[m], t[m], z)[W]
            for _ in range(K):
                z[W] -= plr * grad(X[m], t[m], z)[W]
                z[TH] -= lr * grad(X[m], t[m], z)[TH]
            deltas.append(theta - z[TH])
            sizes.append(len(t[m]) if weighting == "num-examples" else 1.0)
        theta = theta - eta_g * np.average(deltas, axis=0, weights=sizes)
    np.testing.assert_allclose(got, theta, **TOL)


def test_local_gd_rounds_weight_by_data_size(data):
    path, X, t = data
    lr, K, R = 0.05, 3, 2
    got, sampled, _, _ = run(
        path,
        {
            "algorithm": "local-gd",
            "split": "none",
            "lr": lr,
            "local-steps": K,
            "fraction-train": 0.5,
        },
        R,
    )
    z = np.zeros(D_SHARED + D_PERSONAL)
    for r in range(1, R + 1):
        ends, sizes = [], []
        for m in sampled[r]:
            y = z.copy()
            for _ in range(K):
                y -= lr * grad(X[m], t[m], y)
            ends.append(y)
            sizes.append(len(t[m]))
        z = np.average(ends, axis=0, weights=sizes)
    np.testing.assert_allclose(got, z, **TOL)


@pytest.mark.parametrize("control", ["local-steps", "full-gradient"])
def test_scaffold_rounds_with_partial_participation(data, control):
    """Karimireddy et al. Alg. 1 with |S| = 2 of N = 4: c <- c + |S|/N mean Delta c_i."""
    path, X, t = data
    lr, lr_g, K, R = 0.05, 0.8, 3, 3
    got, sampled, grid, strategy = run(
        path,
        {
            "algorithm": "scaffold",
            "split": "none",
            "lr": lr,
            "server-lr": lr_g,
            "local-steps": K,
            "scaffold-control": control,
            "fraction-train": 0.5,
        },
        R,
    )
    d = D_SHARED + D_PERSONAL
    x, c, c_i = np.zeros(d), np.zeros(d), [np.zeros(d) for _ in range(M)]
    for r in range(1, R + 1):
        dys, dcs = [], []
        for m in sampled[r]:
            y = x.copy()
            for _ in range(K):
                y -= lr * (grad(X[m], t[m], y) - c_i[m] + c)
            if control == "local-steps":
                new = c_i[m] - c + (x - y) / (K * lr)
            else:
                new = grad(X[m], t[m], x)
            dys.append(y - x)
            dcs.append(new - c_i[m])
            c_i[m] = new
        x = x + lr_g * np.mean(dys, axis=0)
        c = c + len(sampled[r]) / M * np.mean(dcs, axis=0)
    np.testing.assert_allclose(got, x, **TOL)
    server_c = np.concatenate(
        [strategy.control[k].ravel() for k in ("body_coefficients", "per_user_offset")]
    )
    np.testing.assert_allclose(server_c, c, **TOL)
    for m, tensors in stored(grid, "scaffold-control").items():
        mine = np.concatenate([tensors["body_coefficients"], tensors["per_user_offset"]])
        np.testing.assert_allclose(mine, c_i[m], **TOL)


def test_l2gd_is_its_coin_by_coin_iteration(data):
    """Hanzely & Richtarik: per coin, xi = 1 (prob p): x_m <- x_m - alpha lambda/(M p)
    (x_m - x_bar); xi = 0: x_m <- x_m - alpha/(M (1 - p)) grad f_m(x_m)."""
    path, X, t = data
    alpha, lam, p, R = 0.5, 0.4, 0.3, 4
    got, _, grid, strategy = run(
        path,
        {
            "algorithm": "l2gd",
            "split": "none",
            "lr": alpha,
            "l2gd-lambda": lam,
            "l2gd-p": p,
            "fraction-train": 1.0,
        },
        R,
    )
    coins = np.random.default_rng([0, 2020])  # the strategy's seeded coins (seed 0)
    d = D_SHARED + D_PERSONAL
    xs = [np.zeros(d) for _ in range(M)]
    for _ in range(strategy.iterations):
        if coins.random() < p:
            bar = np.mean(xs, axis=0)
            xs = [x - alpha * lam / (M * p) * (x - bar) for x in xs]
        else:
            xs = [x - alpha / (M * (1 - p)) * grad(X[m], t[m], x) for m, x in enumerate(xs)]
    assert strategy.iterations > R
    np.testing.assert_allclose(got, np.mean(xs, axis=0), **TOL)
    for m, tensors in stored(grid, "l2gd-model").items():
        mine = np.concatenate([tensors["body_coefficients"], tensors["per_user_offset"]])
        np.testing.assert_allclose(mine, xs[m], **TOL)


@pytest.mark.parametrize(
    ("weighting", "mix"), [("uniform", "global"), ("num-examples", "global"), ("uniform", "local")]
)
def test_apfl_rounds(data, weighting, mix):
    """Deng et al.: per step w <- w - eta grad f(w); v <- v - eta alpha grad f(v_bar);
    alpha <- Proj(alpha - eta <v - m, grad f(v_bar)>), v_bar = alpha v + (1 - alpha) m, all
    at the step's start, m the round's received w (``apfl-mix-with = "global"``, the
    default) or the moving w_i (``"local"``, Algorithm 1 as printed);
    eta = eta_0 decay^((round - 1) tau + k); v, alpha stay; server: mean of the w_i."""
    path, X, t = data
    lr, decay, tau, alpha0, R = 0.05, 0.9, 3, 0.4, 3
    got, sampled, grid, _ = run(
        path,
        {
            "algorithm": "apfl",
            "lr": lr,
            "apfl-lr-decay": decay,
            "apfl-alpha": alpha0,
            "local-steps": tau,
            "fraction-train": 0.5,
            "apfl-weighting": weighting,
            "apfl-mix-with": mix,
        },
        R,
    )
    d = D_SHARED + D_PERSONAL
    z = np.zeros(d)
    state = {}  # m -> (v, alpha)
    for r in range(1, R + 1):
        ws, sizes = [], []
        for m in sampled[r]:
            w = z.copy()
            v, alpha = state.get(m, (z.copy(), alpha0))
            for k in range(tau):
                eta = lr * decay ** ((r - 1) * tau + k)
                g_w = grad(X[m], t[m], w)
                mixed = z if mix == "global" else w  # the round's received w is z here
                g_bar = grad(X[m], t[m], alpha * v + (1 - alpha) * mixed)
                g_alpha = float((v - mixed) @ g_bar)
                w, v = w - eta * g_w, v - eta * alpha * g_bar
                alpha = min(1.0, max(0.0, alpha - eta * g_alpha))
            state[m] = (v, alpha)
            ws.append(w)
            sizes.append(len(t[m]) if weighting == "num-examples" else 1.0)
        z = np.average(ws, axis=0, weights=sizes)
    np.testing.assert_allclose(got, z, **TOL)
    for m, tensors in stored(grid, "apfl-v").items():
        v = np.concatenate([tensors["body_coefficients"], tensors["per_user_offset"]])
        np.testing.assert_allclose(v, state[m][0], **TOL)
    assert any(abs(a - alpha0) > 1e-3 for _, a in state.values())  # alpha moved


# --- the baselines of the papers' comparisons: FedProx, Ditto, FedBABU -------------------


@pytest.mark.parametrize("mu", [0.0, 0.3])
def test_fedprox_rounds(data, mu):
    """Each local step of FedProx is a gradient step on F_m(z) + mu/2 ||z - z^t||^2 from the
    received z^t; the server averages as FedAvg (data-size weights). mu = 0 is FedAvg."""
    path, X, t = data
    lr, K, R = 0.05, 3, 3
    common = {"split": "none", "lr": lr, "local-steps": K, "fraction-train": 0.5, "sample-seed": 3}
    got, sampled, _, _ = run(path, {**common, "algorithm": "fedprox", "fedprox-mu": mu}, R)
    z = np.zeros(D_SHARED + D_PERSONAL)
    for r in range(1, R + 1):
        ends, sizes = [], []
        for m in sampled[r]:
            y = z.copy()
            for _ in range(K):
                y -= lr * (grad(X[m], t[m], y) + mu * (y - z))
            ends.append(y)
            sizes.append(len(t[m]))
        z = np.average(ends, axis=0, weights=sizes)
    np.testing.assert_allclose(got, z, **TOL)
    if mu == 0.0:  # FedAvg exactly, on the same sample
        fedavg, same, _, _ = run(path, {**common, "algorithm": "fedavg"}, R)
        assert same == sampled
        np.testing.assert_array_equal(got, fedavg)


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_ditto_rounds(data, lam):
    """Ditto, Alg. 1: the global update as FedAvg's (sent, data-size weighted mean), then
    s personal steps v <- v - eta (grad F_m(v) + lambda (v - w^t)) toward the *received*
    w^t, v starting at the first w^t its client receives and kept on the client."""
    path, X, t = data
    lr, plr, K, s, R = 0.05, 0.08, 2, 3, 3
    got, sampled, grid, _ = run(
        path,
        {
            "algorithm": "ditto",
            "split": "none",
            "lr": lr,
            "personal-lr": plr,
            "local-steps": K,
            "personal-steps": s,
            "ditto-lambda": lam,
            "fraction-train": 0.5,
        },
        R,
    )
    w = np.zeros(D_SHARED + D_PERSONAL)
    v: dict[int, np.ndarray] = {}
    for r in range(1, R + 1):
        ends, sizes = [], []
        for m in sampled[r]:
            y = w.copy()
            for _ in range(K):
                y -= lr * grad(X[m], t[m], y)
            ends.append(y)
            sizes.append(len(t[m]))
            p = v.get(m, w).copy()
            for _ in range(s):
                p -= plr * (grad(X[m], t[m], p) + lam * (p - w))
            v[m] = p
        w = np.average(ends, axis=0, weights=sizes)
    np.testing.assert_allclose(got, w, **TOL)
    kept = stored(grid, "ditto-v")
    assert sorted(kept) == sorted(v)
    for m, tensors in kept.items():
        flat = np.concatenate([tensors["body_coefficients"], tensors["per_user_offset"]])
        np.testing.assert_allclose(flat, v[m], **TOL)
        assert not np.allclose(flat, w)  # v_m is not the global model: it stayed here


def test_fedbabu_rounds(data):
    """FedBABU: the body trained with the head fixed at H (here a one-dimensional head:
    zeros), the server's data-size weighted mean of the bodies; nothing stored."""
    path, X, t = data
    lr, K, R = 0.05, 3, 3
    got, sampled, grid, _ = run(
        path,
        {**PERSONAL, "algorithm": "fedbabu", "lr": lr, "local-steps": K, "fraction-train": 0.5},
        R,
    )
    theta = np.zeros(D_SHARED)
    for r in range(1, R + 1):
        bodies, sizes = [], []
        for m in sampled[r]:
            z = np.concatenate([theta, np.zeros(D_PERSONAL)])
            for _ in range(K):
                z[TH] -= lr * grad(X[m], t[m], z)[TH]
            bodies.append(z[TH])
            sizes.append(len(t[m]))
        theta = np.average(bodies, axis=0, weights=sizes)
    np.testing.assert_allclose(got, theta, **TOL)
    assert not stored(grid, "personal")
