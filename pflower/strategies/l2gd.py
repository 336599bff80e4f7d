"""L2GD: Hanzely & Richtárik, *Federated Learning of a Mixture of Global and Local Models*
(2020). The fully personalized baseline of Mishchenko et al. §3.2 (lambda = 0.1, p = 1/tau).

Every client m keeps a whole model x_m; the objective is
``F(x) = (1/M) sum_m f_m(x_m) + lambda * (1/2M) sum_m ||x_m - x_bar||^2``. Each iteration
flips a coin xi ~ Bernoulli(p) and takes a step of size alpha on F's unbiased estimate::

    xi = 0 (local step, no communication):  x_m <- x_m - alpha / (M (1 - p)) * grad f_m(x_m)
    xi = 1 (averaging step):                x_m <- x_m - alpha lambda / (M p) * (x_m - x_bar)

with ``alpha <= 1 / (2 L_cal)``, ``L_cal = (1/M) max{L / (1 - p), lambda / p}`` (the L2GD
paper's bound; FFGG §3.2 prints the ratio inverted, see ALGORITHMS.md).

As Flower rounds: communication is needed only when an averaging step follows local steps
(x_bar changes only through local steps). The server flips the coins and groups them: a round
is a run of a >= 1 averaging steps followed by k >= 1 local steps (the first round may
start with local steps, a = 0). The server sends x_bar, ``l2gd-mix`` = 1 - (1 - beta)^a with
beta = alpha lambda / (M p) (a consecutive averaging steps move x_m that fraction of the way
to x_bar, which they leave unchanged) and ``l2gd-steps`` = k; each client mixes, takes k
steps at ``lr`` = alpha / (M (1 - p)) and returns x_m; the server's new x_bar is the
unweighted mean. ``lr`` in the run config is alpha. The client keeps x_m in its store: it is
its personalized model. (L2GD has no private part: x_m itself is what gets averaged.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord
from pydantic import Field

from pflower.settings import ConfigError, Settings
from pflower.strategies.client import ClientHalf, ClientJob, train_metrics
from pflower.strategies.combine import weighted_mean
from pflower.strategies.registry import Algorithm
from pflower.strategies.server import PersonalizedStrategy
from pflower.task import split as splits
from pflower.task import train as training
from pflower.wire import LR, ClientUpdate

if TYPE_CHECKING:
    from pflower.settings import RunSettings

# --- wire contract: shares every parameter (reply ``arrays``: x_m); config-record keys the
# server sends with each round's coins; the store key of x_m on the device
MIX = "l2gd-mix"  # 1 - (1 - beta)^a: how far x_m moves toward x_bar before the local steps
STEPS = "l2gd-steps"  # k, the local steps of this round
LOCAL_MODEL = "l2gd-model"  # store key of x_m
#: L2GD's values for run-config keys left at ``auto`` (``config.AUTO``): 10 local steps
#: between averaging steps on average, i.e. p = 1/10 (Mishchenko et al. §3.2: p = 1/tau)
L2GD_DEFAULTS = {"local_steps": 10}


class L2GDSettings(Settings):
    """L2GD's own keys (``lr`` is its alpha, ``local-steps`` sets p = 1/local-steps)."""

    l2gd_lambda: float = Field(
        0.1,
        alias="l2gd-lambda",
        ge=0,
        description="L2GD's λ, the weight of the distance to the mean (in the loss's own scale)",
    )
    l2gd_p: float = Field(
        0.0,
        alias="l2gd-p",
        ge=0,
        lt=1,
        description="L2GD's probability of an averaging step (0: 1/`local-steps`)",
    )

    @property
    def effective_l2gd_p(self) -> float:
        """L2GD's probability of an averaging step: ``l2gd-p``, or 1/local-steps."""
        return self.l2gd_p or 1.0 / self.local_steps

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.fraction_train != 1:
            raise ConfigError(
                f"key 'fraction-train' = {cfg.fraction_train}: l2gd needs 1.0 (every client "
                "takes every step of L2GD)"
            )
        if cfg.l2gd_p == 0 and cfg.local_steps == 1:
            raise ConfigError(
                "key 'l2gd-p' = 0 means p = 1/local-steps, and 'local-steps' = 1: set "
                "'local-steps' >= 2 (0: L2GD's default, 10) or 'l2gd-p' in (0, 1)"
            )


if TYPE_CHECKING:

    class RunConfig(RunSettings, L2GDSettings):
        """What this file reads of a run config: the run-level keys and L2GD's
        own (the composed ``pflower.config.Config``, defined above this file, is one)."""


#: L2GD's keys at their defaults: ``L2GD``'s constructor defaults
SETTINGS = L2GDSettings()


class L2GD(PersonalizedStrategy):
    """L2GD's server: flips the coins, sends x_bar with the round's steps, averages x_m.

    Parameters (besides those of ``PersonalizedStrategy``; ``lr`` is alpha)
    ----------
    lam : float (default: ``l2gd-lambda``)
        lambda, the weight of the distance to the mean.
    p : float (default: ``l2gd-p``)
        Probability of an averaging step; the expected number of local steps between two
        communications is (1 - p) / p. 0: 1 / ``local-steps``, L2GD's (``L2GD_DEFAULTS``).
    fraction_train : float (default: 1.0)
        Must be 1: every client takes every step of L2GD.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("l2gd",)
    defaults = L2GD_DEFAULTS

    #: what a checkpoint keeps besides the base strategy's (``pflower.checkpoint``): the
    #: coins still to flip and the iteration count
    checkpoint_attributes = ("coins", "iterations", "_pending_average")

    @classmethod
    def from_config(cls, cfg: RunConfig, **settings) -> L2GD:
        return cls(lam=cfg.l2gd_lambda, p=cfg.effective_l2gd_p, **settings)

    def __init__(
        self,
        *,
        lam: float = SETTINGS.l2gd_lambda,
        p: float = SETTINGS.l2gd_p,
        fraction_train: float = 1.0,
        **kwargs,
    ) -> None:
        if fraction_train != 1:
            raise ValueError(
                f"fraction_train = {fraction_train}: L2GD needs 1.0 (every client takes every "
                "step of L2GD)"
            )
        super().__init__(fraction_train=fraction_train, **kwargs)
        p = p or 1.0 / self.app_settings().local_steps
        if not 0 < p < 1:
            raise ValueError(f"p = {p}: must be in (0, 1)")
        if lam < 0:
            raise ValueError(f"lam = {lam}: must be >= 0")
        self.lam, self.p = lam, p
        self.coins = np.random.default_rng([kwargs.get("seed", 0), 2020])
        self.num_nodes = 0
        self.iterations = 0
        self._pending_average = False  # the coin that ended the last round's local steps
        self._steps = (0, 0)

    def draw_round(self) -> tuple[int, int]:
        """Flip coins until the next averaging step after a local one: (a, k)."""
        a, k = int(self._pending_average), 0
        while True:
            if self.coins.random() < self.p:
                if k:
                    self._pending_average = True
                    return a, k
                a += 1
            else:
                k += 1

    def configure_train(self, server_round, arrays, config, grid):
        self.num_nodes = len(list(grid.get_node_ids()))
        return super().configure_train(server_round, arrays, config, grid)

    def train_config(self, server_round: int) -> dict:
        settings = super().train_config(server_round)
        if self.pretraining(server_round):
            return settings
        alpha, m = settings[LR], self.num_nodes
        beta = alpha * self.lam / (m * self.p)
        if beta > 1:
            raise ValueError(
                f"key 'lr' = {alpha:g}: the L2GD averaging step alpha lambda / (M p) = "
                f"{beta:.3g} > 1 (M = {m}, lambda = {self.lam}, p = {self.p:.3g}); "
                f"use lr <= {m * self.p / self.lam:.3g}"
            )
        a, k = self._steps = self.draw_round()
        self.iterations += a + k
        settings.update(
            {
                LR: alpha / (m * (1 - self.p)),
                MIX: 1.0 - (1.0 - beta) ** a,
                STEPS: k,
            }
        )
        return settings

    def aggregate(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        ones = [1.0] * len(updates)
        # the mean of w_i as current minus the (private, clipped, or robust) mean of the
        # updates: a robust rule sees updates, not raw weights
        if not self.pipeline.combine.exact_mean:
            step = self.combine([u.tensors for u in updates], ones, current)
            return {k: current[k].astype(np.float64) - step[k] for k in current}
        return weighted_mean([u.tensors for u in updates], ones)

    def round_metrics(self, updates: list[ClientUpdate]) -> dict[str, float]:
        a, k = self._steps
        return {
            **super().round_metrics(updates),
            "l2gd-averaging-steps": a,
            "l2gd-local-steps": k,
            "l2gd-iterations": self.iterations,
        }


class L2GDClient(ClientHalf):
    """Mixes its stored x_m toward the received x_bar, takes k local steps, stores x_m."""

    def _local_model(self, job: ClientJob) -> dict | None:
        names = [n for n, _ in job.model.named_parameters()]
        return job.load(LOCAL_MODEL, splits.get_tensors(job.model, names))

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        x_bar = splits.get_tensors(job.model, job.split.shared)
        stored = self._local_model(job)
        if stored is not None:  # first visit: x_m = x_bar
            mix = float(config[MIX])
            splits.set_tensors(
                job.model, {n: (1 - mix) * stored[n] + mix * x_bar[n] for n in x_bar}
            )
        steps = int(config[STEPS])
        params = job.shared_params()
        result = (
            job.sgd(params, lr=job.lr, steps=steps)
            if steps
            else training.TrainResult(loss=float("nan"), steps=0, examples=0)
        )
        names = [n for n, _ in job.model.named_parameters()]
        job.store.save(LOCAL_MODEL, splits.get_tensors(job.model, names))
        return job.shared_record(), train_metrics(job, result)

    def new_client(self, job: ClientJob) -> None:
        """A new client starts from the received average x_bar."""

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        stored = self._local_model(job)
        if stored is not None:
            splits.set_tensors(job.model, stored)


#: this file's algorithm: L2GD averages whole local models, so all of x_m crosses the wire
#: and all of it is personal
ALGORITHMS = {"l2gd": Algorithm(L2GD, L2GDClient(), "none", "full", settings=(L2GDSettings,))}
