"""APFL: Deng, Kamani, Mahdavi, *Adaptive Personalized Federated Learning* (2020).

Client i keeps w_i (its copy of the global model), v_i (a private local model) and
alpha_i in [0, 1]; its personalized model is ``v_bar_i = alpha_i v_i + (1 - alpha_i) w``::

    every local step t (one minibatch xi, one step size eta_t for all three):
        w_i     <- w_i - eta_t grad f_i(w_i; xi)                         # FedAvg's local step
        v_i     <- v_i - eta_t grad_v f_i(v_bar_i; xi)   (= alpha_i grad f_i(v_bar_i); w detached)
        alpha_i <- Proj_[0,1](alpha_i - eta_t <v_i - w, grad f_i(v_bar_i; xi)>)   # if adaptive
    every tau steps: the sampled clients send w_i; server w = unweighted mean; broadcast w

**Which w v_bar mixes** (``apfl-mix-with``): ``global`` (the default) mixes the round's
received global model, held fixed over the round's steps: the model a device deploys and the
evaluation measures, ``alpha v + (1 - alpha) w_global`` (Algorithm 1's output). ``local``
mixes the client's own copy w_i as its local steps move it (Algorithm 1's training loop as
printed). With ``local``, w_i fits the client's data within the round faster than v (w takes
the full gradient, v alpha times it), so the alpha gradient's part -<w_i - w_global, grad>
is positive and larger than v's pull <v - w_global, grad> < 0: alpha falls, v's steps
shrink with it, and alpha = 0 absorbs; the personalized model is then the global one, worse
than v alone (the offline default, 10 rounds: 58.96% against 93.69% with ``global``;
docs/algorithms.md, "APFL details").

All three gradients of a step are taken at the step's starting point (the paper's
simultaneous update). The v and alpha gradients come from autograd through
``torch.func.functional_call`` on the mixed parameters, so d/d alpha is exact.

**One step-size schedule.** eta_t = ``lr`` * ``apfl-lr-decay`` ** t * s_r: the paper's decay
(0.99 per step; the default is 1, no decay: with 0.99 at 3 local steps a round, eta is 0.30 lr
by round 40, and on 5 classes per client APFL then ends below FedAvg, 66.3 +- 5.4% against
72.6 +- 1.4%, where without the decay it reaches 80.5 +- 1.5%, 3 seeds:
``benchmarks/experiments/apfl-decay.toml``)
over the global step t = ``(round - 1) * tau + k`` (derivable from the round number, so every
client follows it whether or not it was sampled in between), or the server's per-round
schedule factor s_r (``lr-schedule``, sent as ``lr-scale``; the message's ``lr`` is
``lr`` * s_r), never both: with ``apfl-lr-decay`` < 1 the server's schedule must be
``constant`` (s_r = 1), with another schedule the decay must be 1; the two together are
refused at start (``APFLSettings.check``) and by the client. v_i, alpha_i and the client's
own step count live in its store, also across rounds it is not sampled in, and never
travel: only w does.

Options: ``apfl-mixing`` = ``parameters`` (the paper, default) or ``outputs`` (the authors'
code: ``alpha model_v(x) + (1 - alpha) model_w(x)`` on the logits; the code's once-per-round
alpha update with its extra +0.02 alpha term is not reproduced); ``apfl-adaptive`` (default
true) with ``apfl-alpha`` the initial / fixed alpha; ``apfl-weighting`` ``uniform`` (the
paper) or ``num-examples``. tau = ``local-steps`` (or ``local-epochs`` passes).

Evaluation: personalized = v_bar with the received global w (what a device deploys);
global = the received w; ``localized`` = w after tau local steps (the paper's "FedAvg
localized"); ``local-part`` = v alone (alpha = 1); and the client's ``alpha``. A client
without state is a new client (eq. 17): v starts from w and is fine-tuned for
``finetune-epochs`` with w fixed before it is evaluated.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from flwr.app import ArrayRecord
from pydantic import Field
from torch import nn
from torch.func import functional_call

from pflower.settings import ConfigError, Settings, Weighting
from pflower.strategies.client import ClientHalf, ClientJob, tagged_metrics, train_metrics
from pflower.strategies.registry import Algorithm
from pflower.strategies.server import PersonalizedStrategy
from pflower.task import split as splits
from pflower.task import train as training
from pflower.task.run_model import build_run_model
from pflower.wire import (
    ALPHA,
    LOCAL_PART,
    LR_SCALE,
    NUM_EXAMPLES,
    PHASE,
    PRETRAIN,
    ClientUpdate,
)

if TYPE_CHECKING:
    from pflower.settings import RunSettings

log = logging.getLogger("flwr.pflower")

# --- wire contract: shares the whole global copy w (reply ``arrays``); the config record
# carries APFL's own round number (pre-training rounds excluded: the step schedule's t0);
# the device's store keeps v and alpha, which never travel
ROUND = "apfl-round"
V_KEY, ALPHA_KEY = "apfl-v", "apfl-alpha"


class APFLSettings(Settings):
    """APFL's own keys."""

    apfl_alpha: float = Field(
        0.5,
        alias="apfl-alpha",
        ge=0,
        le=1,
        description=(
            "APFL's initial (or fixed) α: 0.5, the authors' code's value. The paper's synthetic "
            "runs start at 0.01, where v barely moves at first (its step carries the factor α)"
        ),
    )
    apfl_adaptive: bool = Field(
        True,
        alias="apfl-adaptive",
        description=(
            "learn APFL's α by gradient steps (the paper's adaptive APFL); `false`: keep it fixed"
        ),
    )
    apfl_mixing: Literal["parameters", "outputs"] = Field(
        "parameters",
        alias="apfl-mixing",
        description=(
            "APFL's v̄: `parameters` (α v + (1−α) w, the paper) or `outputs` (mixed logits, the "
            "authors' code)"
        ),
    )
    apfl_mix_with: Literal["global", "local"] = Field(
        "global",
        alias="apfl-mix-with",
        description=(
            "the w in APFL's v̄ = α v + (1−α) w during v's and α's steps: `global` (the "
            "round's received model, fixed over the round: the model evaluated and deployed) "
            "or `local` (the client's copy w_i as its local steps move it: Algorithm 1 as "
            "printed, where α collapses to 0 on pathological splits, docs/algorithms.md)"
        ),
    )
    apfl_lr_decay: float = Field(
        1.0,
        alias="apfl-lr-decay",
        gt=0,
        le=1,
        description=(
            "η_t = `lr` · decay^t over the global step t = (round − 1)·τ + k; 1 (the default): "
            "no decay, η follows `lr-schedule`. The paper decays 1% per step (0.99): at τ = 3 "
            "that leaves 0.30·`lr` by round 40 and APFL's global model falls behind FedAvg's "
            "on 5 classes per client (docs/algorithms.md)"
        ),
    )
    apfl_weighting: Weighting = Field(
        "uniform",
        alias="apfl-weighting",
        description="APFL server mean of the w_i: `uniform` (the paper) or `num-examples`",
    )

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.apfl_lr_decay < 1 and cfg.lr_schedule != "constant":
            raise ConfigError(two_schedules(cfg.apfl_lr_decay, repr(cfg.lr_schedule)))


if TYPE_CHECKING:

    class RunConfig(RunSettings, APFLSettings):
        """What this file reads of a run config: the run-level keys and APFL's
        own (the composed ``pflower.config.Config``, defined above this file, is one)."""


def two_schedules(decay: float, schedule: str) -> str:
    """The error of a run that asks for both of APFL's step-size schedules."""
    return (
        f"keys 'apfl-lr-decay' = {decay:g} and 'lr-schedule' = {schedule}: APFL's step size "
        "follows one schedule, the per-step decay or the server's per-round schedule; set "
        "'apfl-lr-decay' = 1 to follow 'lr-schedule', or 'lr-schedule' = 'constant' to decay"
    )


#: APFL's keys at their defaults: ``APFL``'s constructor defaults
SETTINGS = APFLSettings()


class APFL(PersonalizedStrategy):
    """APFL's server: the mean of the returned w_i (unweighted by default), through the
    server optimizer (SGD with lr 1 by default: the plain mean).

    The step size eta_t has one schedule: each message's ``lr`` (``lr`` times the factor of
    ``lr_schedule``) with the clients' ``apfl-lr-decay`` = 1, or the clients' per-step decay
    with ``lr_schedule = "constant"``; a client asked for both refuses the round (the app's
    config refuses it at start).

    Parameters
    ----------
    weighted : bool (default: ``apfl-weighting == "num-examples"``)
        ``False``: the unweighted mean of the w_i (the paper); ``True``: weighted by the
        clients' training-set sizes (``apfl-weighting = "num-examples"``).
    **kwargs
        The parameters of ``PersonalizedStrategy``.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("apfl",)

    def __init__(
        self, *, weighted: bool = SETTINGS.apfl_weighting == "num-examples", **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.weighted = weighted

    @classmethod
    def from_config(cls, cfg: RunConfig, **settings) -> APFL:
        if cfg.apfl_mixing == "parameters":
            refuse_batchnorm(cfg, build_run_model(cfg))
        return cls(weighted=cfg.apfl_weighting == "num-examples", **settings)

    def aggregate(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        return self.average_weights(current, updates, weighted=self.weighted)

    def train_config(self, server_round: int) -> dict:
        settings = super().train_config(server_round)
        # the algorithm's round, from which each client derives the global step of eta_t
        settings[ROUND] = server_round - self.pretrain_rounds
        return settings


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: ``t`` itself where it is there already, else a copy (the tests
    stand a copying transfer in for a GPU)."""
    return t.to(device)


def _mix(alpha, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``alpha v + (1 - alpha) w`` as ``torch.lerp(w, v, alpha) = w + alpha (v - w)``: the
    same value (to rounding), with the same gradients (``alpha`` for v, ``<v - w, grad>``
    for alpha), in one fused op per tensor instead of four tracked ones (APFL's floor ratio
    1.39 -> 1.21, ``benchmarks/floor_ab.py``). Training, the personalized model and
    its evaluation all mix here. A tensor ``alpha``
    (float64, adaptive) enters cast to v's dtype, a differentiable cast, as the product
    ``alpha * v`` of a 0-dim float64 tensor and a float32 one was computed in float32 too."""
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(v.dtype)
    return torch.lerp(w, v, alpha)


class APFLClient(ClientHalf):
    """Local steps on (w, v, alpha) with one minibatch each; sends w."""

    def check(self, cfg, model, split, train_loop) -> None:
        super().check(cfg, model, split, train_loop)
        refuse_batchnorm(cfg, model)

    def _state(self, job: ClientJob) -> tuple[dict[str, torch.Tensor], float, int] | None:
        # the template is read for its names, shapes and dtypes (and its scale, for a state
        # far beyond 1): the parameters themselves, not a copy
        v = job.load(V_KEY, {n: p.detach() for n, p in job.params.items()})
        template = {
            "alpha": torch.zeros(1, dtype=torch.float64),
            "steps": torch.zeros(1, dtype=torch.int64),
        }
        extra = job.load(ALPHA_KEY, template)
        if v is None or extra is None:
            job.restored = False  # half a state is none: the client starts afresh
            return None
        alpha, steps = float(extra["alpha"]), int(extra["steps"])
        if not 0 <= alpha <= 1 or steps < 0:  # a state no APFL step can have produced
            log.warning("stored APFL state alpha = %s, steps = %s: re-initialising", alpha, steps)
            job.restored = False
            return None
        return v, alpha, steps

    def _save(self, job: ClientJob, v: dict[str, torch.Tensor], alpha: float, steps: int):
        job.store.save(V_KEY, {n: t.detach().cpu() for n, t in v.items()})
        job.store.save(
            ALPHA_KEY,
            {"alpha": torch.tensor([alpha], dtype=torch.float64), "steps": torch.tensor([steps])},
        )

    def _mixed_loss(self, job, v, alpha, w, x, y) -> torch.Tensor:
        """f_i at v_bar (parameters) or on the mixed outputs; w enters detached."""
        criterion = training.loss_fn(job.model)
        if job.cfg.apfl_mixing == "outputs":
            out_v = functional_call(job.model, v, (x,))
            with torch.no_grad():
                out_w = functional_call(job.model, w, (x,))
            return criterion(_mix(alpha, out_v, out_w), y)
        mixed = {n: _mix(alpha, v[n], w[n].detach()) for n in v}
        return criterion(functional_call(job.model, mixed, (x,)), y)

    def local_steps(
        self,
        job: ClientJob,
        v: dict[str, torch.Tensor],
        alpha: float,
        *,
        lr0: float,
        first_step: int,
        steps: int,
        train_w: bool = True,
        adaptive: bool | None = None,
    ) -> tuple[float, float, int]:
        """``steps`` APFL steps; returns (alpha, mean minibatch loss of v_bar, examples). v is
        updated in place: the caller's tensors hold the trained v, on their own device."""
        cfg = job.cfg
        adaptive = cfg.apfl_adaptive if adaptive is None else adaptive
        names = _names(job.model)
        params = dict(job.model.named_parameters())
        given = v
        v = {n: _to_device(given[n], job.device).requires_grad_(True) for n in names}
        a = torch.tensor(alpha, dtype=torch.float64, device=job.device, requires_grad=adaptive)
        criterion = training.loss_fn(job.model)
        total, examples = 0.0, 0
        job.model.train()
        # v_bar's w: the round's received one, or each step's starting w_i (apfl-mix-with)
        mix_received = cfg.apfl_mix_with == "global"
        received = {n: p.detach().clone() for n, p in params.items()} if mix_received else {}
        for k, (x, y) in enumerate(training._cycle(job.train_loader, steps)):
            x, y = x.to(job.device), y.to(job.device)
            eta = lr0 * cfg.apfl_lr_decay ** (first_step + k)
            w_now = {n: p.detach() for n, p in params.items()}  # the step's starting w
            if train_w:
                loss_w = criterion(job.model(x), y)
                g_w = torch.autograd.grad(loss_w, list(params.values()))
            w_bar = received if mix_received else w_now
            loss_bar = self._mixed_loss(job, v, a, w_bar, x, y)
            wrt = [*v.values(), *([a] if adaptive else [])]
            grads = torch.autograd.grad(loss_bar, wrt)
            with torch.no_grad():
                if train_w:  # exactly torch.optim.SGD's update, so alpha = 0 is FedAvg bit for bit
                    for p, g in zip(params.values(), g_w):
                        p.add_(g, alpha=-eta)
                for t, g in zip(v.values(), grads[: len(v)]):
                    t.add_(g, alpha=-eta)  # in place: no temporary eta * g per tensor
                if adaptive:
                    a -= eta * grads[-1]
                    a.clamp_(0.0, 1.0)
            total += float(loss_bar.detach()) * len(y)
            examples += len(y)
        with torch.no_grad():  # v went to the device as a copy (a GPU): the result comes back
            for n in names:
                if v[n] is not given[n]:
                    given[n].copy_(v[n])
        return float(a.detach()), total / max(1, examples), examples

    def _tau(self, job: ClientJob) -> int:
        return job.cfg.local_steps or job.cfg.local_epochs * len(job.train_loader)

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        scale = float(config.get(LR_SCALE, 1.0))
        if job.cfg.apfl_lr_decay < 1 and scale != 1.0:  # a server built by hand, say
            raise ValueError(two_schedules(job.cfg.apfl_lr_decay, f"factor {scale:g}"))
        tau = self._tau(job)
        state = self._state(job)
        if state is None:  # first visit: v from the received w, alpha_0
            v, alpha, count = (
                splits.get_tensors(job.model, _names(job.model)),
                job.cfg.apfl_alpha,
                0,
            )
        else:
            v, alpha, count = state
        t0 = (int(config[ROUND]) - 1) * tau
        # v is this job's own (a store's load returns new tensors; get_tensors copies): it
        # is stepped in place, without a copy first
        alpha, loss, seen = self.local_steps(job, v, alpha, lr0=job.lr, first_step=t0, steps=tau)
        self._save(job, v, alpha, count + tau)
        # compute: each step takes its minibatch through the model twice, once for w's
        # gradient and once for v_bar's (data-passes counts both, as FedAlt's two parts)
        result = training.TrainResult(loss=loss, steps=tau, examples=2 * seen)
        # alpha is personal: it stays in the store and never enters a reply
        return job.shared_record(), train_metrics(job, result)

    def new_client(self, job: ClientJob) -> None:
        """The global model: the received w as it is."""

    def personal_model(self, job: ClientJob) -> tuple[dict[str, torch.Tensor], float]:
        """This client's (v, alpha); without state (a new client, eq. 17) v starts from the
        received w and is fine-tuned for ``finetune-epochs`` with w fixed. The model keeps w."""
        state = self._state(job)
        if state is not None:
            return state[0], state[1]
        w = splits.get_tensors(job.model, _names(job.model))
        v, alpha = {n: t.clone() for n, t in w.items()}, job.cfg.apfl_alpha
        steps = job.cfg.finetune_epochs * len(job.train_loader)
        if steps:
            lr0 = job.cfg.effective_finetune_lr
            alpha, _, _ = self.local_steps(
                job, v, alpha, lr0=lr0, first_step=0, steps=steps, train_w=False
            )
        return {n: t.detach() for n, t in v.items()}, alpha

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        """Parameter mixing: set the model to v_bar = alpha v + (1 - alpha) w."""
        v, alpha = self.personal_model(job)
        w = splits.get_tensors(job.model, _names(job.model))
        splits.set_tensors(job.model, {n: _mix(alpha, v[n], w[n]) for n in w})

    def evaluate(self, job: ClientJob, config: Mapping) -> dict[str, float]:
        """Global (w), personalized (v_bar, either mixing), v alone (``local-part``: a
        personalized model worse than it is a degenerate alpha) and localized (w after tau
        local steps, the paper's "FedAvg localized") on this client's test split, and alpha."""
        if config.get(PHASE) == PRETRAIN:
            return super().evaluate(job, config)
        w = splits.get_tensors(job.model, _names(job.model))
        glob = job.evaluate()
        v, alpha = self.personal_model(job)
        mixed = _Mixture(job.model, v, alpha, w, job.cfg.apfl_mixing)
        pers = training.evaluate(mixed, job.test_loader, job.device)
        alone = training.evaluate(_Mixture(job.model, v), job.test_loader, job.device)
        job.sgd(job.shared_params(), lr=job.lr, steps=self._tau(job))
        local = job.evaluate()
        splits.set_tensors(job.model, w)
        metrics: dict[str, float] = {
            "partition-id": job.partition_id,
            "num-train": job.num_train,
            NUM_EXAMPLES: pers["num-examples"],
            # a diagnostic of the personalized model, as its accuracy is (docs/privacy.md)
            ALPHA: alpha,
        }
        tagged = (("global", glob), ("personal", pers), ("localized", local), (LOCAL_PART, alone))
        for which, out in tagged:
            metrics.update(tagged_metrics(which, out))
        return metrics


class _Mixture(nn.Module):
    """The personalized model v_bar as a module: mixed parameters or mixed outputs; v alone
    without ``w``."""

    def __init__(
        self, model: nn.Module, v, alpha: float = 1.0, w=None, mixing: str = "parameters"
    ) -> None:
        super().__init__()
        self.model, self.v, self.alpha, self.w, self.mixing = model, v, alpha, w, mixing
        self.loss = training.loss_fn(model)  # the run's loss and task, as the model's
        self.pflower_task = "classification" if training.is_classifier(model) else "regression"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w is None:
            return functional_call(self.model, self.v, (x,))
        if self.mixing == "outputs":
            out_v = functional_call(self.model, self.v, (x,))
            return _mix(self.alpha, out_v, functional_call(self.model, self.w, (x,)))
        mixed = {n: _mix(self.alpha, self.v[n], self.w[n]) for n in self.w}
        return functional_call(self.model, mixed, (x,))


def refuse_batchnorm(cfg: RunConfig, model: nn.Module) -> None:
    """APFL mixes parameters, not BatchNorm's running statistics: such a model needs the
    mixing of outputs."""
    norms = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if cfg.apfl_mixing == "parameters" and norms:
        raise ValueError(
            f"key 'model' = {cfg.model!r}: has BatchNorm; APFL's parameter mixing of "
            "running statistics is ill-defined: use apfl-mixing 'outputs' or a model "
            "without BatchNorm"
        )


#: this file's algorithm: APFL sends the whole global copy w; v and alpha (a whole model)
#: stay on the client
ALGORITHMS = {
    "apfl": Algorithm(
        APFL, APFLClient(), "none", "full", settings=(APFLSettings,), numpy_client=True
    )
}
