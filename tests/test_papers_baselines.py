"""FedBABU's fixed head, its fine-tuning, Ditto's personal model at evaluation, and the keys
of the three baselines (their whole rounds: ``test_exact_rounds.py``)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict
from helpers import job_for

from pflower.config import Config, ConfigError
from pflower.strategies import ALGORITHMS
from pflower.strategies.fedbabu import fixed_head
from pflower.task.split import set_tensors

CONFIG = {"lr": 0.05, "server-round": 1}


def _head_and_body(job):
    params = dict(job.model.named_parameters())
    head = {n: params[n].detach().clone() for n in job.split.personal}
    body = {n: params[n].detach().clone() for n in job.split.shared}
    return head, body


def test_fedbabus_head_has_orthonormal_rows_is_the_same_everywhere_and_never_trained():
    jobs = [job_for({"algorithm": "fedbabu"}, partition_id=p) for p in (0, 1)]
    half = ALGORITHMS["fedbabu"].client
    heads = []
    for job in jobs:
        _, body_before = _head_and_body(job)
        half.train(job, CONFIG)
        head, body = _head_and_body(job)
        heads.append(head)
        assert any(not torch.equal(body[n], body_before[n]) for n in body)  # the body learned
    (weight,) = [t for t in heads[0].values() if t.dim() == 2]
    (bias,) = [t for t in heads[0].values() if t.dim() == 1]
    assert weight.shape[0] <= weight.shape[1]  # 10 classes, a wider hidden layer
    gram = weight.double() @ weight.double().T
    torch.testing.assert_close(
        gram, torch.eye(weight.shape[0], dtype=torch.float64), atol=1e-6, rtol=0
    )
    assert torch.count_nonzero(bias) == 0
    for n in heads[0]:  # both clients computed the same H and training left it as it was
        assert torch.equal(heads[0][n], heads[1][n])
    other = fixed_head(heads[0], seed=1)
    assert not torch.equal(other[next(iter(other))], heads[0][next(iter(heads[0]))])


def test_fedbabu_pretraining_sends_the_fixed_head_back_as_it_came():
    job = job_for({"algorithm": "fedbabu"})
    record, _ = ALGORITHMS["fedbabu"].client.pretrain(job, {**CONFIG, "phase": "pretrain"})
    head = fixed_head(job.init_personal, job.cfg.seed)
    for name, value in head.items():
        assert torch.equal(torch.from_numpy(record[name].numpy()), value)


@pytest.mark.parametrize("mode", ["full", "head"])
def test_fedbabu_fine_tunes_the_whole_model_or_only_the_head(mode):
    job = job_for({"algorithm": "fedbabu", "fedbabu-finetune": mode, "finetune-epochs": 1})
    half = ALGORITHMS["fedbabu"].client
    half.new_client(job)
    head0, body0 = _head_and_body(job)
    half.personalize(job)
    head, body = _head_and_body(job)
    assert any(not torch.equal(head[n], head0[n]) for n in head)
    body_moved = any(not torch.equal(body[n], body0[n]) for n in body)
    assert body_moved == (mode == "full")


def test_fedbabu_refuses_a_split_without_a_head():
    with pytest.raises(ConfigError, match="key 'split' = 'input'.*fedbabu"):
        Config.from_run_config({"algorithm": "fedbabu", "split": "input"})
    with pytest.raises(ConfigError, match="fedbabu-finetune"):
        Config.from_run_config({"algorithm": "fedbabu", "fedbabu-finetune": "body"})


def test_ditto_evaluates_its_own_v_and_the_received_w_as_the_global_model():
    state = RecordDict()
    half = ALGORITHMS["ditto"].client
    job = job_for({"algorithm": "ditto", "ditto-lambda": 0.1}, state=state)
    received = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    reply, metrics = half.train(job, CONFIG)
    v = {n: p.detach().clone() for n, p in job.model.named_parameters()}  # v_k, as stored
    assert metrics["data-passes"] == pytest.approx(2.0)  # the global epoch and the personal one
    for name, value in v.items():  # the reply is w_k, not v_k
        assert not torch.equal(torch.from_numpy(reply[name].numpy()), value)
    fresh = job_for({"algorithm": "ditto", "ditto-lambda": 0.1}, state=state, server_round=2)
    set_tensors(fresh.model, received)  # the next message's w (the model object is reused)
    half.new_client(fresh)  # the global model: the received w, as it came
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p.detach(), received[name])
    half.personalize(fresh)
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p.detach(), v[name])
    never = job_for({"algorithm": "ditto"}, partition_id=3)  # never trained: v is w
    set_tensors(never.model, received)
    half.personalize(never)
    for name, p in never.model.named_parameters():
        assert torch.equal(p.detach(), received[name])


@pytest.mark.parametrize(
    "key, value", [("fedprox-mu", -0.1), ("ditto-lambda", -1.0), ("fedprox-mu", float("nan"))]
)
def test_the_baselines_weights_are_checked_at_start(key, value):
    with pytest.raises(ConfigError, match=key):
        Config.from_run_config({key: value})
