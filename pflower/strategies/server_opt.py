"""Server optimizers on pseudo-gradients (the reply pipeline's apply stage), and the client
learning-rate schedule.

A strategy that receives new weights forms the **pseudo-gradient** ``Delta = u(t) - u_bar``
(current shared parameters minus the clients' weighted mean) and hands it to a server
optimizer (Reddi et al. 2021, *Adaptive Federated Optimization*):

- ``sgd`` with server lr ``eta``: ``u(t+1) = u(t) - eta * Delta``; ``eta = 1`` is FedAvg.
- ``adam``: ``torch.optim.Adam`` itself, run on tensors that mirror the shared parameters,
  with ``Delta`` as their gradient. Bias-corrected; its state (moments, step count) persists
  across rounds because the optimizer object does::

      m_t = b1 m_{t-1} + (1 - b1) Delta ;  v_t = b2 v_{t-1} + (1 - b2) Delta^2
      u  <- u - lr * (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)

Strategies that receive gradients (FFGG, PFLEGO) use the same optimizers with the gradient
in place of ``Delta``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from pflower.settings import LR_SCHEDULES, SERVER_OPTIMIZERS, RunSettings
from pflower.wire import LR, LR_SCALE


class ServerOptimizer:
    """``step(current, gradient) -> new`` over named arrays, with a persistent torch optimizer.

    Parameters
    ----------
    name : str (default: "sgd")
        ``sgd`` or ``adam``.
    lr : float (default: 1.0)
        Server learning rate (``sgd`` with 1.0 is FedAvg).
    betas : tuple[float, float] (default: (0.9, 0.999))
        Adam's moment decay rates.
    eps : float (default: 1e-8)
        Adam's denominator term.
    """

    def __init__(
        self,
        name: str = "sgd",
        lr: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if name not in SERVER_OPTIMIZERS:
            raise ValueError(f"server optimizer {name!r}: must be one of {SERVER_OPTIMIZERS}")
        if not lr > 0:
            raise ValueError(f"server lr = {lr}: must be > 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"server betas = {betas}: each must be in [0, 1)")
        if not eps > 0:
            raise ValueError(f"server eps = {eps}: must be > 0")
        self.name, self.lr, self.betas, self.eps = name, lr, betas, eps
        self._params: dict[str, torch.Tensor] = {}
        self._optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def of(cls, settings: RunSettings) -> ServerOptimizer:
        """The server optimizer of a run config's keys (``server-optimizer``, ``server-lr``,
        ``server-beta1`` / ``-beta2`` / ``-eps``), ``auto`` values resolved as the
        algorithm's (the app's strategies and those built by hand both get theirs here)."""
        return cls(
            settings.effective_server_optimizer,
            settings.effective_server_lr,
            (settings.server_beta1, settings.server_beta2),
            settings.server_eps,
        )

    def _ensure(self, current: Mapping[str, np.ndarray]) -> None:
        shapes = {k: tuple(v.shape) for k, v in current.items()}
        if self._optimizer is not None and shapes == {
            k: tuple(p.shape) for k, p in self._params.items()
        }:
            return
        # First step, or the parameter set changed (e.g. after FedAvg pre-training): new state.
        self._params = {
            k: torch.zeros(v.shape, dtype=torch.float64, requires_grad=True)
            for k, v in current.items()
        }
        params = list(self._params.values())
        if self.name == "sgd":
            self._optimizer = torch.optim.SGD(params, lr=self.lr)
        else:
            self._optimizer = torch.optim.Adam(params, lr=self.lr, betas=self.betas, eps=self.eps)

    def step(
        self, current: Mapping[str, np.ndarray], gradient: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """One server step from ``current`` along ``-gradient``; returns the new arrays."""
        if self.name == "sgd" and self.lr == 1.0:  # FedAvg: no state, ``current - gradient``
            # (torch's step computes the same float64 difference; ~0.1 ms per round saved)
            return {k: np.subtract(current[k], gradient[k], dtype=np.float64) for k in current}
        self._ensure(current)
        with torch.no_grad():
            for k, p in self._params.items():
                # np.array copies: the arrays may be read-only views of a message's bytes
                p.copy_(torch.from_numpy(np.array(current[k], dtype=np.float64)))
                p.grad = torch.from_numpy(np.array(gradient[k], dtype=np.float64))
        self._optimizer.step()
        return {k: p.detach().numpy().copy() for k, p in self._params.items()}

    def update_scale(self, gradients: bool, client_lr: float) -> float:
        """What multiplies an update when this optimizer applies it (the update-norm bound's
        scale is ``||theta||`` over it): SGD's lr; under Adam, whose step does not grow with
        the update, the client lr for gradients (the scale of a client's own step) and 1 for
        weights and deltas."""
        if self.name == "sgd":
            return float(self.lr)
        return float(client_lr) if gradients else 1.0

    def describe(self) -> str:
        if self.name == "sgd":
            return f"SGD(lr={self.lr})" + (" = FedAvg" if self.lr == 1.0 else "")
        return f"Adam(lr={self.lr}, betas={self.betas}, eps={self.eps})"


def client_lr(
    base_lr: float,
    server_round: int,
    num_rounds: int,
    schedule: str = "constant",
    warmup_fraction: float = 0.1,
    halve_every: int = 500,
) -> float:
    """Client learning rate of round ``server_round`` (1-based) of ``num_rounds``.

    ``constant``; ``linear``: linear warm-up over the first ``warmup_fraction`` of the rounds
    up to ``base_lr``, then linear decay to 0 at the end; ``exponential``: halved every
    ``halve_every`` rounds (PyTorch's StepLR with gamma 0.5), as in Pillutla et al. 2022.
    """
    if schedule == "constant":
        return base_lr
    t = server_round - 1  # rounds completed before this one
    if schedule == "exponential":
        return base_lr * 0.5 ** (t // halve_every)
    if schedule == "linear":
        warmup = math.floor(warmup_fraction * num_rounds)
        if t < warmup:
            return base_lr * (t + 1) / warmup
        return base_lr * max(0.0, (num_rounds - t) / max(1, num_rounds - warmup))
    raise ValueError(f"lr schedule {schedule!r}: must be one of {LR_SCHEDULES}")


class ClientSchedule:
    """The client step sizes of every round, sent with every message (train and evaluate):
    the one road by which a client learns its learning rate. A pre-training round (the first
    ``pretrain_rounds``) takes ``pretrain_lr``; the t-th of the algorithm's T rounds
    ``client_lr(lr, t, T, schedule, ...)`` and ``lr-scale``, the schedule's factor (for
    clients with more than one learning rate).

    Parameters
    ----------
    lr : float
        The client learning rate.
    schedule : str (default: "constant")
        ``constant``, ``linear`` or ``exponential`` (``client_lr``).
    warmup_fraction : float (default: 0.1)
        The ``linear`` schedule's warm-up share of the rounds.
    halve_every : int (default: 500)
        The ``exponential`` schedule's rounds between halvings.
    pretrain_rounds : int (default: 0)
        FedAvg pre-training rounds before the algorithm's.
    pretrain_lr : float or None (default: None)
        Their client lr (``None`` or 0: ``lr``).
    """

    def __init__(
        self,
        lr: float,
        schedule: str = "constant",
        warmup_fraction: float = 0.1,
        halve_every: int = 500,
        pretrain_rounds: int = 0,
        pretrain_lr: float | None = None,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr = {lr}: must be > 0")
        if pretrain_rounds < 0:
            raise ValueError(f"pretrain_rounds = {pretrain_rounds}: must be >= 0")
        client_lr(lr, 1, 1, schedule)  # validates the schedule's name
        self.lr, self.schedule = lr, schedule
        self.warmup_fraction, self.halve_every = warmup_fraction, halve_every
        self.pretrain_rounds, self.pretrain_lr = pretrain_rounds, pretrain_lr or lr

    def __call__(self, server_round: int, num_rounds: int) -> dict[str, float]:
        """The step sizes of round ``server_round`` of ``num_rounds`` (pre-training counted)."""
        if server_round <= self.pretrain_rounds:
            return {LR: self.pretrain_lr}
        t, rounds = server_round - self.pretrain_rounds, num_rounds - self.pretrain_rounds
        lr = client_lr(self.lr, t, rounds, self.schedule, self.warmup_fraction, self.halve_every)
        return {LR: lr, LR_SCALE: lr / self.lr}

    def refuse_other(self, train_config: Mapping | None, owner: str) -> None:
        """A ``train_config`` whose ``lr`` (Flower's quickstart sends one) is not this
        schedule's, which goes with every message in its place."""
        sent = dict(train_config or {})
        if LR in sent and float(sent[LR]) != self.lr:
            raise ValueError(
                f"train_config 'lr' = {sent[LR]}: {owner} sends its own client lr (lr = "
                f"{self.lr}, scheduled) with every message; pass lr={sent[LR]} to {owner}(...)"
            )

