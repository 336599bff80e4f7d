"""Models by name, with optional adapters. No BatchNorm anywhere.

BatchNorm running statistics are buffers that can be neither averaged meaningfully across
clients nor mixed as APFL mixes parameters, so every model here uses GroupNorm or no norm
at all, and has no buffers: ``model.parameters()`` is its whole state.

Adapters (Pillutla et al. 2022, "adapter" split): small residual modules initialised near
zero, so that at start they are the identity. Convolutional models get ``x + Conv1x1(GN(x))``
after each convolution (after each conv of each basic block in the ResNet); MLPs get a
bottleneck ``x + Up(ReLU(Down(x)))`` after each hidden layer. ``build_model`` seeds the
initialisation, so every client (and the server) builds identical adapters.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import threading
from collections.abc import Sequence

import torch
from torch import nn

# The FedAlt/FedSim paper initialises adapters from "N(0, 1e-4)"; read in torch's
# normal_(mean, std) convention: std 1e-4, so each adapter starts within ~1e-3 of the identity.
ADAPTER_INIT_STD = 1e-4
MLP_ADAPTER_HIDDEN = 16


def _groups(channels: int) -> int:
    """Number of GroupNorm groups: the largest divisor of ``channels`` up to 32."""
    return math.gcd(channels, 32)


class ConvAdapter(nn.Module):
    """Residual 1x1-conv adapter ``x + Conv1x1(GN(x))``, the identity at initialisation."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(_groups(channels), channels)
        self.conv = nn.Conv2d(channels, channels, kernel_size=1, bias=False)
        nn.init.normal_(self.conv.weight, std=ADAPTER_INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(self.norm(x))


class MLPAdapter(nn.Module):
    """Bottleneck adapter ``x + Up(ReLU(Down(x)))`` with ``Up`` initialised near zero."""

    def __init__(self, width: int, hidden: int = MLP_ADAPTER_HIDDEN) -> None:
        super().__init__()
        self.down = nn.Linear(width, hidden)
        self.up = nn.Linear(hidden, width)
        nn.init.normal_(self.up.weight, std=ADAPTER_INIT_STD)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.relu(self.down(x)))


def _mlp(sizes: Sequence[int], num_classes: int, adapters: bool) -> nn.Sequential:
    """Flatten, hidden ReLU layers of ``sizes[1:]``, then a linear output layer."""
    layers: list[nn.Module] = [nn.Flatten()]
    for d_in, d_out in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
        if adapters:
            layers.append(MLPAdapter(d_out))
    layers.append(nn.Linear(sizes[-1], num_classes))
    return nn.Sequential(*layers)


def _conv(c_in: int, c_out: int, k: int, padding: int, adapters: bool) -> list[nn.Module]:
    block: list[nn.Module] = [nn.Conv2d(c_in, c_out, k, padding=padding)]
    if adapters:
        block.append(ConvAdapter(c_out))
    return block + [nn.ReLU()]


def _with_head(
    name: str,
    features: nn.Sequential,
    input_shape: tuple[int, ...],
    hidden: Sequence[int],
    num_classes: int,
) -> nn.Sequential:
    """Append flatten, hidden FC layers and the output layer, sizing the first FC layer."""
    try:
        with torch.no_grad():
            flat = features(torch.zeros(1, *input_shape)).flatten(1).shape[1]
    except RuntimeError as err:
        raise ValueError(
            f"model {name!r} cannot take inputs of shape {tuple(input_shape)}: {err}"
        ) from None
    layers: list[nn.Module] = [*features, nn.Flatten()]
    for d_in, d_out in zip([flat, *hidden[:-1]], hidden):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    layers.append(nn.Linear(hidden[-1] if hidden else flat, num_classes))
    return nn.Sequential(*layers)


def _resnet18_gn(in_channels: int, num_classes: int, adapters: bool) -> nn.Module:
    """torchvision ResNet-18 with GroupNorm, a 3x3 stem and no first max-pool (28x28 inputs)."""
    torchvision = optional("torchvision", "vision")  # only this model needs it
    model = torchvision.models.resnet18(
        num_classes=num_classes, norm_layer=lambda c: nn.GroupNorm(_groups(c), c)
    )
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    if adapters:
        for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
            for block in layer:
                block.conv1 = nn.Sequential(block.conv1, ConvAdapter(block.conv1.out_channels))
                block.conv2 = nn.Sequential(block.conv2, ConvAdapter(block.conv2.out_channels))
    return model


def optional(module: str, extra: str):
    """``module``, imported now; an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{module} is not installed: pip install 'pflower[{extra}]' (or 'pflower[app]')"
        ) from err


#: torch's global generator is one per process; code that must draw from it (a layer's
#: ``reset_parameters``, a seeded model build) holds this lock, so that clients trained side
#: by side in threads (``LocalGrid(workers=...)``) draw exactly what they draw alone.
GLOBAL_RNG = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int):
    """Torch's global generator seeded with ``seed`` inside, restored after; thread-safe."""
    with GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    adapters: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Build model ``name`` for inputs of ``input_shape`` (no batch dimension).

    The initialisation is seeded, so the server and every client build the same model.
    ``adapters=True`` inserts the adapters of the ``adapter`` split.
    """
    shape = tuple(int(s) for s in input_shape)
    image_models = ("cnn-cifar", "cnn-apfl", "conv4", "resnet18-gn")
    if name in image_models and len(shape) != 3:
        raise ValueError(
            f"model {name!r} needs image inputs (channels, height, width); the data set "
            f"gives inputs of shape {shape}: use 'logreg', 'mlp' or 'pflego-mlp'"
        )
    if adapters and name == "logreg":
        raise ValueError("model 'logreg' has no hidden layer, so no adapters: choose another split")
    flat = math.prod(shape)
    with seeded(seed):
        if name == "logreg":
            model: nn.Module = nn.Sequential(nn.Flatten(), nn.Linear(flat, num_classes))
        elif name == "mlp":  # APFL's MLP 2x200
            model = _mlp([flat, 200, 200], num_classes, adapters)
        elif name == "pflego-mlp":  # PFLEGO: body 784->200 (ReLU), linear head
            model = _mlp([flat, 200], num_classes, adapters)
        elif name == "cnn-cifar":  # PFLEGO's CIFAR-10 CNN, 'same' padding; body ends at FC192
            features = nn.Sequential(
                *_conv(shape[0], 64, 5, 2, adapters),
                nn.MaxPool2d(3, 2, padding=1),
                *_conv(64, 64, 5, 2, adapters),
                nn.MaxPool2d(3, 2, padding=1),
            )
            model = _with_head(name, features, shape, [384, 192], num_classes)
        elif name == "cnn-apfl":  # APFL: conv5x5 ->20, pool, conv5x5 ->50, pool, FC 512
            features = nn.Sequential(
                *_conv(shape[0], 20, 5, 0, adapters),
                nn.MaxPool2d(2),
                *_conv(20, 50, 5, 0, adapters),
                nn.MaxPool2d(2),
            )
            model = _with_head(name, features, shape, [512], num_classes)
        elif name == "conv4":  # Omniglot: 4 x [conv64 3x3, ReLU, maxpool 2]
            blocks: list[nn.Module] = []
            for c_in in (shape[0], 64, 64, 64):
                blocks += [*_conv(c_in, 64, 3, 1, adapters), nn.MaxPool2d(2)]
            model = _with_head(name, nn.Sequential(*blocks), shape, [], num_classes)
        elif name == "resnet18-gn":
            model = _resnet18_gn(shape[0], num_classes, adapters)
        else:
            raise ValueError(f"unknown model {name!r}")
    if any(True for _ in model.buffers()):
        raise AssertionError(f"model {name!r} has buffers; pflower models must have none")
    return model


def import_object(path: str, key: str = "model"):
    """The object named by ``module.path:attribute`` (the ``model`` / ``loss`` keys)."""
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"key {key!r} = {path!r}: cannot import {module_name!r} ({err})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"key {key!r} = {path!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def build_user_model(
    path: str, input_shape: Sequence[int], num_classes: int, *, seed: int = 0
) -> nn.Module:
    """A model of your own: ``module:Class`` (or a factory function) returning an ``nn.Module``.

    It is called with the keyword arguments it declares among ``input_shape`` (a tuple, no
    batch dimension) and ``num_classes`` (classes, or outputs of a regression model), under
    ``torch.manual_seed(seed)`` so that the server and every client build the same initial
    model. Any parameter names work; choose the personal ones with ``split-patterns``.
    """
    factory = import_object(path)
    if not callable(factory):
        raise ValueError(f"key 'model' = {path!r}: not a class or function")
    offered = {"input_shape": tuple(int(s) for s in input_shape), "num_classes": num_classes}
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature: call with nothing
        accepted = {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in accepted}
    with seeded(seed):
        model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"key 'model' = {path!r}: returned {type(model).__name__}, not a torch.nn.Module"
        )
    if not any(True for _ in model.parameters()):
        raise ValueError(f"key 'model' = {path!r}: the model has no parameters")
    return model
