"""Scaffold: Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, *SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning* (ICML 2020). A non-personalized baseline of Mishchenko et
al. §3.2 (every parameter shared; outer step 0.5, inner step 1/(L tau) there).

Algorithm 1 of the paper, with server control variate c and client control variates c_i::

    server: x, c = 0
    for r = 0, 1, ...:
        sample S; send (x, c) to every i in S
        client i:  y_i = x
                   repeat K times: y_i <- y_i - eta_l (g_i(y_i) - c_i + c)    # corrected steps
                   c_i^+ = g_i(x)                            (option I:  full-gradient)
                        or c_i - c + (x - y_i) / (K eta_l)   (option II: local-steps, default)
                   send  Delta y_i = y_i - x  and  Delta c_i = c_i^+ - c_i ;  c_i <- c_i^+
        server: x <- x + eta_g mean_i Delta y_i ;  c <- c + (|S| / N) mean_i Delta c_i

On the wire: the client sends ``delta`` = x - y_i (pflower's sign convention: start minus
end, so the server optimizer's SGD step with lr eta_g = ``server-lr`` is the line above) and
``control-delta`` = Delta c_i; the server sends ``control`` = c with each training message.
c_i is client state: kept in the client's store, never sent. Means are unweighted, as in
the paper. ``K`` is ``local-steps`` (or ``local-epochs`` passes); a full-batch loader
(``batch-size`` >= the local data) makes the steps gradient descent, as in §3.2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from pydantic import Field

from pflower.settings import Settings
from pflower.strategies.client import ClientJob, train_metrics
from pflower.strategies.fedavg import FedAvgClient
from pflower.strategies.registry import Algorithm
from pflower.strategies.server import PersonalizedStrategy
from pflower.task import train as training
from pflower.wire import DELTA, ClientUpdate, to_record

if TYPE_CHECKING:
    from pflower.settings import RunSettings


class ScaffoldSettings(Settings):
    """Scaffold's own key."""

    scaffold_control: Literal["local-steps", "full-gradient"] = Field(
        "local-steps",
        alias="scaffold-control",
        description=(
            "Scaffold's control-variate update of c_i: `local-steps` (option II, from the local "
            "steps) or `full-gradient` (option I, a full local gradient at the received x)"
        ),
    )


if TYPE_CHECKING:

    class RunConfig(RunSettings, ScaffoldSettings):
        """What this file reads of a run config: the run-level keys and Scaffold's
        own (the composed ``pflower.config.Config``, defined above this file, is one)."""


CONTROL = "control"  # server -> client: c
CONTROL_DELTA = "control-delta"  # client -> server: c_i^+ - c_i
CLIENT_CONTROL = "scaffold-control"  # store key of c_i


class Scaffold(PersonalizedStrategy):
    """Scaffold's server: ``x <- x - eta_g mean(delta)``, ``c <- c + |S|/N mean(Delta c)``.

    ``eta_g`` is the server optimizer's lr (``server-lr``). Takes the parameters of
    ``PersonalizedStrategy``; replies carry ``delta`` and ``control-delta``.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("scaffold",)

    #: what a checkpoint keeps besides the base strategy's (``pflower.checkpoint``): c
    checkpoint_attributes = ("control",)

    def __init__(self, **kwargs) -> None:
        super().__init__(reply_key=DELTA, **kwargs)
        self.extra_reply_keys = (CONTROL_DELTA,)
        self.control: dict[str, np.ndarray] | None = None
        self.num_nodes = 0

    def extra_content(self, server_round: int) -> dict[str, ArrayRecord]:
        if self.control is None:  # c = 0, shaped like the shared parameters
            self.control = {k: np.zeros(a.shape, a.numpy().dtype) for k, a in self._current.items()}
        return {CONTROL: ArrayRecord({k: Array(v) for k, v in self.control.items()})}

    def configure_train(self, server_round, arrays, config, grid):
        self.num_nodes = len(list(grid.get_node_ids()))  # N of the c update
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        ones = [1.0] * len(updates)
        if self.pipeline.combine.single_release:
            # central DP: (delta, control delta) as one vector, one clip, one release
            tag = CONTROL_DELTA + "/"
            joint = self.combine(
                [
                    {**u.tensors, **{tag + k: v for k, v in u.extra[CONTROL_DELTA].items()}}
                    for u in updates
                ],
                ones,
            )
            mean_delta = {k: joint[k] for k in current}
            mean_dc = {k: joint[tag + k] for k in self.control}
        else:
            mean_delta = self.combine([u.tensors for u in updates], ones)
            # the robust rule (when set) combines the control deltas too: c is applied to
            # every client's every step, a Byzantine Delta c as much as a Byzantine delta
            mean_dc = self.combine(
                [u.extra[CONTROL_DELTA] for u in updates], ones, kind=CONTROL_DELTA
            )
        # c += (1/N) sum_S dc_i = (|S|/N) mean; under central DP the mean is over the planned
        # sample (a dropped reply a zero), so |S| is that sample, not the replies kept: a
        # factor that counted the kept replies would scale the released c by the data
        kept = self.privacy.divisor if self.central_dp else len(updates)
        share = kept / max(self.num_nodes, kept)
        # np.asarray: a 0-dim c plus a scalar is a NumPy scalar, which Array refuses
        self.control = {
            k: np.asarray(c + share * mean_dc[k], dtype=c.dtype) for k, c in self.control.items()
        }
        return self.server_optimizer.step(current, mean_delta)


class ScaffoldClient(FedAvgClient):
    """K corrected local steps from x; updates and stores c_i; sends both deltas."""

    reply_key = DELTA
    users_loop = False  # every step is corrected by c - c_i

    def train(self, job: ClientJob, config: Mapping) -> tuple[dict, dict[str, float]]:
        if CONTROL not in job.received:
            raise ValueError(
                f"the training message has no {CONTROL!r} record: is the server running "
                "the Scaffold strategy?"
            )
        lr = job.lr
        names, params = job.split.shared, job.shared_params()
        control = job.received[CONTROL].to_torch_state_dict()
        c = [control[n].to(job.device) for n in names]
        zeros = {n: torch.zeros_like(p, device="cpu") for n, p in zip(names, params)}
        stored = job.load(CLIENT_CONTROL, zeros)
        c_i = [(stored or zeros)[n].to(job.device) for n in names]
        x = [p.detach().clone() for p in params]
        if job.cfg.scaffold_control == "full-gradient":  # option I: g_i(x), before the steps
            c_new = training.full_gradient(job.model, params, job.train_loader, job.device)
        result = job.sgd(params, lr=lr, correction=[ci_g - ci for ci_g, ci in zip(c, c_i)])
        with torch.no_grad():
            if job.cfg.scaffold_control == "local-steps" and result.steps == 0:
                c_new = c_i  # no step taken: nothing learned about the drift
            elif job.cfg.scaffold_control == "local-steps":  # option II
                scale = 1.0 / (result.steps * lr)
                c_new = [ci - cg + scale * (xi - p) for ci, cg, xi, p in zip(c_i, c, x, params)]
            delta = {n: (xi - p).cpu() for n, xi, p in zip(names, x, params)}
            dc = {n: (cn - ci).cpu() for n, cn, ci in zip(names, c_new, c_i)}
        job.store.save(CLIENT_CONTROL, {n: cn.detach().cpu() for n, cn in zip(names, c_new)})
        records = {DELTA: to_record(delta), CONTROL_DELTA: to_record(dc)}
        return records, train_metrics(job, result)


#: this file's algorithm: non-personalized, every parameter crosses the wire
ALGORITHMS = {
    "scaffold": Algorithm(Scaffold, ScaffoldClient(), "none", "none", settings=(ScaffoldSettings,))
}
