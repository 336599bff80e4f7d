"""FFGG / Local FFGG: checked against finite differences, a dense Newton solve and a
hand-computed alternating step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from helpers import BASE as DEVICE_BASE
from helpers import job_for, node_context
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from pflower.strategies import FFGG, FFGGClient, LocalFFGGClient
from pflower.strategies.server_opt import ServerOptimizer
from pflower.task.split import get_tensors
from pflower.task.train import conjugate_gradient

BASE = {"split": "head", "personal-lr": 0.1}


def full_loss(model, loader, dtype=torch.float64) -> float:
    model = copy.deepcopy(model).to(dtype)
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            total += F.cross_entropy(model(x.to(dtype)), y, reduction="sum").item()
            n += len(y)
    return total / n


@pytest.mark.parametrize("init", ["random", "zeros", "received"])
def test_ffgg_gradient_is_the_theta_derivative_at_the_fine_tuned_w(init):
    job = job_for({**BASE, "algorithm": "ffgg", "ffgg-init": init, "personal-epochs": 2})
    record, metrics = FFGGClient().train(job, {"lr": 0.05})
    grads = record.to_torch_state_dict()
    assert list(grads) == list(job.split.shared)
    # central finite differences of f_m(theta, w_fine_tuned) along random theta directions
    rng = torch.Generator().manual_seed(0)
    params = dict(job.model.named_parameters())
    eps = 1e-4
    for _ in range(3):
        direction = {n: torch.randn(params[n].shape, generator=rng) for n in job.split.shared}
        norm = torch.sqrt(sum((d**2).sum() for d in direction.values()))
        direction = {n: d / norm for n, d in direction.items()}
        shifted = {}
        for sign in (1, -1):
            model = copy.deepcopy(job.model).double()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in direction:
                        p += sign * eps * direction[n].double()
            shifted[sign] = full_loss(model, job.train_loader)
        fd = (shifted[1] - shifted[-1]) / (2 * eps)
        analytic = sum((grads[n].double() * direction[n].double()).sum() for n in grads).item()
        assert analytic == pytest.approx(fd, rel=1e-3, abs=1e-6)
    expected_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    assert metrics["grad-norm"] == pytest.approx(expected_norm)


def test_personal_init_modes():
    job = job_for({**BASE, "algorithm": "ffgg", "ffgg-init": "zeros"})
    client = FFGGClient()
    client.init_personal(job)
    assert all((p == 0).all() for p in job.personal_params())
    job = job_for({**BASE, "algorithm": "ffgg", "ffgg-init": "received"})
    client.init_personal(job)
    assert all(
        torch.equal(p, job.init_personal[n])
        for n, p in zip(job.split.personal, job.personal_params())
    )
    job = job_for({**BASE, "algorithm": "ffgg", "ffgg-init": "random"})
    shared_before = get_tensors(job.model, job.split.shared)
    client.init_personal(job)
    assert not all(
        torch.equal(p, job.init_personal[n])
        for n, p in zip(job.split.personal, job.personal_params())
    )
    after = get_tensors(job.model, job.split.shared)
    assert all(torch.equal(after[n], shared_before[n]) for n in after)


def test_conjugate_gradient_with_tau_equal_dim_is_the_exact_newton_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    x, y = torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 3, (40,))
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    params = list(model.parameters())
    start = torch.cat([p.detach().reshape(-1) for p in params])

    def loss_of(flat):
        w, b = flat[:12].view(3, 4), flat[12:]
        return F.cross_entropy(x @ w.T + b, y)

    g = torch.autograd.functional.jacobian(loss_of, start)
    h = torch.autograd.functional.hessian(loss_of, start)
    newton = -torch.linalg.pinv(h) @ g  # min-norm: softmax is invariant to a shift of logits
    conjugate_gradient(model, params, loader, steps=start.numel())
    moved = torch.cat([p.detach().reshape(-1) for p in params]) - start
    assert torch.allclose(moved, newton, atol=1e-8)


def test_local_ffgg_first_pair_is_the_hand_computed_alternating_step():
    overrides = {
        **BASE,
        "algorithm": "local-ffgg",
        "local-steps": 1,
        "personal-steps": 1,
        "batch-size": 10_000,
        "lr": 0.3,
        "personal-lr": 0.2,
    }
    job = job_for(overrides)
    client = LocalFFGGClient()
    x, y = next(iter(job.train_loader))
    model = job.model
    params = dict(model.named_parameters())
    shared, personal = list(job.split.shared), list(job.split.personal)

    def grad(names):
        loss = F.cross_entropy(model(x), y)
        return dict(zip(names, torch.autograd.grad(loss, [params[n] for n in names])))

    # replay by hand: init, one w-only step (the fine-tuner), then one (w, theta) pair;
    # the random init draws from the message's own stream (job.rng_state): replay it too
    stream = job.rng_state.clone()
    client.init_personal(job)
    theta0 = {n: params[n].detach().clone() for n in shared}
    for _ in range(2):  # Alg. 2's single step (w^{r,0}), then w^{r,1} at (theta^{r,0}, w^{r,0})
        step = grad(personal)
        with torch.no_grad():
            for n, gn in step.items():
                params[n] -= 0.2 * gn
    gtheta = grad(shared)  # at (theta^{r,0}, w^{r,1}): the UPDATED w
    expected = {n: 0.3 * gtheta[n] for n in shared}  # delta = theta^r - theta^{r,1}

    for n in shared:  # back to the start, then the real client
        with torch.no_grad():
            params[n].copy_(theta0[n])
    job.rng_state = stream
    record, metrics = client.train(job, {"lr": 0.3, "lr-scale": 1.0})
    delta = record.to_torch_state_dict()
    for n in shared:
        assert torch.allclose(delta[n], expected[n], atol=1e-6), n
    assert metrics["grad-norm"] > 0


def test_local_ffgg_pairs_apply_momentum_weight_decay_and_clipping():
    """momentum, weight-decay and max-grad-norm step the pairs as they step the fine-tuning:
    one SGD per part (momentum over the round's pairs), clip, then decay, written out here."""
    momentum, decay, clip, lr_w, lr_theta, pairs = 0.9, 0.05, 0.14, 0.2, 0.3, 3
    overrides = {
        **BASE,
        "algorithm": "local-ffgg",
        "local-steps": pairs,
        "personal-steps": 2,
        "batch-size": 10_000,
        "lr": lr_theta,
        "personal-lr": lr_w,
        "momentum": momentum,
        "weight-decay": decay,
        "max-grad-norm": clip,
    }
    job = job_for(overrides)
    client = LocalFFGGClient()
    x, y = next(iter(job.train_loader))
    params = dict(job.model.named_parameters())
    shared, personal = list(job.split.shared), list(job.split.personal)
    clipped = []

    def step(names, buffers, lr):
        loss = F.cross_entropy(job.model(x), y)
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        clipped.append(norm > clip)
        scale = min(1.0, clip / (norm + 1e-6))  # torch's clip_grad_norm_
        with torch.no_grad():
            for n, g in zip(names, grads):
                d = g * scale + decay * params[n]
                buffers[n] = d if n not in buffers else momentum * buffers[n] + d
                params[n] -= lr * buffers[n]

    stream = job.rng_state.clone()
    client.init_personal(job)
    theta0 = {n: params[n].detach().clone() for n in shared}
    fine_tune: dict = {}
    for _ in range(2):  # Alg. 2 with the run's SGD: its own momentum buffer
        step(personal, fine_tune, lr_w)
    w_buffers: dict = {}
    theta_buffers: dict = {}
    for _ in range(pairs):  # the pairs: a fresh buffer per part, running over the pairs
        step(personal, w_buffers, lr_w)
        step(shared, theta_buffers, lr_theta)
    expected = {n: theta0[n] - params[n].detach() for n in shared}
    assert any(clipped) and not all(clipped), "the clip must bite on some steps only"

    with torch.no_grad():  # back to the start, then the real client
        for n in shared:
            params[n].copy_(theta0[n])
    job.rng_state = stream
    record, metrics = client.train(job, {"lr": lr_theta, "lr-scale": 1.0})
    delta = record.to_torch_state_dict()
    for n in shared:
        torch.testing.assert_close(delta[n], expected[n], rtol=1e-4, atol=1e-6)
    # passes: 2 fine-tuning steps, then 2 per pair (one for w, one for theta), full batch
    assert metrics["data-passes"] == pytest.approx(2 + 2 * pairs)


@pytest.mark.parametrize("solver", ["gd", "cg"])
def test_full_batch_solvers_refuse_the_sgd_keys_at_start(solver):
    from pflower.config import Config, ConfigError

    for algorithm in ("ffgg", "local-ffgg"):
        for key, value in (("momentum", 0.9), ("weight-decay", 0.1), ("max-grad-norm", 1.0)):
            overrides = {
                "algorithm": algorithm,
                "ffgg-solver": solver,
                "personal-steps": 2,
                key: value,
            }
            with pytest.raises(ConfigError, match=f"'{key}'"):
                Config.from_run_config(overrides)


@pytest.mark.parametrize("algorithm", ["ffgg", "local-ffgg"])
def test_random_init_keeps_nothing_between_rounds_on_a_device(task_identity, algorithm):
    """``ffgg-init = 'random'`` (the default) is stateless: on a device that served round 1,
    round 2's reply equals a fresh device's reply to the same message, bit for bit, and the
    device's store holds nothing after either round."""
    from pflower.client_app import build_client_app
    from pflower.wire import RUN_TAG

    overrides = {
        **DEVICE_BASE,
        **BASE,
        "algorithm": algorithm,
        "personal-steps": 2,
        "local-steps": 2,
    }
    app = build_client_app(overrides)
    probe = job_for(overrides)
    theta = get_tensors(probe.model, probe.split.shared)

    def message(server_round, shift):
        shared = ArrayRecord({n: t + shift for n, t in theta.items()})
        config = {"server-round": server_round, "lr": 0.05, "lr-scale": 1.0, "phase": "train"}
        content = RecordDict({"arrays": shared, "config": ConfigRecord({**config, RUN_TAG: "r"})})
        return Message(content=content, dst_node_id=1, message_type="train")

    def reply(msg, context):
        out = app(msg, context)
        assert not out.has_error(), out.error.reason
        return {
            n: a.numpy().copy() for r in out.content.array_records.values() for n, a in r.items()
        }

    device = node_context()
    reply(message(1, 0.01), device)
    assert not device.state.array_records, list(device.state.array_records)
    again = reply(message(2, 0.0), device)
    fresh = reply(message(2, 0.0), node_context())
    assert again.keys() == fresh.keys()
    for name in again:
        np.testing.assert_array_equal(again[name], fresh[name])
    assert not device.state.array_records, list(device.state.array_records)


class _Grid:
    def get_node_ids(self):
        return [1, 2, 3]


def test_ffgg_server_steps_with_the_unweighted_mean_gradient(task_identity):
    strategy = FFGG(
        fraction_train=1.0,
        server_optimizer=ServerOptimizer("sgd", 0.5),
        robust=False,  # the exact rule (FFGG's default defence takes the geometric median)
        clipping=False,
    )
    strategy.num_rounds = 1
    theta = ArrayRecord({"t": Array(np.array([1.0, 1.0], np.float32))})
    msgs = list(strategy.configure_train(1, theta, ConfigRecord(), _Grid()))
    replies = []
    for msg, (g, n) in zip(msgs, [([1.0, 0.0], 10), ([0.0, 2.0], 1000), ([2.0, 1.0], 1)]):
        content = RecordDict(
            {
                "gradient": ArrayRecord({"t": Array(np.array(g, np.float32))}),
                "metrics": MetricRecord({"num-examples": n, "grad-norm": float(np.linalg.norm(g))}),
            }
        )
        replies.append(Message(content=content, reply_to=msg))
    new, metrics = strategy.aggregate_train(1, replies)
    # mean gradient (1, 1) regardless of data sizes; theta - 0.5 * (1, 1)
    assert np.allclose(new["t"].numpy(), [0.5, 0.5])
    assert metrics["grad-norm-max"] == pytest.approx(np.sqrt(5))
    assert metrics["grad-norm-mean"] == pytest.approx((1 + 2 + np.sqrt(5)) / 3)
