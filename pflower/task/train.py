"""Local optimisation primitives shared by every algorithm.

One training loop lives here, ``sgd``: minibatch SGD on a chosen subset of a model's
parameters with everything else frozen. Algorithms compose it (FedAvg: all shared
parameters; fine-tuning: the personal ones; FedAlt: personal, then shared) instead of
copying it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.sgd import sgd as sgd_step
from torch.utils.data import DataLoader

from pflower.task.data.loaders import one_pass, whole_set


def loss_fn(model: nn.Module):
    """The model's loss ``(output, target, reduction) -> tensor``: cross-entropy unless the
    model carries its own ``loss`` (the synthetic linear problem's squared error, a model of
    your own with a ``loss`` method, or the run's ``loss`` key set by ``set_objective``).

    The protocol: ``loss(output, target, reduction="mean")`` returns the mean over the batch
    of the per-example loss, and with ``reduction="sum"`` its sum (evaluation divides that by
    the number of examples)."""
    return getattr(model, "loss", F.cross_entropy)


def is_classifier(model: nn.Module) -> bool:
    """Whether accuracy means something (``task``); without a stated task, models with a loss
    of their own are regression models."""
    task = getattr(model, "pflower_task", None)
    return task == "classification" if task else not hasattr(model, "loss")


def mse(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Squared error per example (averaged over the outputs of a multi-output model), then
    the mean (or sum) over the batch; the target is cast to the output's dtype and shape."""
    target = target.to(output.dtype).reshape(output.shape)
    per_example = (output - target).pow(2).reshape(len(output), -1).mean(1)
    return per_example.sum() if reduction == "sum" else per_example.mean()


def set_objective(model: nn.Module, loss: str, task: str, load=None) -> nn.Module:
    """Attach the run's loss and task to ``model`` (what ``loss_fn`` and ``is_classifier``
    read). ``loss``: ``auto`` keeps a ``loss`` method the model has, else cross-entropy for
    classification and ``mse`` for regression; ``cross-entropy``; ``mse``; or an import
    path resolved by ``load``. ``task``: ``classification`` or ``regression``."""
    if loss == "cross-entropy":
        model.loss = F.cross_entropy
    elif loss == "mse":
        model.loss = mse
    elif loss != "auto":
        fn = load(loss)
        if not callable(fn):
            raise ValueError(f"key 'loss' = {loss!r}: not a function")
        model.loss = fn
    elif not hasattr(model, "loss"):
        model.loss = F.cross_entropy if task == "classification" else mse
    model.pflower_task = task
    return model


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


class SGDSteps:
    """``torch.optim.SGD``'s steps, without the optimizer object around them.

    Each ``step`` calls torch's functional SGD (``torch.optim.sgd.sgd``, what
    ``torch.optim.SGD.step`` itself calls) on every group's parameters that have a gradient,
    with the same arguments the optimizer passes (dampening 0, no Nesterov, torch's own
    choice of the single-tensor or foreach kernel): the same update, bit for bit, momentum
    buffers included (kept per parameter for the life of this object, as the optimizer's
    state is). What it leaves out is the optimizer's per-step machinery (profiler hooks,
    dynamo guards, group and state bookkeeping): ~0.1 ms of a ~0.9 ms step of a batch of 32
    through the 784-200-200-10 MLP on one CPU thread (``benchmarks/sgd_step.py``).
    ``tests/test_state_train.py`` checks it against ``torch.optim.SGD`` step for step.
    """

    def __init__(
        self, groups: Sequence[dict], *, lr: float, momentum: float, weight_decay: float
    ) -> None:
        self.groups = [
            (list(g["params"]), float(g.get("lr", lr)), [None] * len(g["params"])) for g in groups
        ]
        self.momentum, self.weight_decay = momentum, weight_decay

    def zero_grad(self) -> None:
        for params, _, _ in self.groups:
            for p in params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for params, lr, buffers in self.groups:
            have = [i for i, p in enumerate(params) if p.grad is not None]
            chosen = [params[i] for i in have]
            grads = [p.grad for p in chosen]
            momentum_buffers = [buffers[i] for i in have]
            sgd_step(
                chosen,
                grads,
                momentum_buffers,
                has_sparse_grad=any(g.is_sparse for g in grads),
                weight_decay=self.weight_decay,
                momentum=self.momentum,
                lr=lr,
                dampening=0.0,
                nesterov=False,
                maximize=False,
            )
            if self.momentum:  # the buffers the first step created, for the next steps
                for i, buffer in zip(have, momentum_buffers):
                    buffers[i] = buffer


def _cycle(loader: DataLoader, steps: int):
    """``steps`` minibatches, passing over ``loader`` again (reshuffled) as often as needed."""
    passes = (one_pass(loader) for _ in itertools.repeat(None))
    return itertools.islice(itertools.chain.from_iterable(passes), steps)


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
    correction: Sequence[torch.Tensor] | None = None,
    prox: tuple[float, Sequence[torch.Tensor]] | None = None,
    device: torch.device | str = "cpu",
) -> TrainResult:
    """Minibatch SGD of the model's loss (``loss_fn``) on ``params`` only.

    ``params`` is a list of parameters, or of ``torch.optim`` parameter groups (dicts with
    ``params`` and their own ``lr``), e.g. shared and personal parts with separate rates.
    Runs ``steps`` minibatch steps when ``steps > 0`` (cycling over the loader), otherwise
    ``epochs`` passes. Fresh ``torch.optim.SGD`` steps each call (``SGDSteps``): no
    optimizer state survives between calls (momentum 0 in the papers). ``max_grad_norm > 0``
    clips the norm of the gradient of ``params`` before each step. ``correction`` (one
    tensor per trainable parameter, in order) is added to every minibatch gradient:
    Scaffold's ``c - c_i``. ``prox = (mu, anchor)`` (one anchor tensor per trainable
    parameter, in order) minimises ``loss + mu/2 ||p - anchor||^2`` instead: ``mu (p -
    anchor)`` is added to every minibatch gradient (FedProx's proximal term around the
    received model, Ditto's around the global one), before the clip, as the loss's own part.
    """
    groups = list(params) if params and isinstance(params[0], dict) else [{"params": params}]
    trainable = [p for g in groups for p in g["params"]]
    if not trainable or len(loader) == 0:
        return TrainResult(loss=float("nan"), steps=0, examples=0)
    num_steps = steps if steps > 0 else epochs * len(loader)
    optimizer = SGDSteps(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    total_loss, examples = 0.0, 0
    criterion = loss_fn(model)
    model.train()
    with only_trainable(model, trainable):
        for x, y in _cycle(loader, num_steps):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            if correction is not None:
                for p, c in zip(trainable, correction):
                    p.grad += c
            if prox is not None and prox[0]:
                mu, anchor = prox
                for p, a in zip(trainable, anchor):
                    p.grad.add_(p.detach() - a, alpha=mu)
            if max_grad_norm > 0:
                nn.utils.clip_grad_norm_(trainable, max_grad_norm)
            optimizer.step()
            total_loss += loss.item() * len(y)
            examples += len(y)
    return TrainResult(loss=total_loss / max(1, examples), steps=num_steps, examples=examples)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device | str = "cpu") -> dict:
    """Mean loss and (for classifiers) accuracy of ``model`` over ``loader``."""
    model.eval()
    criterion, classifier = loss_fn(model), is_classifier(model)
    loss, correct, squared, n = 0.0, 0, 0.0, 0
    for x, y in one_pass(loader):
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss += criterion(out, y, reduction="sum").item()
        if classifier:
            correct += int((out.argmax(1) == y).sum())
        else:  # whatever the loss, the squared error of the prediction (RMSE)
            squared += mse(out, y, reduction="sum").item()
        n += len(y)
    result = {"loss": loss / max(1, n), "num-examples": n}
    if classifier:
        result.update({"accuracy": correct / max(1, n), "correct": correct})
    else:
        result["rmse"] = math.sqrt(squared / max(1, n))
    return result


def _loss_sum(model: nn.Module, loader: DataLoader, device) -> tuple[torch.Tensor, int]:
    """Sum of the per-example loss over ``loader`` (graph kept) and the example count."""
    total, n, criterion = 0.0, 0, loss_fn(model)
    for x, y in one_pass(loader):
        x, y = x.to(device), y.to(device)
        total = total + criterion(model(x), y, reduction="sum")
        n += len(y)
    return total, n


def full_gradient(
    model: nn.Module, params: Sequence[nn.Parameter], loader: DataLoader, device="cpu"
) -> list[torch.Tensor]:
    """Gradient of the mean loss over the whole loader w.r.t. ``params``.

    Accumulated batch by batch (each batch's sum, divided by the total count at the end), so
    memory stays that of one batch whatever the size of the local set.
    """
    return loss_and_gradient(model, params, loader, device)[1]


def loss_and_gradient(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    loader: DataLoader,
    device="cpu",
    chunk: int | None = None,
) -> tuple[float, list[torch.Tensor]]:
    """The mean loss over the whole loader and its gradient w.r.t. ``params``
    (``full_gradient``; the loss comes with the same passes). ``chunk``: go over the set in
    order in chunks of that many examples (``whole_set``) instead of the loader's
    minibatches: the same mean, in fewer passes through the model."""
    model.eval()  # no dropout: the gradient of the function being minimised
    grads = [torch.zeros_like(p) for p in params]
    n, total, criterion = 0, torch.zeros(()), loss_fn(model)
    batches = one_pass(loader) if chunk is None else whole_set(loader, chunk)
    with only_trainable(model, params):
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            loss = criterion(model(x), y, reduction="sum")
            for g, gi in zip(grads, torch.autograd.grad(loss, params)):
                g += gi
            total = total.to(loss.device) + loss.detach()  # no host sync per batch
            n += len(y)
    return float(total) / max(1, n), [g / max(1, n) for g in grads]


def gradient_descent(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    loader: DataLoader,
    *,
    lr: float,
    steps: int,
    device="cpu",
) -> int:
    """``steps`` full-batch gradient-descent steps on ``params``; returns examples seen."""
    n = 0
    if len(loader) == 1:  # the whole set is one batch: load it once, not once per step
        loader = _OneBatch(next(iter(loader)), loader.dataset)
    for _ in range(steps):
        grads = full_gradient(model, params, loader, device)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
        n += len(loader.dataset)
    return n


class _OneBatch(list):
    """A loaded single batch standing in for its loader (``len``, iteration, ``dataset``)."""

    def __init__(self, batch, dataset) -> None:
        super().__init__([batch])
        self.dataset = dataset


def conjugate_gradient(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    loader: DataLoader,
    *,
    steps: int,
    device="cpu",
    tol: float = 0.0,
) -> int:
    """``steps`` conjugate-gradient iterations on the Newton system of ``params``.

    Solves ``H d = -g`` (``H``, ``g``: Hessian and gradient of the full-batch loss in
    ``params`` at the start, Hessian-vector products by double backward) and moves ``params``
    by ``d``. For a loss quadratic in ``params`` (FFGG's synthetic problem) this is CG on the
    normal equations, exact after ``len(params)`` dimensions' worth of iterations; otherwise
    one truncated Newton step. Stops early at convergence or at a direction of non-positive
    curvature. Returns the examples it processed: one pass for the gradient and two for
    each Hessian-vector product it took (one per iteration run, not per iteration asked).
    """
    model.eval()
    with only_trainable(model, params):
        loss, n = _loss_sum(model, loader, device)
        g = torch.autograd.grad(loss / n, params, create_graph=True)
        flat_g = torch.cat([gi.reshape(-1) for gi in g])

        def hvp(v: torch.Tensor) -> torch.Tensor:
            hv = torch.autograd.grad(flat_g, params, grad_outputs=v, retain_graph=True)
            return torch.cat([h.reshape(-1) for h in hv])

        r = -flat_g.detach()
        d, x = r.clone(), torch.zeros_like(r)
        rs = r @ r
        # converged (relative residual at the dtype's resolution): more steps would divide 0/0
        floor = max(tol, float(rs) * torch.finfo(r.dtype).eps ** 2)
        products = 0
        for _ in range(steps):
            if rs <= floor:
                break
            hd = hvp(d)
            products += 1
            curvature = d @ hd
            if curvature <= 0:  # not positive definite along d: stop where we are
                break
            alpha = rs / curvature
            x += alpha * d
            r -= alpha * hd
            rs_new = r @ r
            d = r + (rs_new / rs) * d
            rs = rs_new
    with torch.no_grad():
        for p, step in zip(params, _unflatten(x, params)):
            p += step
    return n * (1 + 2 * products)


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for p in like:
        out.append(flat[i : i + p.numel()].view_as(p))
        i += p.numel()
    return out


def alternating_sgd(
    model: nn.Module,
    first: Sequence[nn.Parameter],
    second: Sequence[nn.Parameter],
    loader: DataLoader,
    *,
    lr_first: float,
    lr_second: float,
    steps: int,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 0.0,
    device="cpu",
) -> TrainResult:
    """``steps`` alternating minibatch steps: ``first`` then ``second`` on the same minibatch,
    the ``second`` gradient taken at the updated ``first`` (Local FFGG, Alg. 4).

    Each part steps as ``sgd`` steps its parameters: its own ``torch.optim.SGD`` steps
    (``SGDSteps``, fresh each call; with ``momentum`` its buffer runs over the call's
    ``steps`` pairs, each part's separately), ``weight_decay`` on that part only, and
    ``max_grad_norm`` clipping that part's gradient before its step. At the defaults (all
    0) each step is the plain ``p <- p - lr * grad`` of Alg. 4. ``examples`` counts every
    part's pass: a pair takes its minibatch through the model twice (a forward and
    backward pass per part)."""
    if steps <= 0 or len(loader) == 0:
        return TrainResult(loss=float("nan"), steps=0, examples=0)
    parts = [
        (
            list(params),
            SGDSteps([{"params": params}], lr=lr, momentum=momentum, weight_decay=weight_decay),
        )
        for params, lr in ((first, lr_first), (second, lr_second))
        if params
    ]
    model.train()
    total, seen, criterion = 0.0, 0, loss_fn(model)
    for x, y in _cycle(loader, steps):
        x, y = x.to(device), y.to(device)
        for params, optimizer in parts:
            optimizer.zero_grad()
            with only_trainable(model, params):
                loss = criterion(model(x), y)
                loss.backward()
            if max_grad_norm > 0:
                nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
        total += loss.item() * len(y)
        seen += len(y)
    return TrainResult(loss=total / max(1, seen), steps=steps, examples=seen * len(parts))
