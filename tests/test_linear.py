"""FFGG's synthetic problem (§3.1): closed forms vs the model, CG exactness, and FFGG with
exact inner solves = gradient descent on F, step by step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import job_for

from pflower.strategies import FFGGClient
from pflower.task import linear
from pflower.task.split import get_tensors

SMALL = {
    "dataset": "synthetic-linear",
    "model": "synthetic-linear",
    "linear-n": 40,
    "linear-dtheta": 6,
    "linear-dw": 4,
    "batch-size": 1000,
    "algorithm": "ffgg",
    "ffgg-solver": "cg",
    "personal-steps": 4,
    "ffgg-init": "zeros",
    "split": "head",
}


def clients(n_clients=4, **kw):
    return [linear.make_client(m, n=40, d_theta=6, d_w=4, seed=0) for m in range(n_clients)]


def test_model_loss_is_f_m_over_2n_and_the_split_is_theta_shared_w_personal():
    job = job_for(SMALL)
    c = clients()[0]
    assert job.split.shared == ("theta.weight",) and job.split.personal == ("w.weight",)
    theta, w = np.random.default_rng(1).normal(size=6), np.random.default_rng(2).normal(size=4)
    with torch.no_grad():
        job.model.theta.weight.copy_(torch.tensor(theta)[None])
        job.model.w.weight.copy_(torch.tensor(w)[None])
    f = 0.5 * np.sum((c.H @ theta - c.b) ** 2) + 0.5 * np.sum((c.A @ theta + c.B @ w - c.y) ** 2)
    assert job.evaluate()["loss"] == pytest.approx(f / (2 * c.n), rel=1e-5)


@pytest.mark.parametrize("tau", [1, 4])
def test_cg_with_tau_equal_d_w_solves_the_inner_problem_exactly(tau):
    job = job_for({**SMALL, "personal-steps": tau})
    theta = np.random.default_rng(3).normal(size=6)
    with torch.no_grad():
        job.model.theta.weight.copy_(torch.tensor(theta, dtype=torch.float64)[None])
    FFGGClient().init_personal(job)
    FFGGClient().fine_tune_personal(job)
    w = get_tensors(job.model, ["w.weight"])["w.weight"].double().numpy().ravel()
    error = np.linalg.norm(w - clients()[0].best_w(theta)) / np.linalg.norm(w)
    if tau == 4:  # tau = d_w: exact, up to float64 rounding on an ill-conditioned B^T B
        assert error < 1e-8
    else:
        assert error > 1e-2


def independent_operator(theta: np.ndarray) -> np.ndarray:
    """F(theta) = mean_m F_m(theta) from each client's rows alone (no pflower formula): the
    mean loss is ||X z - t||^2 / (2 * 2n) with z = [theta, w]; at the best w,
    F_m(theta) = P^T Pi (P theta - t) / (2n), P = X[:, :d_theta], Pi = I - Q Q^+."""
    out = []
    for c in clients():
        X, t = c.rows()
        P, Q = X[:, :6], X[:, 6:]
        Pi = np.eye(len(t)) - Q @ np.linalg.pinv(Q)
        out.append(P.T @ Pi @ (P @ theta - t) / len(t))
    return np.mean(out, axis=0)


def test_ffgg_with_exact_inner_solves_is_gradient_descent_on_F():
    """Full participation, CG with tau = d_w, unweighted mean:
    theta^{r+1} = theta^r - gamma F(theta^r), F computed from the rows alone, in float64."""
    gamma = 20.0
    theta = np.zeros(6)
    reference = np.zeros(6)
    for _ in range(4):
        grads = []
        for pid in range(4):
            job = job_for(SMALL, partition_id=pid)
            with torch.no_grad():
                job.model.theta.weight.copy_(torch.tensor(theta, dtype=torch.float64)[None])
            record, _ = FFGGClient().train(job, {"lr": 0.0})
            grads.append(record.to_torch_state_dict()["theta.weight"].numpy().ravel())
        theta = theta - gamma * np.mean(grads, axis=0)
        reference = reference - gamma * independent_operator(reference)
        np.testing.assert_allclose(theta, reference, rtol=1e-9, atol=1e-12)
    # and the project's closed form agrees with the independent one
    np.testing.assert_allclose(
        linear.operator(clients(), theta), independent_operator(theta), rtol=1e-9, atol=1e-14
    )
    # heading for theta*: F shrinks
    assert np.linalg.norm(independent_operator(theta)) < np.linalg.norm(
        independent_operator(np.zeros(6))
    )


def test_optimum_zeroes_the_operator():
    cs = clients()
    assert np.linalg.norm(linear.operator(cs, linear.optimum(cs))) < 1e-10


@pytest.mark.parametrize(
    "algorithm", ["fedavg", "fedavg-ft", "local", "fedalt", "fedsim", "ffgg", "local-ffgg"]
)
def test_every_algorithm_runs_on_the_regression_problem(algorithm):
    from pflower.strategies import ALGORITHMS

    job = job_for(
        {**SMALL, "algorithm": algorithm, "ffgg-solver": "sgd", "batch-size": 16, "lr": 0.1}
    )
    half = ALGORITHMS[algorithm].client
    record, metrics = half.train(job, {"lr": 0.1, "lr-scale": 1.0})
    assert metrics["num-examples"] == 80 and all(
        torch.isfinite(t).all() for t in record.to_torch_state_dict().values()
    )
    out = half.evaluate(job, {"final": True})
    assert "personal-loss" in out and "personal-accuracy" not in out  # regression: no accuracy


def test_cg_reports_the_examples_it_processed_when_it_stops_early(monkeypatch):
    """CG stops once converged (d_w = 4 dimensions, 20 iterations asked): it reports one pass
    for the gradient and two per Hessian-vector product it took, not 2 n x 20."""
    job = job_for({**SMALL, "personal-steps": 20})
    FFGGClient().init_personal(job)
    calls, grad = [], torch.autograd.grad

    def counting(*args, **kwargs):
        calls.append(1)
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    seen = FFGGClient().fine_tune_personal(job)
    monkeypatch.undo()
    products = len(calls) - 1  # the first call is the gradient itself
    n = job.num_train
    assert products < 20, "the test needs CG to stop early"
    assert seen == n * (1 + 2 * products)
    _, metrics = FFGGClient().train(job, {"lr": 0.1})
    assert metrics["data-passes"] == pytest.approx(1 + 2 * products + 1)  # + the theta-gradient


def test_local_gd_round_is_tau_closed_form_gradient_steps_on_the_whole_model():
    from pflower.strategies import LocalGDClient

    job = job_for({**SMALL, "algorithm": "local-gd", "local-steps": 3, "split": "head"})
    x, t = clients()[0].rows()
    z = np.random.default_rng(5).normal(size=10)  # (theta, w)
    with torch.no_grad():
        job.model.theta.weight.copy_(torch.tensor(z[:6], dtype=torch.float32)[None])
        job.model.w.weight.copy_(torch.tensor(z[6:], dtype=torch.float32)[None])
    record, metrics = LocalGDClient().train(job, {"lr": 0.5})
    for _ in range(3):  # gradient of the mean loss f_m / (2n): X^T (X z - t) / (2n)
        z = z - 0.5 * x.T @ (x @ z - t) / len(t)
    sent = record.to_torch_state_dict()
    assert list(sent) == ["theta.weight", "w.weight"]  # non-personalized: everything travels
    assert np.allclose(sent["theta.weight"].double().numpy().ravel(), z[:6], rtol=1e-4)
    assert np.allclose(sent["w.weight"].double().numpy().ravel(), z[6:], rtol=1e-4)
    assert metrics["data-passes"] == 3
