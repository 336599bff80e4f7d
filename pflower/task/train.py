"""Local optimisation primitives shared by every algorithm.

One training loop lives here, ``sgd``: minibatch SGD on a chosen subset of a model's
parameters with everything else frozen. Algorithms compose it (FedAvg: all shared
parameters; fine-tuning: the personal ones; FedAlt: personal, then shared) instead of
copying it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class TrainResult:
    """What one call of ``sgd`` did: mean minibatch loss, steps taken, examples seen."""

    loss: float
    steps: int
    examples: int


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: the GPU when one is present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("key 'device' = 'cuda': no CUDA device is available here")
    return torch.device(name)


@contextmanager
def only_trainable(model: nn.Module, params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Freeze every parameter of ``model`` except ``params``; restore on exit.

    Frozen parameters get no gradient, so no optimizer (nor its weight decay) touches
    them, and backward skips work that would be thrown away.
    """
    keep = {id(p) for p in params}
    before = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in before:
            p.requires_grad_(id(p) in keep)
        yield
    finally:
        for p, flag in before:
            p.requires_grad_(flag)


def sgd(
    model: nn.Module,
    params: Sequence[nn.Parameter] | Sequence[dict],
    loader: DataLoader,
    *,
    lr: float,
    epochs: int = 1,
    steps: int = 0,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 0.0,
    device: torch.device | str = "cpu",
) -> TrainResult:
    """Minibatch SGD with cross-entropy on ``params`` only.

    ``params`` is a list of parameters, or of ``torch.optim`` parameter groups (dicts with
    ``params`` and their own ``lr``), e.g. shared and personal parts with separate rates.
    Runs ``steps`` minibatch steps when ``steps > 0`` (cycling over the loader), otherwise
    ``epochs`` passes. A fresh ``torch.optim.SGD`` each call: no optimizer state survives
    between calls (momentum 0 in the papers). ``max_grad_norm > 0`` clips the norm of the
    gradient of ``params`` before each step.
    """
    groups = list(params) if params and isinstance(params[0], dict) else [{"params": params}]
    trainable = [p for g in groups for p in g["params"]]
    if not trainable or len(loader) == 0:
        return TrainResult(loss=float("nan"), steps=0, examples=0)
    num_steps = steps if steps > 0 else epochs * len(loader)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    total_loss, examples = 0.0, 0
    model.train()
    with only_trainable(model, trainable):
        batches = itertools.chain.from_iterable(itertools.repeat(loader))
        for x, y in itertools.islice(batches, num_steps):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if max_grad_norm > 0:
                nn.utils.clip_grad_norm_(trainable, max_grad_norm)
            optimizer.step()
            total_loss += loss.item() * len(y)
            examples += len(y)
    return TrainResult(loss=total_loss / max(1, examples), steps=num_steps, examples=examples)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device | str = "cpu") -> dict:
    """Cross-entropy loss and accuracy of ``model`` over ``loader``."""
    model.eval()
    loss, correct, n = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(1) == y).sum())
        n += len(y)
    return {
        "loss": loss / max(1, n),
        "accuracy": correct / max(1, n),
        "correct": correct,
        "num-examples": n,
    }
