"""Baselines: FedAvg, FedAvg + fine-tuning, and local training (no federation).

- ``fedavg`` (McMahan et al. 2017): every parameter is shared. Server:
  ``theta <- sum_i n_i theta_i / sum_i n_i`` over the sampled clients. Client: ``local-epochs``
  (or ``local-steps``) of SGD on the received model; reply key ``arrays``.
- ``fedavg-ft``: trained exactly as FedAvg; at evaluation each client fine-tunes the
  personal part of ``split`` (e.g. the head) for ``finetune-epochs`` with the rest frozen,
  starting from the received model, and reports that personalized model next to the global
  one. The fine-tuned copy never leaves the client.
- ``local-gd``: FedAvg whose clients take tau full-batch gradient steps on the whole model
  (tau = ``local-steps``, or ``local-epochs`` when that is 0), the "Local GD" baseline of
  Mishchenko et al. §3.2 (non-personalized; step 1/(L tau) there).
- ``local``: every parameter is personal (split ``full``): each client trains its own model
  alone, kept in its store between rounds; nothing is aggregated. Sampling is the same as
  the federated algorithms', so each client gets the same local compute per round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord

from pflower.strategies.client import ClientHalf, ClientJob, train_metrics
from pflower.strategies.registry import Algorithm
from pflower.strategies.server import PersonalizedStrategy
from pflower.task import train as training
from pflower.task.split import make_split
from pflower.wire import ClientUpdate

if TYPE_CHECKING:
    pass


class FedAvg(PersonalizedStrategy):
    """Federated averaging of the shared weights, weighted by the clients' data sizes.

    Implementation of McMahan et al., *Communication-Efficient Learning of Deep Networks
    from Decentralized Data* (AISTATS 2017), on pflower's base strategy (uniform sampling
    without replacement, reply checks that drop instead of raising). The mean goes through
    the server optimizer as the pseudo-gradient ``current - mean``: SGD with server lr 1
    (the default) is FedAvg; Adam gives FedAdam (Reddi et al. 2021). Takes the parameters
    of ``PersonalizedStrategy``.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("fedavg", "fedavg-ft")

    def aggregate(
        self, server_round, current, updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        return self.average_weights(current, updates)


class Local(PersonalizedStrategy):
    """No federation: clients train alone; the server only schedules and collects metrics."""

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("local",)
    federates = False  # nothing shared moves: the run's result is each client's own model

    def aggregate(self, server_round, current, updates) -> dict[str, np.ndarray]:
        return current


class FedAvgClient(ClientHalf):
    """Local SGD on the whole received model; the personalized model is the global one."""

    personalizes = False
    users_loop = True

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        result = job.sgd(job.shared_params(), lr=job.lr)
        return job.shared_record(), train_metrics(job, result)

    def new_client(self, job: ClientJob) -> None:
        """A new client uses the received model as it is (no personal part)."""

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        """FedAvg does not personalize."""


class FedAvgFineTuneClient(FedAvgClient):
    """FedAvg training; evaluation after fine-tuning the ``split``'s personal part."""

    personalizes = True

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        # The received model is the init of the fine-tuning; the copy stays here.
        job.fine_tune(make_split(job.model, job.cfg.split, job.cfg.personal_patterns).personal)


class LocalGDClient(FedAvgClient):
    """tau full-batch gradient-descent steps on the whole received model."""

    users_loop = False

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        steps = job.cfg.local_steps or job.cfg.local_epochs
        seen = training.gradient_descent(
            job.model,
            job.shared_params(),
            job.train_loader,
            lr=job.lr,
            steps=steps,
            device=job.device,
        )
        result = training.TrainResult(loss=float("nan"), steps=steps, examples=seen)
        metrics = train_metrics(job, result)
        del metrics["train-loss"]  # full-batch GD computes no minibatch loss
        return job.shared_record(), metrics


class LocalClient(ClientHalf):
    """Each client trains its own whole model, kept in its store between rounds."""

    has_global = False
    users_loop = True

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        job.restore_personal()
        result = job.sgd(job.personal_params(), lr=job.lr)
        job.save_personal()
        return ArrayRecord(), train_metrics(job, result)

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        job.restore_personal()


#: this file's algorithms, as the app and the config know them
ALGORITHMS = {
    "fedavg": Algorithm(FedAvg, FedAvgClient(), "none", "none", numpy_client=True),
    "fedavg-ft": Algorithm(FedAvg, FedAvgFineTuneClient(), "none", "config", numpy_client=True),
    "local": Algorithm(Local, LocalClient(), "full", "full"),
    "local-gd": Algorithm(FedAvg, LocalGDClient(), "none", "none", numpy_client=True),
}
