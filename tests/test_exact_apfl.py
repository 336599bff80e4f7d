"""APFL (Deng et al. 2020) against a re-derivation that shares no code with pflower: a
logistic-regression forward and cross-entropy written here, plain torch autograd, float64.

Per local step k (minibatch xi_k, eta_k = eta_0 * decay^(t0 + k), every gradient at the
step's starting point):
    w     <- w - eta_k grad f(w; xi)
    v     <- v - eta_k alpha grad f(v_bar; xi),          v_bar = alpha v + (1 - alpha) m
    alpha <- Proj_[0,1](alpha - eta_k <v - m, grad f(v_bar; xi)>)
with m the round's received w (``apfl-mix-with = "global"``) or the step's w (``local``).
('outputs' mixing: v_bar's logits = alpha f_v(x) + (1 - alpha) f_m(x), m detached.)
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict
from helpers import job_for
from torch.utils.data import DataLoader, TensorDataset

from pflower.strategies import APFLClient
from pflower.strategies.apfl import ALPHA_KEY, V_KEY

TAU, BATCH, ETA0, DECAY, ROUND = 6, 16, 0.4, 0.9, 3


def logits(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """logreg = Flatten -> Linear: x W^T + b (the model's parameters are '1.weight', '1.bias')."""
    return x.reshape(len(x), -1) @ params["1.weight"].T + params["1.bias"]


def cross_entropy(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.logsumexp(z, dim=1) - z[torch.arange(len(y)), y]).mean()


def reference(w, v, alpha, batches, mixing, adaptive=True, mix_with="global"):
    names = list(w)
    received = dict(w)
    for k, (x, y) in enumerate(batches):
        eta = ETA0 * DECAY ** ((ROUND - 1) * TAU + k)
        w_req = {n: t.clone().requires_grad_(True) for n, t in w.items()}
        g_w = torch.autograd.grad(cross_entropy(logits(w_req, x), y), [w_req[n] for n in names])
        m = received if mix_with == "global" else w
        if mixing == "parameters":
            bar = {n: (alpha * v[n] + (1 - alpha) * m[n]).requires_grad_(True) for n in names}
            g_bar = torch.autograd.grad(cross_entropy(logits(bar, x), y), [bar[n] for n in names])
            g_v = [alpha * g for g in g_bar]
            g_alpha = sum(((v[n] - m[n]) * g).sum() for n, g in zip(names, g_bar))
        else:
            v_req = {n: t.clone().requires_grad_(True) for n, t in v.items()}
            a = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
            mixed = a * logits(v_req, x) + (1 - a) * logits(m, x)
            grads = torch.autograd.grad(cross_entropy(mixed, y), [*v_req.values(), a])
            g_v, g_alpha = grads[:-1], grads[-1]
        w = {n: w[n] - eta * g for n, g in zip(names, g_w)}
        v = {n: v[n] - eta * g for n, g in zip(names, g_v)}
        if adaptive:
            alpha = min(1.0, max(0.0, alpha - eta * float(g_alpha)))
    return w, v, alpha


def apfl_job(mixing: str, adaptive: bool = True, mix_with: str = "global"):
    job = job_for(
        {
            "algorithm": "apfl",
            "model": "logreg",
            "local-steps": TAU,
            "apfl-lr-decay": DECAY,
            "apfl-mixing": mixing,
            "apfl-adaptive": adaptive,
            "apfl-mix-with": mix_with,
        },
        state=RecordDict(),
    )
    job.model.double()
    x, y = job.train_loader.dataset.tensors
    # a fixed minibatch order, the same one the reference walks through
    job.train_loader = DataLoader(TensorDataset(x.double(), y), batch_size=BATCH, shuffle=False)
    batches = list(job.train_loader)[:TAU]
    assert len(batches) == TAU
    g = torch.Generator().manual_seed(11)
    w = {
        n: torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1
        for n, p in job.model.named_parameters()
    }
    v = {n: t + 0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in w.items()}
    with torch.no_grad():
        for n, p in job.model.named_parameters():
            p.copy_(w[n])
    return job, w, v, batches


@pytest.mark.parametrize("mix_with", ["global", "local"])
@pytest.mark.parametrize("mixing", ["parameters", "outputs"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_apfl_local_steps_equal_the_papers_update(mixing, adaptive, mix_with):
    job, w, v, batches = apfl_job(mixing, adaptive, mix_with)
    alpha0 = 0.35
    # this client's state from earlier rounds (v != w, alpha_0), in the store's contract
    job.store.save(V_KEY, v)
    job.store.save(
        ALPHA_KEY,
        {"alpha": torch.tensor([alpha0], dtype=torch.float64), "steps": torch.tensor([12])},
    )
    reply, _ = APFLClient().train(job, {"lr": ETA0, "apfl-round": ROUND})

    w_ref, v_ref, alpha_ref = reference(w, v, alpha0, batches, mixing, adaptive, mix_with)
    sent = reply.to_torch_state_dict()
    assert set(sent) == set(w)  # w travels; v and alpha do not
    for n in w:
        torch.testing.assert_close(sent[n], w_ref[n], rtol=1e-12, atol=1e-14)
    stored_v = job.store.load(V_KEY)
    for n in v:
        torch.testing.assert_close(stored_v[n], v_ref[n], rtol=1e-12, atol=1e-14)
    stored = job.store.load(ALPHA_KEY)
    assert float(stored["alpha"]) == pytest.approx(alpha_ref, rel=1e-12, abs=1e-14)
    assert int(stored["steps"]) == 12 + TAU
    if adaptive:
        assert abs(alpha_ref - alpha0) > 1e-3, "alpha must have moved for the test to bite"
    else:
        assert alpha_ref == alpha0
