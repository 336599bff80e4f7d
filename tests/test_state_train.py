"""Personal-state stores and the shared training primitive."""

from __future__ import annotations

import logging

import torch
from flwr.app import RecordDict
from torch.utils.data import DataLoader, TensorDataset

from pflower.context_store import ContextStore, open_store
from pflower.task.models import build_model
from pflower.task.split import make_split, parameters
from pflower.task.state import DirectoryStore, load_matching
from pflower.task.train import SGDSteps, evaluate, sgd


def tensors():
    return {"w": torch.randn(3, 4), "alpha": torch.tensor(0.25)}


def test_context_store_roundtrip():
    state = RecordDict()
    store = ContextStore(state)
    assert store.load("personal") is None
    t = tensors()
    store.save("personal", t)
    back = store.load("personal")
    assert set(back) == {"w", "alpha"} and torch.equal(back["w"], t["w"])
    assert "pflower.personal" in state


def test_directory_store_roundtrip_and_survives_a_new_instance(tmp_path):
    t = tensors()
    DirectoryStore(tmp_path).save("personal", t)
    back = DirectoryStore(tmp_path).load("personal")  # e.g. after a SuperNode restart
    assert torch.equal(back["w"], t["w"]) and float(back["alpha"]) == 0.25
    assert [p.name for p in tmp_path.iterdir()] == ["personal.pt"]  # no temp file left


def test_directory_store_corrupt_file_means_no_state(tmp_path, caplog):
    (tmp_path / "personal.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        assert DirectoryStore(tmp_path).load("personal") is None
    assert "unreadable" in caplog.text


def test_open_store_follows_node_config(tmp_path):
    assert isinstance(open_store(RecordDict(), {}), ContextStore)
    assert isinstance(open_store(RecordDict(), {"state-dir": str(tmp_path)}), DirectoryStore)


def test_load_matching_rejects_other_shapes():
    store = ContextStore(RecordDict())
    store.save("personal", {"w": torch.zeros(2, 2)})
    assert load_matching(store, "personal", {"w": torch.ones(2, 2)}) is not None
    assert load_matching(store, "personal", {"w": torch.ones(3, 2)}) is None
    assert load_matching(store, "personal", {"v": torch.ones(2, 2)}) is None


def _loader(n=64, batch=16):
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g)


def test_sgd_updates_only_the_given_parameters_even_with_weight_decay():
    model = build_model("mlp", (1, 28, 28), 10)
    split = make_split(model, "head")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = sgd(
        model,
        parameters(model, split.personal),
        _loader(),
        lr=0.1,
        epochs=2,
        weight_decay=0.1,
        momentum=0.9,
        max_grad_norm=1.0,
    )
    assert result.steps == 8 and result.examples == 128
    for n, p in model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == (n in split.personal), n
    assert all(p.requires_grad for p in model.parameters())  # freezing is undone


def test_sgd_steps_cycle_over_the_loader_and_match_a_hand_step():
    model = build_model("logreg", (1, 28, 28), 10)
    loader = _loader(n=16, batch=16)  # one batch: the step is deterministic
    x, y = next(iter(loader))
    w0 = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    result = sgd(model, list(model.parameters()), loader, lr=0.5, steps=1)
    assert result.steps == 1
    for p, p0, g in zip(model.parameters(), w0, grads):
        assert torch.allclose(p, p0 - 0.5 * g, atol=1e-6)
    assert sgd(model, list(model.parameters()), loader, lr=0.5, steps=5).steps == 5


def test_sgd_steps_are_torch_optim_sgd_bit_for_bit():
    """``SGDSteps`` against ``torch.optim.SGD`` on twin models, five steps: two groups with
    their own rates, momentum and weight decay (buffers across steps), a parameter that gets
    no gradient (skipped by both); and the first two momentum steps written out by hand."""
    torch.manual_seed(0)
    twins = [build_model("mlp", (1, 28, 28), 10) for _ in range(2)]
    twins[1].load_state_dict(twins[0].state_dict())
    x, y = torch.rand(5, 8, 1, 28, 28), torch.randint(0, 10, (5, 8))

    def groups(model):
        params = list(model.parameters())  # weight, bias of layers 1, 3, 5
        model[1].bias.requires_grad_(False)  # in a group, but it gets no gradient
        return [{"params": params[2:4], "lr": 0.3}, {"params": [*params[:2], *params[4:]]}]

    settings = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}
    steps, reference = (
        SGDSteps(groups(twins[0]), **settings),
        torch.optim.SGD(groups(twins[1]), **settings),
    )
    start = [p.detach().clone() for p in twins[0].parameters()]
    by_hand, buffer = start[2].clone(), None
    for k in range(5):
        for model, opt in ((twins[0], steps), (twins[1], reference)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[k]), y[k]).backward()
            if model is twins[0] and k < 2:  # d = g + wd * p; b = d, then 0.9 b + d
                d = model[3].weight.grad + 0.05 * by_hand
                buffer = d.clone() if buffer is None else 0.9 * buffer + d
                by_hand = by_hand - 0.3 * buffer
            opt.step()
        for a, b in zip(twins[0].parameters(), twins[1].parameters()):
            assert torch.equal(a, b)
        if k < 2:
            assert torch.allclose(twins[0][3].weight, by_hand, atol=1e-6)
    assert torch.equal(twins[0][1].bias, start[1])  # no gradient: not moved, not decayed
    assert not torch.equal(twins[0][3].weight, start[2])


def test_evaluate_counts_correct_predictions():
    model = build_model("logreg", (1, 28, 28), 10)
    loader = DataLoader(_loader(n=40).dataset, batch_size=7)
    out = evaluate(model, loader)
    batches = list(loader)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert out["num-examples"] == 40
    assert out["correct"] == int((model(x).argmax(1) == y).sum())
