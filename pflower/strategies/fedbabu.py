"""FedBABU: Oh, Kim & Yun, *FedBABU: Toward Enhanced Representation for Federated Image
Classification* (ICLR 2022). A baseline of PFLEGO's Table 1 (paper 003), the strongest of its
No-Pers column.

The model is a body and a head (``split``: the head is the personal part). Algorithm 1 of the
paper, "Body Aggregation and Body Update"::

    head H <- random with orthogonal rows, once; never updated in federated training
    for t = 0, 1, ...:
        S_t <- K clients; send the body B^t
        client k:  local SGD on the body only, the head fixed at H        (sent back: B_k^t)
        server:    B^{t+1} = sum_k n_k B_k^t / sum_k n_k                  (as FedAvg)
    evaluation (personalized): from (B, H), ``finetune-epochs`` of SGD on the client's
                               training data -- the whole model (the paper), or the head
                               only (``fedbabu-finetune = "head"``)

**The head.** Every head parameter of two or more dimensions gets orthogonal rows (``torch``'s
``orthogonal_``, gain 1: the class weight vectors orthonormal, where the head has no more
classes than inputs) and every one-dimensional one (a bias) zeros, drawn from ``seed``: each
client computes the same H itself, so the head never needs to cross the wire and no reply can
move it (pflower's reading of the paper's "random initialization" with its orthogonality
analysis, and of PFLEGO's description, "orthogonal init at the server"). Pre-training rounds
(``pretrain-rounds``) freeze the head too: every training round is the body's.

``global`` is (B, H) as it stands; ``personalized`` is the fine-tuned copy, fitted afresh at
every evaluation and never kept or sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
from flwr.app import ArrayRecord
from pydantic import Field

from pflower.settings import ConfigError, Settings
from pflower.strategies.client import ClientHalf, ClientJob, train_metrics
from pflower.strategies.fedavg import FedAvg
from pflower.strategies.registry import Algorithm
from pflower.task import split as splits

if TYPE_CHECKING:
    from pflower.settings import RunSettings


class FedBABUSettings(Settings):
    """FedBABU's own key."""

    fedbabu_finetune: Literal["full", "head"] = Field(
        "full",
        alias="fedbabu-finetune",
        description=(
            "FedBABU's personalization at evaluation: `full` (fine-tune the whole model, the "
            "paper) or `head` (the head only), for `finetune-epochs`"
        ),
    )

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.algorithm == "fedbabu" and cfg.split != "head" and not cfg.split_patterns:
            raise ConfigError(
                f"key 'split' = {cfg.split!r}: algorithm 'fedbabu' fixes the head and "
                "federates the body; use split 'head' (or 'split-patterns' naming the head)"
            )


if TYPE_CHECKING:

    class RunConfig(RunSettings, FedBABUSettings):
        """What this file reads of a run config: the run-level keys and FedBABU's own."""


def fixed_head(template: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """H: orthogonal rows for every parameter of two or more dimensions (flattened after the
    first), zeros for the others, drawn from ``seed`` in the order of ``template``."""
    generator = torch.Generator().manual_seed(int(seed))
    head = {}
    for name, t in template.items():
        value = torch.zeros(t.shape, dtype=t.dtype)
        if t.dim() >= 2:
            flat = torch.empty(t.shape[0], t[0].numel(), dtype=torch.float64)
            torch.nn.init.orthogonal_(flat, generator=generator)
            value = flat.reshape(t.shape).to(t.dtype)
        head[name] = value
    return head


class FedBABU(FedAvg):
    """FedBABU's server: FedAvg's data-size weighted mean of the bodies (``FedAvg``, on the
    shared part of ``split``); the head is the clients' fixed H (``FedBABUClient``)."""

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("fedbabu",)


class FedBABUClient(ClientHalf):
    """Body-only local SGD with the head fixed at H; fine-tuning at evaluation."""

    users_loop = True  # plain SGD on the body

    def new_client(self, job: ClientJob) -> None:
        """The head at H (a server's ``personal-init`` slice is not used: H is fixed)."""
        splits.set_tensors(job.model, fixed_head(job.init_personal, job.cfg.seed), job.params)

    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        self.new_client(job)
        result = job.sgd(job.shared_params(), lr=job.lr)
        return job.shared_record(), train_metrics(job, result)

    def pretrain(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        """A pre-training round is a FedBABU round on the whole model's message: the body
        trained, the head at H (sent back as it came: H)."""
        self.new_client(job)
        result = job.sgd(job.shared_params(), lr=job.lr)
        return job.record_of([n for n, _ in job.model.named_parameters()]), train_metrics(
            job, result
        )

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        self.new_client(job)
        if job.cfg.fedbabu_finetune == "head":
            job.fine_tune(job.split.personal)
        else:
            job.fine_tune([n for n, _ in job.model.named_parameters()])


#: this file's algorithm: the body crosses the wire; the head is fixed on every client
ALGORITHMS = {
    "fedbabu": Algorithm(FedBABU, FedBABUClient(), settings=(FedBABUSettings,)),
}
