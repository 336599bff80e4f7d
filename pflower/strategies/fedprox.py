"""FedProx: Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, *Federated Optimization in
Heterogeneous Networks* (MLSys 2020). A baseline of PFLEGO's Table 1 (paper 003).

Algorithm 2 of the paper, with every parameter shared::

    for t = 0, 1, ...:
        S_t <- K clients; send w^t
        client k:  w_k^{t+1} ~ argmin_w  h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2
                   (here: ``local-epochs`` / ``local-steps`` of minibatch SGD from w^t, each
                   gradient ``grad F_k(w) + mu (w - w^t)``: the paper's inexact solver)
        server:    w^{t+1} = sum_k n_k w_k^{t+1} / sum_k n_k           (as FedAvg)

``mu`` = ``fedprox-mu``; ``mu = 0`` is FedAvg exactly. The paper's variable local work of
stragglers (gamma-inexactness) is not simulated: every sampled client runs the same steps,
so FedProx's rows get the same client compute as FedAvg's. The paper tunes ``mu`` over
{0.001, 0.01, 0.1, 1}; PFLEGO's comparison used 0.25.

- ``fedprox``: the global model is the personalized one (as ``fedavg``).
- ``fedprox-ft``: trained as FedProx; at evaluation each client fine-tunes the personal
  part of ``split`` for ``finetune-epochs`` from the received model (``fedavg-ft``'s
  evaluation), for the tables' personalized row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord
from pydantic import Field

from pflower.settings import Settings
from pflower.strategies.client import ClientJob, train_metrics
from pflower.strategies.fedavg import FedAvg, FedAvgClient, FedAvgFineTuneClient
from pflower.strategies.registry import Algorithm

if TYPE_CHECKING:
    from pflower.settings import RunSettings


class FedProxSettings(Settings):
    """FedProx's own key."""

    fedprox_mu: float = Field(
        0.01,
        alias="fedprox-mu",
        ge=0.0,
        description=(
            "FedProx's proximal weight mu: each client minimises F_k(w) + mu/2 ||w - w^t||^2 "
            "from the received w^t (0: FedAvg; the paper tunes it over 0.001 .. 1)"
        ),
    )


if TYPE_CHECKING:

    class RunConfig(RunSettings, FedProxSettings):
        """What this file reads of a run config: the run-level keys and FedProx's own."""


class FedProx(FedAvg):
    """FedProx's server: FedAvg's data-size weighted mean (``FedAvg``); the proximal term is
    the clients' (``FedProxClient``)."""

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("fedprox", "fedprox-ft")


class FedProxClient(FedAvgClient):
    """Local SGD on ``F_k(w) + mu/2 ||w - w^t||^2`` from the received ``w^t``."""

    users_loop = False  # every step carries the proximal gradient mu (w - w^t)

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        params = job.shared_params()
        received = [p.detach().clone() for p in params]  # w^t, the anchor of every step
        result = job.sgd(params, lr=job.lr, prox=(job.cfg.fedprox_mu, received))
        return job.shared_record(), train_metrics(job, result)


class FedProxFineTuneClient(FedProxClient):
    """FedProx training; evaluation after fine-tuning the ``split``'s personal part."""

    personalizes = True
    personalize = FedAvgFineTuneClient.personalize


#: this file's algorithms: every parameter crosses the wire
ALGORITHMS = {
    "fedprox": Algorithm(
        FedProx, FedProxClient(), "none", "none", settings=(FedProxSettings,), numpy_client=True
    ),
    "fedprox-ft": Algorithm(
        FedProx,
        FedProxFineTuneClient(),
        "none",
        "config",
        settings=(FedProxSettings,),
        numpy_client=True,
    ),
}
