"""Ditto: Li, Hu, Beirami & Smith, *Ditto: Fair and Robust Federated Learning Through
Personalization* (ICML 2021). A baseline of the FedAlt paper (001) and of PFLEGO's Table 1.

Algorithm 1 of the paper (global objective solved by FedAvg, ``s`` personal steps a round)::

    for t = 0, 1, ...:
        S_t <- K clients; send w^t
        client k:  w_k^t <- local SGD on F_k from w^t               (as FedAvg; sent back)
                   v_k   <- the first w^t it receives, if it has none
                   s times: v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t))
                   (v_k stays on the client)
        server:    w^{t+1} = sum_k n_k w_k^t / sum_k n_k            (as FedAvg)

The regulariser pulls toward the *received* w^t, not the locally updated w_k^t. ``lambda``
= ``ditto-lambda``; ``s`` = ``personal-epochs`` (or ``personal-steps``) at ``personal-lr``
(default: the client ``lr``); the global part takes ``local-epochs`` / ``local-steps``.
lambda = 0 trains v_k alone (local training started from w); lambda -> infinity keeps v_k
at w^t. Evaluation: ``global`` is w, ``personalized`` is v_k (w for a client never trained).

v_k is a whole model of the client's, kept in its store (``ditto-v``) and never sent: a
training reply carries w_k^t only. A client does twice a FedAvg client's local work (the
global steps and the personal ones): the tables show it (``data-passes``). Model buffers
(batch-norm statistics) are not part of v_k: they follow the global training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord
from pydantic import Field

from pflower.settings import Settings
from pflower.strategies.client import ClientJob, train_metrics
from pflower.strategies.fedavg import FedAvg, FedAvgClient
from pflower.strategies.registry import Algorithm
from pflower.task import split as splits

if TYPE_CHECKING:
    from pflower.settings import RunSettings

V_KEY = "ditto-v"  # store key of v_k, the client's personal model


class DittoSettings(Settings):
    """Ditto's own key (its personal steps are the run-level ``personal-*`` keys)."""

    ditto_lambda: float = Field(
        0.1,
        alias="ditto-lambda",
        ge=0.0,
        description=(
            "Ditto's lambda: the personal model v_k minimises F_k(v) + lambda/2 ||v - w^t||^2 "
            "(0: v_k trained alone from w; large: v_k stays at the global w)"
        ),
    )


if TYPE_CHECKING:

    class RunConfig(RunSettings, DittoSettings):
        """What this file reads of a run config: the run-level keys and Ditto's own."""


class Ditto(FedAvg):
    """Ditto's server: FedAvg's data-size weighted mean of the global updates (``FedAvg``);
    the personal models are the clients' (``DittoClient``)."""

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("ditto",)


class DittoClient(FedAvgClient):
    """The global update as FedAvg's (sent), then the personal steps on v_k (kept)."""

    personalizes = True
    users_loop = False  # the personal steps carry the proximal gradient lambda (v - w^t)

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        cfg, params = job.cfg, job.shared_params()
        received = {n: p.detach().clone() for n, p in job.params.items()}  # w^t
        glob = job.sgd(params, lr=job.lr)
        reply = job.shared_record()  # w_k^t, copied into the reply before v_k is loaded
        self.restore_v(job, received)
        personal = job.sgd(
            params,
            lr=job.personal_lr,
            epochs=cfg.personal_epochs,
            steps=cfg.personal_steps,
            prox=(cfg.ditto_lambda, [received[n] for n in job.split.shared]),
        )
        job.store.save(V_KEY, {n: p.detach() for n, p in job.params.items()})
        return reply, {**train_metrics(job, personal, glob), "personal-loss": personal.loss}

    def restore_v(self, job: ClientJob, first: Mapping | None = None) -> bool:
        """The model set to this client's stored v_k; where it has none, to ``first`` (the
        w^t of its first round: v_k's init), or left at the received w. True if stored."""
        # the template is read for its names, shapes, dtypes and scale: the parameters
        stored = job.load(V_KEY, {n: p.detach() for n, p in job.params.items()})
        if stored is not None or first is not None:
            splits.set_tensors(job.model, stored if stored is not None else first, job.params)
        return stored is not None

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        """v_k on this client's data; a client never trained is the received w."""
        self.restore_v(job)

    def local_part(self, job: ClientJob) -> bool:
        """v_k is the personalized model itself: nothing is fitted at evaluation."""
        return False


#: this file's algorithm: every parameter of w crosses the wire; v_k is personal state
ALGORITHMS = {
    "ditto": Algorithm(Ditto, DittoClient(), "none", "full", settings=(DittoSettings,)),
}
