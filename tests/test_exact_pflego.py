"""PFLEGO (Nikoloutsopoulos et al.) end to end against a re-derivation that shares no code
with pflower: the forward pass and cross-entropy written here, torch autograd, float64 (a
float64 model of the user's own), partial participation r < I and unequal client sizes, so
that every factor that is 1 at full participation (I/r in the server step and in the head
step, alpha_i) is visible. With ``holdout-fraction`` one more node is held out: it is no part
of L, so I, r and sum_j N_j are those of the trainable clients.

client i in I_t (theta frozen):  tau - 1 head GD steps (beta) on phi(X_i; theta);
                                 g_i = grad_theta l_i, g_W = grad_W l_i at that head;
                                 W_i <- W_i - rho (I/r) [alpha_i] g_W
server:  theta <- theta - rho (I/r_t) sum_i alpha_i g_i,  alpha_i = N_i / sum_all N_j  (global)
         theta <- theta - rho sum_i N_i g_i / sum_{i in I_t} N_i                        (sampled)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from helpers import BASE

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.context_store import Scope, ScopedStore, open_store
from pflower.strategies import build_run_model, make_strategy, wire_split
from pflower.task.data import client_arrays
from pflower.task.split import get_tensors
from pflower.testbed.local_grid import LocalGrid

NUM_CLIENTS, TAU, BETA, RHO = 4, 3, 0.2, 0.1
HEAD = ("head.weight", "head.bias")


def cross_entropy(z, y):
    return (torch.logsumexp(z, dim=1) - z[torch.arange(len(y)), y]).mean()


def features(theta, x):
    return torch.tanh(x.reshape(len(x), -1) @ theta["body.weight"].T + theta["body.bias"])


def client_step(theta, head, x, y, head_rate):
    """Reference client: returns (g_theta, new head)."""
    phi = features(theta, x).detach()
    W, b = head["head.weight"].clone(), head["head.bias"].clone()
    for _ in range(TAU - 1):
        W_, b_ = W.requires_grad_(True), b.requires_grad_(True)
        gW, gb = torch.autograd.grad(cross_entropy(phi @ W_.T + b_, y), [W_, b_])
        W, b = (W_ - BETA * gW).detach(), (b_ - BETA * gb).detach()
    params = {**{k: t.clone().requires_grad_(True) for k, t in theta.items()}}
    W_, b_ = W.requires_grad_(True), b.requires_grad_(True)
    loss = cross_entropy(features(params, x) @ W_.T + b_, y)
    names = list(params)
    grads = torch.autograd.grad(loss, [*params.values(), W_, b_])
    g_theta = dict(zip(names, grads[: len(names)]))
    gW, gb = grads[len(names) :]
    return g_theta, {
        "head.weight": (W - head_rate * gW).detach(),
        "head.bias": (b - head_rate * gb).detach(),
    }


@pytest.mark.parametrize(
    "alpha_mode, head_alpha, holdout, robust",
    [
        ("global", False, False, "auto"),
        ("global", True, False, "auto"),
        ("sampled", False, False, "auto"),
        ("global", True, True, "auto"),
        # the paper's rule as `robust-aggregator = "none"` gives it: the server step's own
        # branch (at "auto" the alpha-sum runs over the clipped g_i, here nothing is clipped)
        ("global", False, False, "none"),
        ("global", True, True, "none"),
    ],
)
def test_pflego_round_with_partial_participation_equals_the_papers_step(
    alpha_mode, head_alpha, holdout, robust
):
    # with a hold-out: a fifth node, the highest partition id, never trained (I = 4, r = 2)
    num_nodes = NUM_CLIENTS + 1 if holdout else NUM_CLIENTS
    overrides = {
        **BASE,
        "algorithm": "pflego",
        "model": "user_models:TinyMLP64",
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5,
        "local-steps": TAU,
        "personal-lr": BETA,
        "server-optimizer": "sgd",
        "server-lr": RHO,
        "fraction-train": 0.5,
        "num-server-rounds": 1,
        "evaluate-every": 100,
        "pflego-alpha": alpha_mode,
        "pflego-head-alpha": head_alpha,
        "holdout-fraction": 0.2 if holdout else 0.0,
        "robust-aggregator": robust,
    }
    cfg = Config.from_run_config(overrides)
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    assert split.personal == HEAD
    honest, trained = build_client_app(overrides), []

    def recording(msg, context):
        if msg.metadata.message_type == "train":
            trained.append(int(context.node_config["partition-id"]))
        return honest(msg, context)

    grid = LocalGrid(recording, num_nodes)
    # every client's current head (its state from earlier rounds), drawn here
    g = torch.Generator().manual_seed(3)
    heads = {}
    for context in grid.contexts.values():
        pid = int(context.node_config["partition-id"])
        heads[pid] = {
            "head.weight": torch.randn(10, 8, generator=g, dtype=torch.float64),
            "head.bias": torch.randn(10, generator=g, dtype=torch.float64),
        }
        # written as an earlier run of this configuration would have (context_store.Scope)
        scope = Scope.of(cfg, pid, num_nodes, heads[pid])
        ScopedStore(open_store(context.state, {}), scope, run="earlier").save(
            "personal", heads[pid]
        )
    theta0 = get_tensors(model, split.shared)
    strategy = make_strategy(cfg, split.shared)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(theta0), num_rounds=1)

    data = {}
    for pid in range(num_nodes):
        a = client_arrays(cfg, pid, num_nodes)
        data[pid] = (torch.from_numpy(a.x_train).double(), torch.from_numpy(a.y_train).long())
    sizes = {pid: len(d[1]) for pid, d in data.items()}
    assert len(set(sizes.values())) == num_nodes, "client sizes must differ for the test to bite"
    assert len(trained) == 2 and max(trained) < NUM_CLIENTS, "r = 2 of the I = 4 trainable"
    total = sum(sizes[pid] for pid in range(NUM_CLIENTS))  # sum_j N_j over the I clients
    head_rate = RHO * NUM_CLIENTS / len(trained)
    gradients, new_heads = {}, {}
    for pid in trained:
        rate = head_rate * (sizes[pid] / total if head_alpha else 1.0)
        gradients[pid], new_heads[pid] = client_step(theta0, heads[pid], *data[pid], rate)
    for name in split.shared:
        if alpha_mode == "global":
            share = NUM_CLIENTS / len(trained)  # I / r_t
            G = share * sum(sizes[p] / total * gradients[p][name] for p in trained)
        else:
            G = sum(sizes[p] * gradients[p][name] for p in trained) / sum(sizes[p] for p in trained)
        torch.testing.assert_close(
            result.arrays[name].numpy(), (theta0[name] - RHO * G).numpy(), rtol=1e-11, atol=1e-13
        )
    for context in grid.contexts.values():
        pid = int(context.node_config["partition-id"])
        stored = open_store(context.state, {}).load("personal")
        want = new_heads.get(pid, heads[pid])  # clients not sampled keep their head
        for name in HEAD:
            np.testing.assert_allclose(
                stored[name].numpy(), want[name].numpy(), rtol=1e-11, atol=1e-13
            )
