"""Models and splits: presets are disjoint and complete on every model; no buffers."""

from __future__ import annotations

import pytest
import torch

from pflower.settings import MODELS as ALL_MODELS
from pflower.settings import SPLITS
from pflower.task.models import ConvAdapter, MLPAdapter, build_model
from pflower.task.split import get_tensors, make_split, set_tensors

MODELS = [m for m in ALL_MODELS if m != "synthetic-linear"]  # tested in test_linear.py
SHAPES = {
    "logreg": (1, 28, 28),
    "mlp": (1, 28, 28),
    "pflego-mlp": (1, 28, 28),
    "cnn-cifar": (3, 32, 32),
    "cnn-apfl": (3, 32, 32),
    "conv4": (1, 28, 28),
    "resnet18-gn": (1, 28, 28),
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("adapters", [False, True])
def test_split_presets_are_disjoint_and_complete(name, adapters):
    if adapters and name == "logreg":
        with pytest.raises(ValueError, match="no adapters"):
            build_model(name, SHAPES[name], 10, adapters=True)
        return
    model = build_model(name, SHAPES[name], 10, adapters=adapters)
    every = [n for n, _ in model.named_parameters()]
    for preset in SPLITS:
        if preset == "adapter" and not adapters:
            with pytest.raises(ValueError, match="no adapters"):
                make_split(model, preset)
            continue
        split = make_split(model, preset)
        assert not set(split.shared) & set(split.personal)
        assert sorted(split.shared + split.personal) == sorted(every)
        assert split.num_shared + split.num_personal == sum(p.numel() for p in model.parameters())
    assert make_split(model, "none").personal == ()
    assert make_split(model, "full").shared == ()


@pytest.mark.parametrize("name", MODELS)
def test_head_is_the_output_layer_and_input_the_first(name):
    model = build_model(name, SHAPES[name], 7)
    head = make_split(model, "head")
    weights = [n for n in head.personal if n.endswith("weight")]
    assert len(weights) == 1
    assert dict(model.named_parameters())[weights[0]].shape[0] == 7  # produces the logits
    first = make_split(model, "input").personal
    assert first[0] == next(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("name", MODELS)
def test_no_batchnorm_and_no_buffers(name):
    model = build_model(name, SHAPES[name], 10, adapters=name != "logreg")
    assert not list(model.buffers())
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_adapter_split_holds_adapters_and_norms_only():
    model = build_model("resnet18-gn", (1, 28, 28), 10, adapters=True)
    split = make_split(model, "adapter")
    modules = dict(model.named_modules())
    for name in split.personal:
        owner = name.rsplit(".", 1)[0]
        parts = owner.split(".")
        chain = [modules[".".join(parts[:i])] for i in range(1, len(parts) + 1)]
        assert any(isinstance(m, (ConvAdapter, MLPAdapter, torch.nn.GroupNorm)) for m in chain)
    # an adapter after each of the two convs of each of the 8 basic blocks
    assert sum(isinstance(m, ConvAdapter) for m in model.modules()) == 16


@pytest.mark.parametrize("name", ["mlp", "conv4"])
def test_adapters_start_near_identity_and_identical_across_builds(name):
    x = torch.rand(4, *SHAPES[name])
    plain, adapted = (
        build_model(name, SHAPES[name], 10),
        build_model(name, SHAPES[name], 10, adapters=True),
    )
    again = build_model(name, SHAPES[name], 10, adapters=True)
    for (n1, p1), (n2, p2) in zip(adapted.named_parameters(), again.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    adapter_modules = [m for m in adapted.modules() if isinstance(m, (ConvAdapter, MLPAdapter))]
    h = torch.rand(2, 64) if name == "mlp" else torch.rand(2, 64, 5, 5)
    for m in adapter_modules[:1]:
        if isinstance(m, MLPAdapter):
            h = torch.rand(2, m.down.in_features)
        out = m(h)
        assert torch.allclose(out, h, atol=1e-2)
        assert not torch.equal(out, h)
    assert plain(x).shape == adapted(x).shape


def test_patterns_split_and_unknown_pattern():
    model = build_model("mlp", (1, 28, 28), 10)
    split = make_split(model, patterns=["1.*"])
    assert split.personal == ("1.weight", "1.bias")
    with pytest.raises(ValueError, match="matches no parameter"):
        make_split(model, patterns=["fc.*"])


def test_get_and_set_tensors_roundtrip_and_shape_check():
    a, b = build_model("mlp", (1, 28, 28), 10, seed=1), build_model("mlp", (1, 28, 28), 10, seed=2)
    head = make_split(a, "head").personal
    set_tensors(b, get_tensors(a, head))
    for n in head:
        assert torch.equal(dict(a.named_parameters())[n], dict(b.named_parameters())[n])
    with pytest.raises(ValueError, match="shape"):
        set_tensors(b, {head[0]: torch.zeros(3, 3)})


def test_image_models_refuse_flat_inputs_and_too_small_images():
    with pytest.raises(ValueError, match="image inputs"):
        build_model("conv4", (60,), 10)
    with pytest.raises(ValueError, match="cannot take inputs"):
        build_model("cnn-apfl", (1, 8, 8), 10)
