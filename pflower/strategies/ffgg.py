"""FFGG and Local FFGG: Mishchenko, Islamov, Gorbunov, Horváth, *Partially Personalized
Federated Learning: Breaking the Curse of Data Heterogeneity*.

Client m has loss f_m(theta, w): theta shared, w personal. FFGG follows the operator
F_m(theta) = grad_theta f_m(theta, w*_m(theta)), the theta-gradient **at the fine-tuned w**
(no differentiation through w*), and finds F(theta*) = mean_m F_m(theta*) = 0.

Alg. 1, FFGG (Fine-tuning Followed by Global Gradient)::

    for r = 0, 1, ...:
        sample clients C^r
        for m in C^r:
            w_m^r ~ argmin_w f_m(theta^r, w)      # Alg. 2 or any solver; theta frozen
            Delta_m^r = grad_theta f_m(theta^r, w_m^r)   # sent alone (key "gradient")
        theta^{r+1} = theta^r - gamma_theta * (1/|C^r|) sum_m Delta_m^r   # unweighted mean

Alg. 2, the local fine-tuner, from ``ffgg-init`` (``random`` by default; ``zeros`` — the
theory's choice —, ``received`` — the server's pre-trained slice or the shared seeded init —,
or ``stored`` — this client's previous w, i.e. stateful):
``w <- w - gamma_w grad_w f_m(theta^r, w)`` for tau steps. Solvers (``ffgg-solver``): ``sgd``
(``personal-epochs`` or ``personal-steps`` minibatch steps at ``personal-lr``), ``gd`` (tau =
``personal-steps`` full-batch steps) and ``cg`` (tau conjugate-gradient iterations on the Newton
system in w: exact for losses quadratic in w, as in the paper's §3.1).

Alg. 4, Local FFGG (the variant the paper runs on real data)::

    for m in C^r:
        theta^{r,0} = theta^r ; w^{r,0} ~ argmin_w f_m(theta^r, w)   # 1 epoch SGD on w, fresh init
        for k in 0..K-1:
            w^{r,k+1}     = w^{r,k}     - gamma_w     grad_w     f_m(theta^{r,k}, w^{r,k})
            theta^{r,k+1} = theta^{r,k} - gamma_theta grad_theta f_m(theta^{r,k}, w^{r,k+1})
        Delta_m = theta^r - theta^{r,K}                              # key "delta"
    theta^{r+1} = ServerOpt(theta^r, mean_m Delta_m)                 # FedAvg (lr 1) or FedAdam

K is one epoch of alternating minibatch steps (``local-epochs`` / ``local-steps``); both steps
of a pair use the same minibatch. The client optimizer keys ``momentum``, ``weight-decay`` and
``max-grad-norm`` are 0 by default, and then every step is Alg. 4's plain gradient step. Set,
they apply to both phases alike: the w-only fine-tuning (``ffgg-solver = "sgd"``) and each
part's steps in the pairs (one SGD per part, its momentum over the round's K pairs, its own
gradient clipped and decayed), as FedAlt's two phases do. The full-batch solvers ``gd`` and
``cg`` take plain steps only, so FFGG and Local FFGG refuse these keys with them at start.

**Split diagnostic** (§2.4): ||Delta_m|| ~ ||F_m(theta)|| after fine-tuning. Its mean and max
over the round's clients are reported every round (``grad-norm-mean``, ``grad-norm-max``;
not under central DP, which releases no norm of a shared update); near zero means theta no
longer learns: personalize fewer parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from flwr.app import ArrayRecord
from pydantic import Field

from pflower.settings import ConfigError, Settings, Weighting
from pflower.strategies.client import ClientHalf, ClientJob
from pflower.strategies.registry import Algorithm
from pflower.strategies.server import PersonalizedStrategy
from pflower.task import split as splits
from pflower.task import train as training
from pflower.wire import DELTA, GRAD_NORM, GRADIENT, NUM_EXAMPLES, ClientUpdate, to_record

if TYPE_CHECKING:
    from pflower.settings import RunSettings


class FFGGSettings(Settings):
    """FFGG's own keys (FFGG, Local FFGG, BR-FFGG and asynchronous FFGG): Alg. 2's start
    and solver, and the server mean's weights."""

    ffgg_init: Literal["random", "zeros", "received", "stored"] = Field(
        "random",
        alias="ffgg-init",
        description=(
            "FFGG's w at the start of each round: `random` (each layer's default init, seeded per "
            "client and round), `zeros` (the theory's choice), `received` (the pre-trained slice "
            "or the shared seeded init), `stored` (the client's previous w)"
        ),
    )
    ffgg_solver: Literal["sgd", "gd", "cg"] = Field(
        "sgd",
        alias="ffgg-solver",
        description=(
            "FFGG's fine-tuner: `sgd` (minibatch steps), `gd` (full-batch steps), `cg` (conjugate "
            "gradient); the last two run `personal-steps` iterations and need it > 0"
        ),
    )
    ffgg_weighting: Weighting = Field(
        "uniform",
        alias="ffgg-weighting",
        description=(
            "FFGG / Local FFGG server mean: `uniform` (Alg. 1's unweighted mean) or `num-examples` "
            "(Algorithms: which objective each weighting optimizes)"
        ),
    )

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.ffgg_solver in ("gd", "cg") and cfg.personal_steps == 0:
            raise ConfigError(
                f"key 'personal-steps' = 0: ffgg-solver {cfg.ffgg_solver!r} runs "
                "'personal-steps' full-batch iterations; set it > 0"
            )
        optimizer_keys = {
            "momentum": cfg.momentum,
            "weight-decay": cfg.weight_decay,
            "max-grad-norm": cfg.max_grad_norm,
        }
        set_keys = {k: v for k, v in optimizer_keys.items() if v}
        if cfg.ffgg_solver in ("gd", "cg") and set_keys:
            raise ConfigError(
                f"keys {', '.join(repr(k) for k in set_keys)} = "
                f"{', '.join(f'{v:g}' for v in set_keys.values())}: ffgg-solver "
                f"{cfg.ffgg_solver!r} takes plain full-batch steps and applies none of "
                "'momentum', 'weight-decay', 'max-grad-norm'; set them to 0 or use "
                "ffgg-solver 'sgd'"
            )
        if cfg.algorithm == "br-ffgg" and cfg.robust_aggregator == "none":  # not "auto"
            raise ConfigError(
                "key 'robust-aggregator' = 'none': br-ffgg steps with a robust aggregate; "
                "choose one of 'median', 'trimmed-mean', 'krum', 'multi-krum', "
                "'geometric-median', 'centered-clipping' (with 'robust-bucket-size' = 2 for "
                "the agnostic robust rules of the paper's Def. 2)"
            )


if TYPE_CHECKING:

    class RunConfig(RunSettings, FFGGSettings):
        """What this file reads of a run config: the run-level keys and FFGG's
        own (the composed ``pflower.config.Config``, defined above this file, is one)."""


#: BR-FFGG's values for run-config keys left at ``auto`` (``config.AUTO``): bucketing with
#: s = 2 and the coordinate median, one of the agnostic robust rules of the paper's Def. 2
#: (the median alone is not robust to ALIE / IPM). ``robust-bucket-size = 1`` disables it.
BR_FFGG_DEFAULTS = {"robust_aggregator": "median", "robust_bucket_size": 2}

#: FFGG's default defence (``FFGG.defence``: runs without DP, keys left at ``auto``): the
#: geometric median of the round's gradients instead of adaptive clipping, over random
#: buckets of 2 wherever 5 or more bucket means remain and tolerate ``robust-byzantine``
#: (``aggregators.Bucketing``'s ``min_buckets``), over the replies themselves in rounds of 5
#: to 8, and adaptive clipping's bound in rounds of fewer than 5 (``robust-small-rounds =
#: "clip"``). Why: FFGG's client sends one gradient at the round's theta, which heterogeneous
#: clients keep large at the optimum, so a Byzantine gradient clipped to the honest spread
#: still moves theta by the spread every round it is sampled; a median is not moved, the
#: buckets average away half the honest spread the median would discard, and a median of
#: fewer than 5 values has no majority to stand on (measured: docs/threat-model.md,
#: benchmarks/results/default-defence.md). And each round's step at most 2 x the median of
#: the last 10 applied (``robust-step-bound``): FFGG's server takes a plain gradient step of
#: fixed size, so a round that one poisoned vector inside the honest spread moves into a
#: steep region makes the next rounds' honest gradients 10-40 x larger and the steps run
#: away (Min-Sum at 2 of 10, one seed: 41 points, its steps 0.3 -> 3.6 -> 12.7); bounded, the
#: honest rounds after it walk back (benchmarks/results/defence-ffgg-step/).
FFGG_DEFENCE = {
    "robust_aggregator": "geometric-median",
    "robust_bucket_size": 2,
    "robust_small_rounds": "clip",
    "robust_step_bound": 2.0,
}


#: FFGG's keys at their defaults: the constructor defaults of its strategies
SETTINGS = FFGGSettings()


class _GradientStrategy(PersonalizedStrategy):
    """Mean of the clients' vectors (unweighted as in the paper, or data-size weighted),
    handed to the server optimizer; reports the split diagnostic."""

    def __init__(
        self, *, weighted: bool = SETTINGS.ffgg_weighting == "num-examples", **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.weighted = weighted

    @classmethod
    def from_config(cls, cfg: RunConfig, **settings) -> _GradientStrategy:
        return cls(weighted=cfg.ffgg_weighting == "num-examples", **settings)

    def aggregate(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        weights = [u.num_examples if self.weighted else 1.0 for u in updates]
        return self.server_optimizer.step(
            current, self.combine([u.tensors for u in updates], weights)
        )

    def round_metrics(self, updates: list[ClientUpdate]) -> dict[str, float]:
        """Adds the split diagnostic: mean and max of ||Delta_m|| over the round's clients
        (not under central DP: they are norms of the shared updates, which it releases
        only clipped and noised)."""
        norms = [u.metrics[GRAD_NORM] for u in updates if GRAD_NORM in u.metrics]
        if self.central_dp:
            norms = []
        metrics = super().round_metrics(updates)
        if norms:
            metrics.update(
                {"grad-norm-mean": float(np.mean(norms)), "grad-norm-max": float(np.max(norms))}
            )
        return metrics


class FFGG(_GradientStrategy):
    """FFGG's server (Alg. 1): ``theta <- theta - gamma_theta * mean_m Delta_m``.

    ``gamma_theta`` is the server optimizer's lr (``server-lr``; SGD by default; Adam as an
    option). Replies carry the key ``gradient``: Delta_m, the theta-gradient of client m's
    **mean** loss f_m / N_m at its fine-tuned w.

    Parameters
    ----------
    weighted : bool (default: ``ffgg-weighting == "num-examples"``)
        ``False``: the unweighted mean of Alg. 1, so theta* solves
        ``sum_m (1/N_m) grad_theta f_m(theta, w*_m) = 0`` -- every client counts the same,
        the objective ``(1/M) sum_m f_m / N_m``. ``True``: weights N_m, so theta* solves
        ``sum_m grad_theta f_m(theta, w*_m) = 0`` -- every example counts the same, the
        paper's §3.1 operator F with f_m summed over the client's rows. Equal data sizes
        (as in §3.1) make the two the same.
    **kwargs
        The parameters of ``PersonalizedStrategy``.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("ffgg", "br-ffgg", "async-ffgg")
    defence = FFGG_DEFENCE

    def __init__(self, **kwargs) -> None:
        super().__init__(reply_key=GRADIENT, **kwargs)


class LocalFFGG(_GradientStrategy):
    """Local FFGG's server (Alg. 4): ``theta <- ServerOpt(theta, mean_m Delta_m)`` with
    ``Delta_m = theta^r - theta^{r,K}``; SGD with lr 1 is FedAvg, Adam is FedAdam.
    Replies carry the key ``delta``. Takes ``weighted`` (as ``FFGG``: unweighted mean by
    default, data-size weighted with ``True``) and the parameters of
    ``PersonalizedStrategy``."""

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("local-ffgg",)

    def __init__(self, **kwargs) -> None:
        super().__init__(reply_key=DELTA, **kwargs)


class _FFGGClientBase(ClientHalf):
    """Where w starts (``ffgg-init``) and how a new client is evaluated."""

    def init_personal(self, job: ClientJob) -> None:
        mode = job.cfg.ffgg_init
        if mode == "stored" and job.restore_personal():
            return
        if mode in ("received", "stored"):
            splits.set_tensors(job.model, job.init_personal)
        elif mode == "zeros":
            with torch.no_grad():
                for p in job.personal_params():
                    p.zero_()
        else:  # random: each layer's own default init, drawn from this message's seed
            reset_personal(job)

    def new_client(self, job: ClientJob) -> None:
        self.init_personal(job)

    def local_part(self, job: ClientJob) -> bool:
        """With ``ffgg-init = "stored"``: the stored w as trained (the init if none yet).
        Otherwise none: w is fitted afresh from its init in every round and evaluation."""
        if job.cfg.ffgg_init != "stored":
            return False
        job.restore_personal()
        return True

    @staticmethod
    def restored(job: ClientJob) -> dict[str, float]:
        """``personal-restored`` where w is kept between rounds (``ffgg-init = "stored"``)."""
        return {"personal-restored": float(job.restored)} if job.cfg.ffgg_init == "stored" else {}

    def fine_tune_personal(self, job: ClientJob) -> int:
        """Alg. 2 with the configured solver; returns the examples it went through."""
        cfg, params = job.cfg, job.personal_params()
        if cfg.ffgg_solver == "sgd":
            return job.sgd(
                params,
                lr=job.personal_lr,
                epochs=cfg.personal_epochs,
                steps=cfg.personal_steps,
            ).examples
        if cfg.ffgg_solver == "gd":
            return training.gradient_descent(
                job.model,
                params,
                job.train_loader,
                lr=job.personal_lr,
                steps=cfg.personal_steps,
                device=job.device,
            )
        return training.conjugate_gradient(
            job.model, params, job.train_loader, steps=cfg.personal_steps, device=job.device
        )


def _norm(tensors) -> float:
    """Euclidean norm of a list of tensors taken as one vector: the diagnostic ||Delta_m||."""
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).item()


def reset_personal(job: ClientJob) -> None:
    """Re-draw the personal parameters with their layers' default initialisation."""
    personal = set(job.split.personal)
    shared = splits.get_tensors(job.model, job.split.shared)
    for name, module in job.model.named_modules():
        own = [f"{name}.{n}" if name else n for n, _ in module.named_parameters(recurse=False)]
        if any(n in personal for n in own) and hasattr(module, "reset_parameters"):
            with job.global_rng():  # this message's seed, whatever runs beside it
                module.reset_parameters()
    splits.set_tensors(job.model, shared)  # a layer with shared parameters too keeps them


class FFGGClient(_FFGGClientBase):
    """Fine-tune w with theta frozen, then send grad_theta f_m(theta, w) over the local data."""

    reply_key = GRADIENT

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        self.init_personal(job)
        seen = self.fine_tune_personal(job)
        if job.cfg.ffgg_init == "stored":
            job.save_personal()
        shared = job.shared_params()
        grads = training.full_gradient(job.model, shared, job.train_loader, job.device)
        norm = _norm(grads)
        record = to_record({n: g.cpu() for n, g in zip(job.split.shared, grads)})
        return record, {
            NUM_EXAMPLES: job.num_train,
            GRAD_NORM: norm,
            "data-passes": seen / max(1, job.num_train) + 1.0,
            **self.restored(job),
        }


class LocalFFGGClient(_FFGGClientBase):
    """One epoch of w-only SGD from a fresh init, then K alternating (w, theta) steps;
    sends the theta delta. ``momentum``, ``weight-decay`` and ``max-grad-norm`` (0: Alg. 4's
    plain steps) apply to the pairs as to the fine-tuning (module docstring)."""

    reply_key = DELTA

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        cfg = job.cfg
        self.init_personal(job)
        seen = self.fine_tune_personal(job)
        start = splits.get_tensors(job.model, job.split.shared)
        steps = cfg.local_steps or cfg.local_epochs * len(job.train_loader)
        result = training.alternating_sgd(
            job.model,
            job.personal_params(),
            job.shared_params(),
            job.train_loader,
            lr_first=job.personal_lr,
            lr_second=job.lr,
            steps=steps,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm,
            device=job.device,
        )
        if cfg.ffgg_init == "stored":
            job.save_personal()
        end = splits.get_tensors(job.model, job.split.shared)
        delta = {n: start[n] - end[n] for n in job.split.shared}
        norm = _norm(delta.values())
        return to_record(delta), {
            NUM_EXAMPLES: job.num_train,
            "train-loss": result.loss,
            GRAD_NORM: norm,
            "data-passes": (seen + result.examples) / max(1, job.num_train),
            **self.restored(job),
        }


class BRFFGG(FFGG):
    """BR-FFGG's server (Alg. 5): ``theta <- theta - gamma_theta * ARAgg(g_1, ..., g_M)``.

    FFGG whose server combines the clients' gradients with a (delta, c)-robust aggregator
    (Def. 2) instead of the mean: any pflower rule (``robust``), made agnostic by bucketing
    (``Bucketing(rule, s=2)``, the default of the app's ``br-ffgg``). Byzantine clients may
    send anything; malformed replies are dropped before the rule sees them.

    Parameters
    ----------
    robust : Aggregator or None (default: None)
        The robust rule (``pflower.strategies.aggregators``); ``None``: the app's for
        BR-FFGG (``BR_FFGG_DEFAULTS``: bucketing with s = 2, then the coordinate median).
    byzantine : int (default: ``robust-byzantine``)
        f, the Byzantine clients per round to tolerate (checked against the rule).
    **kwargs
        The parameters of ``FFGG`` and ``PersonalizedStrategy``.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("br-ffgg", "ffgg", "async-ffgg")
    defaults = BR_FFGG_DEFAULTS
    #: the paper's rule is its default, in every round (not FFGG's defence, which would clip
    #: the rounds too small for it: ``robust-small-rounds``)
    defence = {}


#: this file's algorithms
ALGORITHMS = {
    "ffgg": Algorithm(FFGG, FFGGClient(), settings=(FFGGSettings,)),
    "local-ffgg": Algorithm(LocalFFGG, LocalFFGGClient(), settings=(FFGGSettings,)),
    "br-ffgg": Algorithm(BRFFGG, FFGGClient(), settings=(FFGGSettings,)),
}
