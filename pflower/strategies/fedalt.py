"""FedAlt and FedSim: Pillutla et al., *Federated Learning with Partial Model
Personalization* (ICML 2022). FedRep and FedPer are the literature's names for FedAlt and
FedSim with the head split (algorithms ``fedrep`` and ``fedper``).

Model: shared parameters ``u`` (cross the wire) and personal ``v_i`` (stay on client i)::

    for t = 0, 1, ...:
        S_t <- m clients, uniformly without replacement; broadcast u(t) only
        for i in S_t:  (u_i, v_i) <- LocalAlt | LocalSim (u(t), v_i)   # v_i stays on the device
        u_bar = sum_i N_i u_i / sum_i N_i                              # data-size weighted
        u(t+1) = ServerOpt(u(t), Delta = u(t) - u_bar)                 # SGD lr 1 = plain mean

    LocalAlt(tau_v, tau_u, gamma_v, gamma_u):
        tau_v SGD steps on v with u frozen; then tau_u steps on u with v frozen at the NEW v
    LocalSim(tau, gamma_u, gamma_v):
        tau joint steps: both gradients at the same (u_k, v_k) and the same minibatch

Each phase gets a fresh optimizer; whatever is frozen gets no gradient, so nothing (not even
weight decay) moves it. Step counts are epochs (``personal-epochs``, ``local-epochs``) or
steps (``personal-steps``, ``local-steps``); FedSim uses the ``local-*`` count and both rates.

**Stateful** clients (default) keep ``v_i`` in their store between rounds; the first time,
``v_i`` starts from the server's ``personal-init`` (the slice of the FedAvg pre-trained model)
or, without pre-training, from the seeded init every client shares (identical adapters).
**Stateless** clients (``stateful = false``) reset ``v_i`` to that init every time.

**Pipeline in one run** (the paper's experiments): ``pretrain-rounds`` of FedAvg on the whole
model, then FedAlt/FedSim from it, then ``finetune-epochs`` of v-only fine-tuning on every
client before the final evaluation (the fine-tuned ``v_i`` is stored as the client's own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord
from pydantic import Field

from pflower.settings import ConfigError, Settings, Weighting
from pflower.strategies.client import ClientHalf, ClientJob, train_metrics
from pflower.strategies.registry import Algorithm
from pflower.strategies.server import PersonalizedStrategy
from pflower.wire import ClientUpdate

if TYPE_CHECKING:
    from pflower.settings import RunSettings

#: ``fedrep`` / ``fedper``: the literature's names for FedAlt / FedSim with the head split
HEAD_ALIASES = {"fedrep": "fedalt", "fedper": "fedsim"}


class FedAltSettings(Settings):
    """FedAlt / FedSim's own keys (``personal-*``, ``pretrain-*`` and ``finetune-*`` are
    run-level: other algorithms read them too)."""

    fedalt_weighting: Weighting = Field(
        "num-examples",
        alias="fedalt-weighting",
        description=(
            "FedAlt/FedSim server mean: `num-examples` (u = Σ N_i u_i / Σ N_i, the paper's "
            "objective Σ_i α_i F_i with α_i ∝ N_i) or `uniform` (plain mean over the sampled "
            "clients)"
        ),
    )
    stateful: bool = Field(
        True,
        description=(
            "FedAlt/FedSim clients keep v between rounds (the paper); `false`: reset it to the "
            "init every round"
        ),
    )

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.algorithm in HEAD_ALIASES and (cfg.split != "head" or cfg.split_patterns):
            raise ConfigError(
                f"key 'split' = {cfg.split!r}: algorithm {cfg.algorithm!r} is "
                f"{HEAD_ALIASES[cfg.algorithm]!r} with the head split; use split 'head', or "
                f"algorithm {HEAD_ALIASES[cfg.algorithm]!r} for other splits"
            )


if TYPE_CHECKING:

    class RunConfig(RunSettings, FedAltSettings):
        """What this file reads of a run config: the run-level keys and FedAlt's and FedSim's
        own (the composed ``pflower.config.Config``, defined above this file, is one)."""


#: FedAlt / FedSim's keys at their defaults: ``FedAlt``'s constructor defaults
SETTINGS = FedAltSettings()


class FedAlt(PersonalizedStrategy):
    """FedAlt's server (Pillutla et al. 2022, Alg. 1): data-size weighted mean of the returned
    shared parameters, through the server optimizer (SGD with lr 1 = the mean; Adam = FedAdam).

    The server half of FedAlt and FedSim is the same; they differ on the client
    (``FedAltClient``: LocalAlt, ``FedSimClient``: LocalSim). Each round's config carries
    ``lr`` and ``lr-scale`` (the schedule's factor, which the client applies to its personal
    lr as well).

    Parameters
    ----------
    weighted : bool (default: ``fedalt-weighting == "num-examples"``)
        ``True``: ``u_bar = sum_i N_i u_i / sum_i N_i`` over the round's clients, the paper's
        objective ``sum_i alpha_i F_i``, alpha_i ~ N_i (every training example counts the
        same; the authors' code weights by local batches, which is proportional to N_i up to
        the last partial batch). ``False``: the plain mean (every sampled client counts the
        same, the objective ``(1/n) sum_i F_i``).
    **kwargs
        The parameters of ``PersonalizedStrategy``.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("fedalt", "fedrep")

    def __init__(
        self, *, weighted: bool = SETTINGS.fedalt_weighting == "num-examples", **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.weighted = weighted

    @classmethod
    def from_config(cls, cfg: RunConfig, **settings) -> FedAlt:
        return cls(weighted=cfg.fedalt_weighting == "num-examples", **settings)

    def aggregate(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        return self.average_weights(current, updates, weighted=self.weighted)


class FedSim(FedAlt):
    """FedSim's server: identical to FedAlt's (see ``FedAlt``); the client runs LocalSim."""

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("fedsim", "fedper")


class _PartialClient(ClientHalf):
    """What FedAlt's and FedSim's client halves share: where v starts, how it is evaluated."""

    users_loop = True  # each phase is plain SGD on u, v or both

    def start_personal(self, job: ClientJob) -> None:
        """Stateful: the stored v (or the init on first contact). Stateless: the init."""
        if job.cfg.stateful:
            job.restore_personal()
        else:
            self.new_client(job)

    def local_part(self, job: ClientJob) -> bool:
        """Stateful: the stored v as trained (the init if never sampled), without step (c)'s
        fine-tuning. Stateless: none (v is fitted afresh at every evaluation)."""
        if job.cfg.stateful:
            job.restore_personal()
        return job.cfg.stateful

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        if not job.cfg.stateful:  # stateless: fine-tune from the init every time
            super().personalize(job, final)
            return
        job.restore_personal()
        if final and job.cfg.finetune_epochs > 0:  # pipeline step (c)
            job.fine_tune(job.split.personal)
            job.save_personal()


class FedAltClient(_PartialClient):
    """LocalAlt: personal phase, then shared phase at the new personal parameters."""

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        cfg = job.cfg
        self.start_personal(job)
        personal = job.sgd(
            job.personal_params(),
            lr=job.personal_lr,
            epochs=cfg.personal_epochs,
            steps=cfg.personal_steps,
        )
        shared = job.sgd(job.shared_params(), lr=job.lr)
        if cfg.stateful:
            job.save_personal()
        return job.shared_record(), {
            **train_metrics(job, personal, shared),
            "personal-loss": personal.loss,
        }


class FedSimClient(_PartialClient):
    """LocalSim: joint SGD steps on (u, v), one minibatch gradient, a rate for each part."""

    def check(self, cfg, model, split, train_loop) -> None:
        super().check(cfg, model, split, train_loop)
        if train_loop is not None and cfg.personal_lr:
            raise ValueError(
                f"key 'personal-lr' = {cfg.personal_lr} with train_fn: LocalSim's joint step "
                "has a rate for each part and your loop takes one; set 'personal-lr' to 0 or "
                "drop train_fn"
            )

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        self.start_personal(job)
        lr = job.lr
        groups = [
            {"params": job.shared_params(), "lr": lr},
            {"params": job.personal_params(), "lr": job.personal_lr},
        ]
        result = job.sgd([g for g in groups if g["params"]], lr=lr)
        if job.cfg.stateful:
            job.save_personal()
        return job.shared_record(), train_metrics(job, result)


#: this file's algorithms; ``fedrep`` / ``fedper`` are the literature's names for FedAlt /
#: FedSim with the head split (the config enforces it)
ALGORITHMS = {
    "fedalt": Algorithm(FedAlt, FedAltClient(), settings=(FedAltSettings,), numpy_client=True),
    "fedsim": Algorithm(FedSim, FedSimClient(), settings=(FedAltSettings,), numpy_client=True),
    "fedrep": Algorithm(FedAlt, FedAltClient(), settings=(FedAltSettings,), numpy_client=True),
    "fedper": Algorithm(FedSim, FedSimClient(), settings=(FedAltSettings,), numpy_client=True),
}
