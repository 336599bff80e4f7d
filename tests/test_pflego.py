"""PFLEGO: the closed-form head steps, the order of gradient and head step, and one round
with r = I and the SGD server = one gradient-descent step on L(psi) computed centrally."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from helpers import job_for
from torch.nn import functional as F

from pflower.client_app import build_client_app, load_client_data
from pflower.config import Config
from pflower.strategies import PFLEGOClient, build_run_model, make_strategy, wire_split
from pflower.strategies.pflego import head_descent, head_module
from pflower.task.split import get_tensors, make_split
from pflower.testbed.local_grid import LocalGrid

PFLEGO = {"algorithm": "pflego", "model": "pflego-mlp", "local-steps": 4, "personal-lr": 0.3}


@pytest.mark.parametrize("steps", [1, 3])
def test_closed_form_head_descent_equals_autograd_steps(steps):
    """``head_descent``: each step is W, b <- W, b - lr grad of the mean cross-entropy of
    ``phi W^T + b``, the gradient taken by autograd here (float64)."""
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(50, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (50,), generator=g)
    weight = torch.randn(5, 7, generator=g, dtype=torch.float64)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    w, b = weight.clone(), bias.clone()
    before = weight.clone()
    for _ in range(steps):
        w_, b_ = w.requires_grad_(True), b.requires_grad_(True)
        g_w, g_b = torch.autograd.grad(F.cross_entropy(phi @ w_.T + b_, y), [w_, b_])
        w, b = (w_ - 0.7 * g_w).detach(), (b_ - 0.7 * g_b).detach()
    new_w, new_b = head_descent(phi, y, weight, bias, 0.7, steps)
    torch.testing.assert_close(new_w, w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_b, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(weight, before)  # the steps are on a copy


def test_other_splits_are_refused_with_the_key():
    model = build_run_model(Config.from_run_config({**PFLEGO, "dataset": "digits"}))
    with pytest.raises(ValueError, match="key 'split'"):
        head_module(model, make_split(model, "input").personal)


def _loss_grad_all(job, names):
    """Mean cross-entropy over the whole local set and its gradient in ``names`` (autograd)."""
    params = dict(job.model.named_parameters())
    for p in params.values():
        p.grad = None
    data = job.train_loader.dataset.tensors
    F.cross_entropy(job.model(data[0]), data[1].long()).backward()
    return {n: params[n].grad.clone() for n in names}


def test_gradient_is_taken_before_the_head_step():
    """g_theta is the body gradient at the head after the tau - 1 head steps, not after (3)."""
    job = job_for(PFLEGO)
    half = PFLEGOClient()
    half.init_head(job)
    half.head_steps(job, 3)
    expected = _loss_grad_all(job, job.split.shared)
    half.init_head(job)  # train() starts from the same (first-visit) head
    record, _ = half.train(job, {"pflego-head-lr": 0.5, "lr": 0.1})
    for name in job.split.shared:
        torch.testing.assert_close(
            torch.from_numpy(record[name].numpy()), expected[name], rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize("tau", [1, 4])
def test_head_loss_is_the_loss_where_the_gradient_is_taken(tau):
    """``head-loss`` is l_i(W_i, theta) after the tau - 1 head steps, before (3): finite for
    tau = 1 too (it was NaN, and a ClientApp without ``measured`` had every reply dropped)."""
    job = job_for({**PFLEGO, "local-steps": tau})
    half = PFLEGOClient()
    half.init_head(job)
    half.head_steps(job, tau - 1)
    data = job.train_loader.dataset.tensors
    with torch.no_grad():
        expected = float(F.cross_entropy(job.model(data[0]), data[1].long()))
    half.init_head(job)  # train() starts from the same (first-visit) head
    records, _, metrics = half.reply(job, {"pflego-head-lr": 0.5, "lr": 0.1, "phase": "train"})
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert metrics["head-loss"] == pytest.approx(expected, rel=1e-5)


def test_round_with_every_client_and_sgd_is_one_gd_step_on_L():
    """r = I, SGD server, tau = 1: theta and every head move by -rho * grad L(psi), with
    L = sum_i alpha_i l_i, computed here centrally from all clients' data."""
    rho, num = 0.5, 4
    overrides = {
        **job_for_config(),
        "local-steps": 1,
        "server-optimizer": "sgd",
        "server-lr": rho,
        "fraction-train": 1.0,
        "num-server-rounds": 1,
        "evaluate-every": 100,
        "robust-aggregator": "none",  # the exact rule (the default defence clips)
    }
    cfg = Config.from_run_config(overrides)
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    strategy = make_strategy(cfg, split.shared)
    grid = LocalGrid(build_client_app(overrides), num)
    start = get_tensors(model, split.shared)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(start), num_rounds=1)

    # central computation: the same heads (first visit), the full objective, autograd
    sizes, heads, grads = [], [], []
    for pid in range(num):
        job = job_for(overrides, partition_id=pid)
        job.set_shared(ArrayRecord(start))
        PFLEGOClient().init_head(job)
        heads.append(get_tensors(job.model, split.personal))
        sizes.append(job.num_train)
        grads.append(_loss_grad_all(job, [*split.shared, *split.personal]))
    alpha = np.asarray(sizes) / sum(sizes)
    for name in split.shared:
        g_theta = sum(a * g[name] for a, g in zip(alpha, grads))
        expected = start[name] - rho * g_theta
        torch.testing.assert_close(
            torch.from_numpy(result.arrays[name].numpy()), expected, rtol=1e-4, atol=1e-6
        )
    # the heads: dL/dW_i = alpha_i g_W; eq. (3) as in Alg. 1 takes rho (I / r) g_W = rho g_W
    # here (I = r), i.e. the step on L scaled by 1 / alpha_i (the paper's choice, flag off)
    by_pid = {c.node_config["partition-id"]: c for c in grid.contexts.values()}
    for pid in range(num):
        stored = by_pid[pid].state.array_records["pflower.personal"]
        for name in split.personal:
            expected = heads[pid][name] - rho * grads[pid][name]
            torch.testing.assert_close(
                torch.from_numpy(stored[name].numpy()), expected, rtol=1e-4, atol=1e-6
            )


def job_for_config():
    from helpers import BASE

    return {**BASE, **PFLEGO}


def test_a_round_without_replies_keeps_theta(task_identity):
    from pflower.strategies import PFLEGO as Strategy

    strategy = Strategy(lr=0.1)
    current = {"w": np.ones(3, dtype=np.float32)}
    strategy._current = ArrayRecord({"w": torch.ones(3)})
    strategy.num_rounds = 2  # not the last round: a phase that applied nothing fails there
    arrays, metrics = strategy.aggregate_train(1, [])
    assert metrics["applied"] == 0
    np.testing.assert_array_equal(arrays["w"].numpy(), current["w"])


def test_server_learns_every_clients_size_for_global_alpha():
    overrides = {**job_for_config(), "fraction-train": 0.5, "num-server-rounds": 1}
    cfg = Config.from_run_config(overrides)
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    strategy = make_strategy(cfg, split.shared)
    grid = LocalGrid(build_client_app(overrides), 4)
    strategy.start(
        grid=grid, initial_arrays=ArrayRecord(get_tensors(model, split.shared)), num_rounds=1
    )
    sizes = sorted(len(load_client_data(cfg, pid, 4)[0].dataset) for pid in range(4))
    assert sorted(strategy.nodes.num_train_of.values()) == sizes


def test_local_labels_head_is_the_k_i_class_head():
    """The C-row head with absent classes pinned equals a K_i-row head on re-indexed labels:
    a head step moves the present rows as the K_i head's autograd step, leaves the others
    exactly as they were, and an absent class is never predicted."""
    job = job_for({**PFLEGO, "pflego-local-labels": True, "partitioner": "pathological"})
    half = PFLEGOClient()
    half.init_head(job)
    head = half._head(job)
    from pflower.strategies.pflego import features

    phi, y = features(job.model, head, job.train_loader, job.device, 512)
    present = y.unique()
    assert 1 <= len(present) < head.out_features
    lr = 0.3
    new_w, new_b = head_descent(phi, y, head.weight.detach(), head.bias.detach(), lr, 1)
    absent = torch.ones(head.out_features, dtype=torch.bool)
    absent[present] = False
    assert torch.equal(new_w[absent], head.weight.detach()[absent])
    assert torch.equal(new_b[absent], head.bias.detach()[absent])
    # the K_i-row head on locally re-indexed labels, one autograd step
    local_y = torch.searchsorted(present, y)
    w_k = head.weight.detach()[present].clone().requires_grad_(True)
    b_k = head.bias.detach()[present].clone().requires_grad_(True)
    F.cross_entropy(phi @ w_k.T + b_k, local_y).backward()
    with torch.no_grad():
        torch.testing.assert_close(new_w[present], w_k - lr * w_k.grad)
        torch.testing.assert_close(new_b[present], b_k - lr * b_k.grad)
        predicted = (phi @ new_w.T + new_b).argmax(1)
    assert set(predicted.tolist()) <= set(present.tolist())


def test_a_client_without_a_stored_head_is_evaluated_as_a_new_client():
    """Personalized evaluation of a client never sampled (no stored head) is what a new
    client gets, a head fitted on the current body (tau - 1 steps), so it equals the global
    model; it was the bare U[0, 1) init, which predicts whatever class its random weights
    favour (a personalized accuracy of 0 beside a global one of ~90% on 2-class clients)."""
    job = job_for(PFLEGO)
    metrics = PFLEGOClient().evaluate(job, {"lr": 0.1})
    for name in ("accuracy", "loss"):
        assert metrics[f"personal-{name}"] == metrics[f"global-{name}"], name
    # the fitted head, computed here: init, then tau - 1 closed-form steps on the body
    half = PFLEGOClient()
    half.init_head(job)
    data = job.train_loader.dataset.tensors
    with torch.no_grad():
        unfitted = float(F.cross_entropy(job.model(data[0]), data[1].long()))
    half.head_steps(job, PFLEGO["local-steps"] - 1)
    with torch.no_grad():
        fitted = float(F.cross_entropy(job.model(data[0]), data[1].long()))
    assert fitted < unfitted
    # a client with a stored head is evaluated with it, not refitted
    half.train(job, {"pflego-head-lr": 0.5, "lr": 0.1})
    stored = {n: t.clone() for n, t in get_tensors(job.model, job.split.personal).items()}
    half.evaluate(job, {"lr": 0.1})
    after = get_tensors(job.model, job.split.personal)
    assert all(torch.equal(after[n], stored[n]) for n in stored)


def test_a_frozen_body_keeps_its_random_init_while_the_heads_learn(tmp_path):
    """``pflego-freeze-body``: the random-features baseline. The server returns theta as it
    was (the run's initial body, built here from the seed as the ServerApp builds it), while
    the same heads take their steps on it and fit the clients' data."""
    from pflower.testbed.local_grid import run_local

    overrides = {
        **job_for_config(),
        "partitioner": "pathological",
        "num-server-rounds": 3,
        "fraction-train": 1.0,
        "evaluate-every": 1,
        "pflego-freeze-body": True,
        "outputs-dir": str(tmp_path),
    }
    report = run_local(overrides, 4)
    cfg = Config.from_run_config(overrides)
    torch.manual_seed(cfg.seed)
    model = build_run_model(cfg)
    init = get_tensors(model, wire_split(model, cfg).shared)
    assert set(report.shared) == set(init)
    for name, tensor in init.items():
        assert torch.equal(report.shared[name], tensor), name
    evaluated = [r.evaluate for r in report.rounds if r.evaluate]
    assert evaluated[-1]["personal-loss"] < evaluated[0]["personal-loss"]
    # the stored heads as trained are the personalized models of clients that trained
    final = evaluated[-1]
    assert final["local-part-accuracy"] == final["personal-accuracy"]
