"""FedAlt / FedSim: the local updates, personal state, and the server optimizers, each
checked against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from helpers import BASE, job_for
from torch.nn import functional as F

from pflower.client_app import build_client_app
from pflower.config import Config, ConfigError
from pflower.strategies import FedAltClient, FedSimClient, get_algorithm
from pflower.strategies.client import ClientJob
from pflower.strategies.server_opt import ServerOptimizer, client_lr
from pflower.task.split import get_tensors


def snapshot(job: ClientJob) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in job.model.named_parameters()}


def test_localalt_phases_freeze_the_other_part_bitwise(monkeypatch):
    job = job_for({"algorithm": "fedalt", "weight-decay": 0.1, "momentum": 0.5})
    phases = []
    original = ClientJob.sgd

    def recording(self, params, **kw):
        before = snapshot(self)
        result = original(self, params, **kw)
        phases.append((before, snapshot(self)))
        return result

    monkeypatch.setattr(ClientJob, "sgd", recording)
    FedAltClient().train(job, {"lr": 0.1, "lr-scale": 1.0})
    (v_before, v_after), (u_before, u_after) = phases
    shared, personal = job.split.shared, job.split.personal
    assert all(torch.equal(v_before[n], v_after[n]) for n in shared)  # u frozen in v-phase
    assert all(not torch.equal(v_before[n], v_after[n]) for n in personal)
    assert all(torch.equal(u_before[n], u_after[n]) for n in personal)  # v frozen in u-phase
    assert all(not torch.equal(u_before[n], u_after[n]) for n in shared)
    assert all(torch.equal(v_after[n], u_before[n]) for n in personal)  # u-phase at the NEW v


def test_localsim_first_step_is_a_hand_computed_joint_sgd_step():
    overrides = {
        "algorithm": "fedsim",
        "local-steps": 1,
        "batch-size": 10_000,
        "lr": 0.3,
        "personal-lr": 0.7,
    }
    job = job_for(overrides)
    x, y = next(iter(job.train_loader))  # the whole local set: one deterministic batch
    start = snapshot(job)
    params = dict(job.model.named_parameters())
    loss = F.cross_entropy(job.model(x), y)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    expected = {n: start[n] - (0.7 if n in job.split.personal else 0.3) * grads[n] for n in params}

    record, _ = FedSimClient().train(job, {"lr": 0.3, "lr-scale": 1.0})
    for name, array in record.to_torch_state_dict().items():
        assert torch.allclose(array, expected[name], atol=1e-6), name
    stored = job.store.load("personal")
    for name in job.split.personal:
        assert torch.allclose(stored[name], expected[name], atol=1e-6), name


def _train_message(job_shared: ArrayRecord, server_round: int) -> Message:
    content = RecordDict(
        {
            "arrays": job_shared,
            "config": ConfigRecord(
                {"server-round": server_round, "lr": 0.1, "lr-scale": 1.0, "phase": "train"}
            ),
        }
    )
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


@pytest.mark.parametrize("stateful", [True, False])
def test_personal_state_persists_only_for_stateful_and_only_where_sampled(
    task_identity, monkeypatch, stateful
):
    overrides = {**BASE, "algorithm": "fedalt", "stateful": stateful}
    app = build_client_app(overrides)
    contexts = {
        pid: Context(
            run_id=1,
            node_id=pid + 1,
            state=RecordDict(),
            run_config={},
            node_config={"partition-id": pid, "num-partitions": 4},
        )
        for pid in (0, 1)
    }
    starts = []
    original = FedAltClient.start_personal

    def record_start(self, job):
        original(self, job)
        starts.append(get_tensors(job.model, job.split.personal))

    monkeypatch.setattr(FedAltClient, "start_personal", record_start)
    probe = job_for(overrides)
    shared = ArrayRecord(get_tensors(probe.model, probe.split.shared))
    init = probe.init_personal

    app(_train_message(shared, 1), contexts[0])  # client 0 sampled in rounds 1 and 3
    after_round_1 = (
        contexts[0].state["pflower.personal"].to_torch_state_dict() if stateful else None
    )
    app(_train_message(shared, 3), contexts[0])

    assert all(torch.equal(starts[0][n], init[n]) for n in init)  # first contact: the init
    if stateful:
        assert all(torch.equal(starts[1][n], after_round_1[n]) for n in init)
        assert not all(torch.equal(starts[1][n], init[n]) for n in init)
    else:
        assert all(torch.equal(starts[1][n], init[n]) for n in init)  # reset every time
        assert "pflower.personal" not in contexts[0].state
    assert len(contexts[1].state) == 0  # a client never sampled is untouched


def test_server_adam_matches_the_adam_formula_across_rounds():
    rng = np.random.default_rng(0)
    lr, (b1, b2), eps = 0.05, (0.9, 0.99), 1e-6
    opt = ServerOptimizer("adam", lr, (b1, b2), eps)
    u = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
    m = {k: np.zeros_like(v) for k, v in u.items()}
    v = {k: np.zeros_like(v) for k, v in u.items()}
    ref = {k: x.copy() for k, x in u.items()}
    for t in range(1, 5):
        delta = {k: rng.normal(size=x.shape) for k, x in u.items()}  # u(t) - u_bar
        u = opt.step(u, delta)
        for k in ref:  # Kingma & Ba, bias-corrected, as torch.optim.Adam documents it
            m[k] = b1 * m[k] + (1 - b1) * delta[k]
            v[k] = b2 * v[k] + (1 - b2) * delta[k] ** 2
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            ref[k] = ref[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
            assert np.allclose(u[k], ref[k], atol=1e-12), (t, k)


def test_server_sgd_with_lr_one_is_the_mean_and_lr_half_moves_half_way():
    current = {"w": np.array([1.0, 2.0, 3.0])}
    mean = {"w": np.array([0.0, 4.0, 3.5])}
    delta = {"w": current["w"] - mean["w"]}
    assert np.allclose(ServerOptimizer("sgd", 1.0).step(current, delta)["w"], mean["w"])
    assert np.allclose(ServerOptimizer("sgd", 0.5).step(current, delta)["w"], [0.5, 3.0, 3.25])


def test_client_lr_schedules():
    assert [client_lr(1.0, t, 10, "constant") for t in (1, 10)] == [1.0, 1.0]
    lin = [client_lr(1.0, t, 10, "linear", warmup_fraction=0.2) for t in range(1, 11)]
    assert lin[:2] == [0.5, 1.0]  # warm-up over 2 rounds
    assert lin[2] == 1.0 and lin[-1] == pytest.approx(1 / 8)  # then linear decay towards 0
    assert all(a >= b for a, b in zip(lin[1:], lin[2:]))
    exp = [client_lr(0.8, t, 100, "exponential", halve_every=3) for t in (1, 3, 4, 7)]
    assert exp == [0.8, 0.8, 0.4, 0.2]


def test_fedrep_and_fedper_are_aliases_with_the_head_split():
    assert get_algorithm("fedrep").strategy is get_algorithm("fedalt").strategy
    assert get_algorithm("fedper").client.__class__ is get_algorithm("fedsim").client.__class__
    with pytest.raises(ConfigError, match="'fedrep' is 'fedalt' with the head split"):
        Config.from_run_config({"algorithm": "fedrep", "split": "input"})


def test_final_evaluation_fine_tunes_and_stores_v_for_stateful_clients():
    job = job_for({"algorithm": "fedalt", "finetune-epochs": 2})
    client = FedAltClient()
    client.train(job, {"lr": 0.1, "lr-scale": 1.0})
    stored = job.store.load("personal")
    client.personalize(job, final=False)  # intermediate: the stored v as it is
    assert all(torch.equal(p, stored[n]) for n, p in job.model.named_parameters() if n in stored)
    client.personalize(job, final=True)  # final: v-only fine-tuning, kept as the client's v
    tuned = job.store.load("personal")
    assert not all(torch.equal(tuned[n], stored[n]) for n in stored)
