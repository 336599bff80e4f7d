"""PFLEGO: Nikoloutsopoulos, Koutsopoulos, Titsias, *Personalized Federated Learning with
Exact Stochastic Gradient Descent*.

Model: shared body phi(x; theta) in R^M, per-client linear head W_i (with bias) that never
leaves the client. Objective ``L(psi) = sum_i alpha_i l_i(W_i, theta)``, alpha_i =
N_i / sum_j N_j, l_i the mean cross-entropy over client i's whole local set::

    server: for t: sample I_t (|I_t| = r of I clients); send theta_{t-1}; receive g_i
            theta_t = theta_{t-1} - rho * (I / r_t) * sum_{i in I_t} alpha_i g_i      (4)
    client i (theta frozen; full batch):
        first visit: W_i ~ U[0, 1), seeded by the client             (the authors' code)
        Phi = [phi(X_i; theta), 1]                       # ONCE, under no_grad
        repeat tau - 1: W_i <- W_i - beta grad_W l_i(W_i, theta)     # on Phi, closed form
        one forward/backward at (W_i, theta): g_W, g_theta, l_i  # l_i: head-loss
        W_i <- W_i - rho (I / r) g_W                                  (3)
        send g_theta                                     # computed BEFORE the (3) step

With r = I and the SGD server this is exactly one gradient-descent step on L (Prop. 1).
The closed-form head gradient on cached features is ``(softmax(Phi W^T) - Y)^T Phi / N``,
so the tau - 1 head steps cost no pass through the body: a round is 2 forward and 1
backward passes whatever tau (FedAvg / FedPer: tau forward and backward passes).

Settings: tau = ``local-steps``, beta = ``personal-lr`` (default ``lr``), rho = ``server-lr``
with ``server-optimizer`` Adam (``auto``'s choice for PFLEGO, one state for the whole run) or
SGD; ``pflego-alpha``: ``global`` (eq. 4; the server learns every N_j at start-up with a
query) or ``sampled`` (the authors' code: alpha normalised over the round's replies, no
I / r_t factor). ``pflego-local-labels``: a K_i-class head over the client's own classes
(``init_head``). ``pflego-head-alpha`` multiplies the head step (3) by alpha_i as eq. (5)
prints (default off: Alg. 1 and the code). ``pflego-freeze-body``: the server never moves
theta, so the same heads take the same steps on the body's random init: the random-features
baseline that tells what the trained body adds (under DP the noised body stays near
its init, and PFLEGO's heads on it beat every trained body). r_t is the number of usable
replies (realised); the head step uses the number of sampled clients (the client cannot know
r_t). I counts the clients that can be sampled: with ``holdout-fraction`` the held-out
clients (evaluated as new clients, never trained) are no part of L, so they count in neither
I, r nor sum_j N_j. A round with no usable reply leaves theta unchanged. The passes over
the whole local set (Phi, the exact gradient) go in chunks of ``eval-batch-size`` examples,
so memory stays bounded.

Evaluation: the personalized model is the client's stored head on the current body (a client
without one, never sampled yet, is a new client); the "global" model is what a brand-new
client gets: a fresh head trained for tau - 1 head steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np
import torch
from flwr.app import ArrayRecord
from pydantic import Field
from torch import nn

from pflower.settings import Settings
from pflower.strategies.client import ClientHalf, ClientJob
from pflower.strategies.registry import Algorithm
from pflower.strategies.server import PersonalizedStrategy
from pflower.task import train as training
from pflower.task.data.loaders import whole_set
from pflower.task.run_model import build_run_model, split_by_rule
from pflower.wire import GRADIENT, NUM_EXAMPLES, ClientUpdate, to_record

if TYPE_CHECKING:
    from pflower.settings import RunSettings

# --- wire contract: the reply is ``gradient`` (g_i, the theta-gradient of the client's
# loss); the server's config record carries the personal heads' step size rho * I / r
# (``HEAD_LR``) and, with eq. (5)'s head alpha, the training examples of all clients
HEAD_LR = "pflego-head-lr"
TOTAL_EXAMPLES = "pflego-total-examples"

AlphaMode = Literal["global", "sampled"]
ALPHA_MODES = get_args(AlphaMode)

#: PFLEGO's values for run-config keys left at ``auto`` (``config.AUTO``): the paper's tau
#: = 50 head-and-body steps per round and Adam's rho = 0.003 (docs/benchmarks/pflego-apfl.md; with
#: the generic server lr 1.0 Adam diverges, with tau = 1 the head never fits). The default
#: defence clips at 2x the lower-median distance, not 1x: Adam's step is scale-free, so what
#: an attacker's size buys is small either way, while clipping half of the honest gradients
#: every round (1x) re-weights the clients and cost PFLEGO's mnist-5c plateau 0.67 points
#: (2x: 0.37, benchmarks/results/mnist-5c-defence-pflego; one Byzantine node in ten at
#: defaults then costs 2.53 points, its honest clients 1.32: results/default-defence.md)
PFLEGO_DEFAULTS = {
    "local_steps": 50,
    "server_lr": 0.003,
    "server_optimizer": "adam",
    "robust_clip_factor": 2.0,
}


class PFLEGOSettings(Settings):
    """PFLEGO's own keys (``local-steps`` is its tau, ``server-lr`` its rho)."""

    pflego_alpha: AlphaMode = Field(
        "global",
        alias="pflego-alpha",
        description=(
            "PFLEGO's α_i: `global` (N_i/Σ_j N_j over all clients, learnt at start-up, with I/r_t) "
            "or `sampled` (normalised over the round's replies)"
        ),
    )
    pflego_head_alpha: bool = Field(
        False,
        alias="pflego-head-alpha",
        description="scale each PFLEGO head's step by its α_i too (eq. 5 read literally)",
    )
    pflego_freeze_body: bool = Field(
        False,
        alias="pflego-freeze-body",
        description=(
            "PFLEGO's server never moves θ: the same heads take the same steps on the body's "
            "random init (the random-features baseline)"
        ),
    )
    pflego_local_labels: bool = Field(
        False,
        alias="pflego-local-labels",
        description=(
            "PFLEGO head over the client's own K_i classes (labels re-indexed locally; absent "
            "classes get no probability) instead of all C"
        ),
    )


if TYPE_CHECKING:

    class RunConfig(RunSettings, PFLEGOSettings):
        """What this file reads of a run config: the run-level keys and PFLEGO's
        own (the composed ``pflower.config.Config``, defined above this file, is one)."""


#: PFLEGO's keys at their defaults: ``PFLEGO``'s constructor defaults
SETTINGS = PFLEGOSettings()

ABSENT_LOGIT = -1e4  # exp underflows to exactly 0 (float32 and float64)


def head_module(model: nn.Module, personal: tuple[str, ...]) -> tuple[str, nn.Linear]:
    """The model's last ``nn.Linear``, if its weight and bias are exactly the personal part;
    an error otherwise."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linears:
        name, module = linears[-1]
        own = {f"{name}.{n}" for n, _ in module.named_parameters(recurse=False)}
        if module.bias is not None and own == set(personal):
            return name, module
    raise ValueError(
        f"key 'split': PFLEGO personalizes exactly the last linear layer (weight and bias); "
        f"this split's personal part is {list(personal)}: use split 'head' (in your own "
        "ClientApp: personal='head')"
    )


def head_descent(
    phi: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    lr: float,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` gradient-descent steps of rate ``lr`` on the mean cross-entropy of the
    linear head ``phi @ W^T + b``, in closed form; returns the new ``(W, b)``.

    On ``[W | b]`` and ``Phi = [phi, 1]`` the gradient is ``(softmax(Phi [W | b]^T) - Y)^T
    Phi / N``, Y the one-hot labels: a step is one matmul for the logits, the softmax, and
    one fused ``[W | b] -= lr / N (P - Y)^T Phi`` (``addmm_``), with ``Phi`` and ``Y`` built
    once for all steps."""
    n = len(y)
    with torch.no_grad():
        phi1 = torch.cat([phi, phi.new_ones(n, 1)], dim=1)
        w = torch.cat([weight, bias[:, None]], dim=1)
        onehot = nn.functional.one_hot(y, w.shape[0]).to(phi.dtype)
        for _ in range(steps):
            p = torch.softmax(phi1 @ w.T, dim=1)
            p -= onehot
            w.addmm_(p.T, phi1, alpha=-lr / n)
    return w[:, :-1], w[:, -1]


@torch.no_grad()
def features(
    model: nn.Module, head: nn.Linear, loader, device, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """phi(X; theta) of the whole local set (the head's inputs), ``chunk`` examples at a time
    (``whole_set``), no grad."""
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, inp, out: captured.append(inp[0].detach()))
    ys = []
    model.eval()
    try:
        for x, y in whole_set(loader, chunk):
            model(x.to(device))
            ys.append(y.to(device))
    finally:
        hook.remove()
    return torch.cat(captured), torch.cat(ys).long()


class PFLEGO(PersonalizedStrategy):
    """PFLEGO's server: ``theta <- ServerOpt(theta, (I / r_t) sum_i alpha_i g_i)``.

    The server optimizer receives the combined gradient, never averaged weights; by default
    it is the app's for PFLEGO (``PFLEGO_DEFAULTS``: Adam at rho = ``server-lr``'s PFLEGO
    value, as in the paper's experiments). Replies carry ``gradient``.

    Parameters
    ----------
    alpha : str (default: ``pflego-alpha``)
        ``global`` (eq. 4: alpha_i = N_i / sum_j N_j over all clients, learnt at start-up,
        with I / r_t) or ``sampled`` (normalised over the round's replies).
    freeze_body : bool (default: ``pflego-freeze-body``)
        ``True``: theta stays at its initial (random) value; the clients' heads take their
        steps as ever (the random-features baseline).
    **kwargs
        The parameters of ``PersonalizedStrategy`` (their defaults: the app's for PFLEGO).
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("pflego",)
    defaults = PFLEGO_DEFAULTS

    @classmethod
    def from_config(cls, cfg: RunConfig, **settings) -> PFLEGO:
        if cfg.effective_task != "classification" or cfg.loss not in ("auto", "cross-entropy"):
            raise ValueError(
                f"key 'loss' = {cfg.loss!r}, 'task' = {cfg.effective_task!r}: PFLEGO's "
                "closed-form head steps are those of a softmax head under cross-entropy "
                "(classification)"
            )
        model = build_run_model(cfg)
        head_module(model, split_by_rule(model, cfg, "config").personal)  # other splits refused
        return cls(alpha=cfg.pflego_alpha, freeze_body=cfg.pflego_freeze_body, **settings)

    def __init__(
        self,
        *,
        alpha: str = SETTINGS.pflego_alpha,
        freeze_body: bool = SETTINGS.pflego_freeze_body,
        **kwargs,
    ) -> None:
        super().__init__(reply_key=GRADIENT, **kwargs)
        self.freeze_body = freeze_body
        self.federates = not freeze_body  # a frozen body never moves, by design
        if alpha not in ALPHA_MODES:
            raise ValueError(f"alpha = {alpha!r}: must be one of {ALPHA_MODES}")
        self.alpha = alpha
        self.nodes.query_num_train = alpha == "global"
        self.num_nodes = 0  # I: the clients that can be sampled for training
        self.held: set[int] = set()  # the held-out nodes (``holdout_fraction``)

    def configure_train(self, server_round, arrays, config, grid):
        nodes = list(grid.get_node_ids())
        # held-out clients are never sampled: no part of L, so not of I (nor of r, sum_j N_j)
        self.held = self.nodes.held_out(nodes) if self.nodes.holdout_fraction else set()
        self.num_nodes = len(nodes) - len(self.held)
        return super().configure_train(server_round, arrays, config, grid)

    def train_config(self, server_round: int) -> dict:
        settings = super().train_config(server_round)
        # rho (I / r) of the head step (3): the server lr and the planned sample size, as
        # ``sample`` draws it from the I trainable clients
        r = max(1, round(self.fraction_train * self.num_nodes))
        settings[HEAD_LR] = self.server_optimizer.lr * self.num_nodes / r
        if self.num_train_total:
            settings[TOTAL_EXAMPLES] = self.num_train_total
        return settings

    @property
    def num_train_total(self) -> float:
        """sum_j N_j over the I trainable clients (held-out ones excluded), each N_j its
        start-up claim bounded as the replies' weights are (``checks.ClaimBound.cap``): one
        node's claim of 1e12 scaled every honest alpha_i by ~1e-10."""
        known = self.nodes.num_train_of
        cap = self.pipeline.bound.claims.cap(known)
        return float(sum(min(n, cap) for node, n in known.items() if node not in self.held))

    def aggregate(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        if self.freeze_body:  # the random-features baseline: theta keeps its init
            return current
        sizes = [u.num_examples for u in updates]
        # the robust rule (or central DP's clipped, noised mean) over the g_i replaces the
        # alpha-sum, whose data-size weights would make the sensitivity depend on the claims
        if not self.pipeline.combine.weighted:
            return self.server_optimizer.step(
                current, self.combine([u.tensors for u in updates], sizes)
            )
        if self.alpha == "sampled":
            gradient = self.combine([u.tensors for u in updates], sizes)
        elif not self.pipeline.combine.exact_mean:
            # the alpha-sum over the clipped g_i: their total weight times their weighted mean
            total = self.num_train_total or float(sum(sizes))
            mass = self.num_nodes / len(updates) * sum(sizes) / total
            mean = self.combine([u.tensors for u in updates], sizes)
            gradient = {k: mass * g for k, g in mean.items()}
        else:
            total = self.num_train_total or float(sum(sizes))
            scale = self.num_nodes / len(updates)  # I / r_t, realised
            gradient = {
                k: scale
                * sum(n / total * u.tensors[k].astype(np.float64) for n, u in zip(sizes, updates))
                for k in current
            }
        return self.server_optimizer.step(current, gradient)


class PFLEGOClient(ClientHalf):
    """Head-only GD on cached features, then one exact gradient of (theta, W_i)."""

    reply_key = GRADIENT

    def check(self, cfg, model, split, train_loop) -> None:
        super().check(cfg, model, split, train_loop)
        head_module(model, split.personal)  # the head steps are a softmax head's

    def _head(self, job: ClientJob) -> nn.Linear:
        return head_module(job.model, job.split.personal)[1]

    def init_head(self, job: ClientJob) -> None:
        """U[0, 1) as in the authors' code, seeded by (seed, client). With
        ``pflego-local-labels`` the classes absent from the local training set get the bias
        ``ABSENT_LOGIT``: their softmax probability is exactly 0 in float32, so their
        gradient rows are 0 and they never move or get predicted, which is the paper's
        K_i-row head with locally re-indexed labels, kept in the model's C-row layout."""
        head = self._head(job)
        g = torch.Generator().manual_seed(job.cfg.seed * 1_000_003 + job.partition_id)
        with torch.no_grad():
            for p in (head.weight, head.bias):
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype))
            if job.cfg.pflego_local_labels:
                present = torch.zeros(head.out_features, dtype=torch.bool)
                present[job.train_loader.dataset.tensors[1].long().unique()] = True
                head.bias[~present] = ABSENT_LOGIT

    def restore_head(self, job: ClientJob) -> None:
        if not job.restore_personal():
            self.init_head(job)

    def head_steps(self, job: ClientJob, steps: int) -> None:
        """``steps`` closed-form GD steps of the head on phi(X; theta), computed once."""
        head = self._head(job)
        if steps <= 0:
            return
        phi, y = features(job.model, head, job.train_loader, job.device, job.cfg.eval_batch_size)
        weight, bias = head_descent(phi, y, head.weight, head.bias, job.personal_lr, steps)
        with torch.no_grad():
            head.weight.copy_(weight)
            head.bias.copy_(bias)

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        tau = job.cfg.local_steps or 1
        self.restore_head(job)
        self.head_steps(job, tau - 1)
        head = self._head(job)
        shared = job.shared_params()
        # head-loss: l_i(W_i, theta) where the exact gradient is taken (after the tau - 1
        # head steps, before (3)); the same pass, so it is there for tau = 1 too
        loss, grads = training.loss_and_gradient(
            job.model,
            [*shared, head.weight, head.bias],
            job.train_loader,
            job.device,
            chunk=job.cfg.eval_batch_size,
        )
        g_theta, (g_w, g_b) = grads[: len(shared)], grads[len(shared) :]
        rate = float(config[HEAD_LR])
        if job.cfg.pflego_head_alpha:
            rate *= job.num_train / float(config.get(TOTAL_EXAMPLES, job.num_train))
        with torch.no_grad():  # (3), after the gradient was taken
            head.weight -= rate * g_w
            head.bias -= rate * g_b
        job.save_personal()
        record = to_record({n: g.cpu() for n, g in zip(job.split.shared, g_theta)})
        return record, {
            NUM_EXAMPLES: job.num_train,
            "head-loss": loss,
            # the feature pass of the head steps (forward only, none for tau = 1) and the
            # exact gradient's forward and backward pass: the tau - 1 head steps are on Phi
            "data-passes": 2.0 if tau > 1 else 1.0,
            "personal-restored": float(job.restored),
        }

    def new_client(self, job: ClientJob) -> None:
        """A brand-new client: a fresh head, tau - 1 head steps on the current body."""
        self.init_head(job)
        self.head_steps(job, (job.cfg.local_steps or 1) - 1)

    def local_part(self, job: ClientJob) -> bool:
        """The stored head as trained, on the received body; the bare init for a client
        never sampled (``personalize`` fits that one as a new client's)."""
        self.restore_head(job)
        return True

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        """Its stored head; a client without one (never sampled yet) is a new client, whose
        personal part is a fitted head (``new_client``), not the bare U[0, 1) init: an
        unfitted head would count every such client as hurt by personalization."""
        if not job.restore_personal():
            self.new_client(job)


#: this file's algorithm
ALGORITHMS = {"pflego": Algorithm(PFLEGO, PFLEGOClient(), settings=(PFLEGOSettings,))}
