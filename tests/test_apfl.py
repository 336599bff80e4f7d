"""APFL: the alpha and v gradients against finite differences / the chain rule, FedAvg's w
trajectory at alpha = 0, alpha's projection, and what stays on the client."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import job_for

from pflower.strategies import APFLClient, FedAvgClient
from pflower.task.split import get_tensors, set_tensors
from pflower.task.train import loss_fn

APFL = {"algorithm": "apfl", "model": "mlp", "local-steps": 5, "apfl-lr-decay": 1.0}


def _names(job):
    return [n for n, _ in job.model.named_parameters()]


def _v_w_batch(job, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {n: t.clone() for n, t in get_tensors(job.model, _names(job)).items()}
    v = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in w.items()}
    x, y = next(iter(job.train_loader))
    return v, w, x, y


def _f_at(job, params, x, y) -> torch.Tensor:
    set_tensors(job.model, params)
    return loss_fn(job.model)(job.model(x), y)


@pytest.mark.parametrize("mixing", ["parameters", "outputs"])
def test_alpha_gradient_equals_a_finite_difference(mixing):
    job = job_for({**APFL, "apfl-mixing": mixing})
    job.model.double()
    v, w, x, y = _v_w_batch(job)
    v = {n: t.double().requires_grad_(True) for n, t in v.items()}
    w = {n: t.double() for n, t in w.items()}
    alpha = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    loss = APFLClient()._mixed_loss(job, v, alpha, w, x.double(), y)
    (g_alpha,) = torch.autograd.grad(loss, [alpha])

    def f(a: float) -> float:
        with torch.no_grad():
            a_t = torch.tensor(a, dtype=torch.float64)
            return float(APFLClient()._mixed_loss(job, v, a_t, w, x.double(), y))

    h = 1e-6
    assert float(g_alpha) == pytest.approx((f(0.3 + h) - f(0.3 - h)) / (2 * h), rel=1e-6)
    job.model.float()


def test_v_gradient_is_alpha_times_the_gradient_at_v_bar():
    job = job_for(APFL)
    v, w, x, y = _v_w_batch(job)
    alpha = 0.3
    v_req = {n: t.clone().requires_grad_(True) for n, t in v.items()}
    loss = APFLClient()._mixed_loss(job, v_req, torch.tensor(alpha), w, x, y)
    g_v = torch.autograd.grad(loss, list(v_req.values()))
    # the gradient of f at the point v_bar, by the model's own backward
    v_bar = {n: alpha * v[n] + (1 - alpha) * w[n] for n in v}
    job.model.zero_grad()
    _f_at(job, v_bar, x, y).backward()
    for (_name, p), g in zip(job.model.named_parameters(), g_v):
        torch.testing.assert_close(g, alpha * p.grad, rtol=1e-5, atol=1e-7)


def test_alpha_zero_w_trajectory_is_fedavgs_bit_for_bit():
    settings = {**APFL, "apfl-alpha": 0.0, "apfl-adaptive": False}
    apfl_job, fedavg_job = job_for(settings), job_for({**settings, "algorithm": "fedavg"})
    start = get_tensors(apfl_job.model, _names(apfl_job))
    set_tensors(fedavg_job.model, start)
    apfl_reply, metrics = APFLClient().train(apfl_job, {"lr": 0.05, "apfl-round": 1})
    fedavg_reply, _ = FedAvgClient().train(fedavg_job, {"lr": 0.05})
    assert list(apfl_reply.keys()) == list(fedavg_reply.keys())
    for name in apfl_reply:
        np.testing.assert_array_equal(apfl_reply[name].numpy(), fedavg_reply[name].numpy())
    assert float(APFLClient()._state(apfl_job)[1]) == 0.0
    assert "alpha" not in metrics  # personal: never in a reply


def test_alpha_stays_in_unit_interval_and_state_stays_on_the_client():
    job = job_for({**APFL, "apfl-alpha": 0.5, "lr": 5.0})  # a step that overshoots
    half = APFLClient()
    reply, metrics = half.train(job, {"lr": 5.0, "apfl-round": 1})
    assert "alpha" not in metrics  # personal: never in a reply
    v, alpha, steps = half._state(job)
    assert 0.0 <= alpha <= 1.0 and steps == 5
    # the reply is w: not v
    w = {n: reply[n].numpy() for n in reply}
    assert any(not np.allclose(w[n], v[n].numpy()) for n in w)
    # state carries over to the next round
    half.train(job, {"lr": 0.01, "apfl-round": 2})
    assert half._state(job)[2] == 10


def test_step_size_follows_the_global_step_counter():
    """eta_t = eta_0 * decay^t with t = (round - 1) * tau + k: one step of round 3 with
    tau = 1 uses eta_0 * decay^2 (checked on w, whose step is plain SGD)."""
    settings = {**APFL, "local-steps": 1, "apfl-lr-decay": 0.5, "apfl-alpha": 0.0}
    job = job_for({**settings, "apfl-adaptive": False}, server_round=3)
    start = get_tensors(job.model, _names(job))
    x, y = next(iter(job.train_loader))  # the batch the step will draw (same seeded order)
    job.train_loader.generator.manual_seed(job.train_loader.generator.initial_seed())
    job.model.zero_grad()
    _f_at(job, start, x, y).backward()
    expected = {n: start[n] - 0.4 * 0.25 * p.grad for n, p in job.model.named_parameters()}
    set_tensors(job.model, start)
    job.train_loader.generator.manual_seed(job.train_loader.generator.initial_seed())
    reply, _ = APFLClient().train(job, {"lr": 0.4, "apfl-round": 3})
    for name in reply:
        torch.testing.assert_close(
            torch.from_numpy(reply[name].numpy()), expected[name], rtol=1e-5, atol=1e-7
        )


def test_one_schedule_the_decay_or_the_servers_never_both():
    """apfl-lr-decay < 1 with another lr-schedule than constant would compound two schedules:
    refused at start naming both keys, and by a client sent a scheduled round anyway."""
    from pflower.config import Config, ConfigError

    for schedule in ("linear", "exponential"):
        with pytest.raises(ConfigError, match="'apfl-lr-decay' = 0.99 and 'lr-schedule'"):
            Config.from_run_config(
                {"algorithm": "apfl", "apfl-lr-decay": 0.99, "lr-schedule": schedule}
            )
        Config.from_run_config({"algorithm": "apfl", "apfl-lr-decay": 1.0, "lr-schedule": schedule})
    Config.from_run_config({"algorithm": "apfl", "apfl-lr-decay": 0.99})  # constant: the decay
    job = job_for({**APFL, "apfl-lr-decay": 0.99})
    with pytest.raises(ValueError, match="'apfl-lr-decay' = 0.99 and 'lr-schedule' = factor 0.5"):
        APFLClient().train(job, {"lr": 0.02, "lr-scale": 0.5, "apfl-round": 1})


def test_with_no_decay_the_step_is_the_servers_scheduled_lr():
    """apfl-lr-decay = 1: eta is the message's lr (the server's schedule, applied once), in
    every round; checked on w's plain SGD step at round 7."""
    settings = {**APFL, "local-steps": 1, "apfl-alpha": 0.0, "lr-schedule": "linear"}
    job = job_for({**settings, "apfl-adaptive": False}, server_round=7)
    start = get_tensors(job.model, _names(job))
    x, y = next(iter(job.train_loader))
    job.train_loader.generator.manual_seed(job.train_loader.generator.initial_seed())
    job.model.zero_grad()
    _f_at(job, start, x, y).backward()
    expected = {n: start[n] - 0.02 * p.grad for n, p in job.model.named_parameters()}
    set_tensors(job.model, start)
    job.train_loader.generator.manual_seed(job.train_loader.generator.initial_seed())
    reply, _ = APFLClient().train(job, {"lr": 0.02, "lr-scale": 0.4, "apfl-round": 7})
    for name in reply:
        torch.testing.assert_close(
            torch.from_numpy(reply[name].numpy()), expected[name], rtol=1e-5, atol=1e-7
        )


def test_a_new_client_fine_tunes_v_with_w_fixed():
    job = job_for({**APFL, "finetune-epochs": 1, "apfl-alpha": 0.5})
    w = get_tensors(job.model, _names(job))
    metrics = APFLClient().evaluate(job, {"lr": 0.05})
    after = get_tensors(job.model, _names(job))
    for n in w:  # the received w is left as it was
        torch.testing.assert_close(after[n], w[n])
    assert metrics["personal-loss"] < metrics["global-loss"]  # v was fitted to this client
    assert "localized-accuracy" in metrics and 0 <= metrics["alpha"] <= 1


def test_evaluation_reports_v_alone_and_alpha():
    """The evaluation's ``local-part`` is v on its own (alpha = 1), evaluated here by the
    model's own forward with v's values loaded; ``alpha`` is the stored one; the model keeps
    the received w."""
    job = job_for({**APFL, "apfl-alpha": 0.3})
    half = APFLClient()
    half.train(job, {"lr": 0.05, "apfl-round": 1})
    w = {n: t.clone() for n, t in get_tensors(job.model, _names(job)).items()}
    v, alpha, _ = half._state(job)
    metrics = half.evaluate(job, {"lr": 0.05})
    assert metrics["alpha"] == alpha and alpha != 0.3  # it moved, and it is reported
    set_tensors(job.model, v)
    x, y = job.test_loader.dataset.tensors
    with torch.no_grad():
        out = job.model(x)
    accuracy = float((out.argmax(1) == y).float().mean())
    assert metrics["local-part-accuracy"] == pytest.approx(accuracy)
    assert metrics["local-part-loss"] == pytest.approx(float(loss_fn(job.model)(out, y)), rel=1e-5)
    set_tensors(job.model, w)
    with torch.no_grad():
        glob = job.model(x)
    assert metrics["global-accuracy"] == pytest.approx(float((glob.argmax(1) == y).float().mean()))


def test_data_passes_count_both_gradients_of_a_step():
    """Client compute: each of APFL's tau steps takes its minibatch through the model twice
    (w's gradient and v_bar's), so a round of tau steps of batch b on n examples reports
    2 tau b / n data passes (a FedAvg round of the same steps: tau b / n)."""
    job = job_for(APFL)
    batch, n, tau = job.cfg.batch_size, job.num_train, APFL["local-steps"]
    assert tau * batch <= n  # no short last batch among the steps
    _, metrics = APFLClient().train(job, {"lr": 0.01, "apfl-round": 1})
    assert metrics["data-passes"] == pytest.approx(2 * tau * batch / n)
    fedavg = job_for({**APFL, "algorithm": "fedavg"})
    _, plain = FedAvgClient().train(fedavg, {"lr": 0.01})
    assert plain["data-passes"] == pytest.approx(tau * batch / n)


@pytest.mark.parametrize("stored", [False, True])
def test_v_trained_on_another_device_comes_back_to_the_store(monkeypatch, stored):
    """On a GPU, v (loaded or initialised on the CPU) is trained as a device copy; the
    trained copy must reach the store (it never did: every round started from the untrained
    v). A transfer that copies, as one to a GPU does, stands in for the device here: the
    stored v, alpha and w must equal a run on the CPU itself, value for value."""
    import pflower.strategies.apfl as apfl

    first = job_for({**APFL, "apfl-alpha": 0.3})  # (the thread's model is shared by jobs)
    start = {n: t.clone() for n, t in get_tensors(first.model, _names(first)).items()}

    def run(copying: bool):
        job = job_for({**APFL, "apfl-alpha": 0.3})
        set_tensors(job.model, start)  # both runs from the same w
        half = APFLClient()
        if stored:  # a second round, from the state the first one stored
            half.train(job, {"lr": 0.05, "apfl-round": 1})
        if copying:
            monkeypatch.setattr(apfl, "_to_device", lambda t, device: t.detach().clone())
        reply, _ = half.train(job, {"lr": 0.05, "apfl-round": 2 if stored else 1})
        v, alpha, steps = half._state(job)
        monkeypatch.undo()
        return {n: reply[n].numpy() for n in reply}, v, alpha, steps

    w_cpu, v_cpu, alpha_cpu, steps_cpu = run(copying=False)
    w_dev, v_dev, alpha_dev, steps_dev = run(copying=True)
    assert (alpha_dev, steps_dev) == (alpha_cpu, steps_cpu)
    for n in v_cpu:
        assert torch.equal(v_dev[n], v_cpu[n]), n
        np.testing.assert_array_equal(w_dev[n], w_cpu[n])
    assert any(not torch.equal(v_dev[n], start[n]) for n in start)  # and v did train
