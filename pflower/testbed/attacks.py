"""Byzantine clients for robustness experiments, chosen per SuperNode by node config.

``--node-config "... byzantine='sign-flip'"`` makes that node's experiment ClientApp
(``pflower.testbed.client_app``; the production one refuses such a node) train honestly and
then corrupt its reply (or, for ``label-flip``, train on corrupted labels):

- ``sign-flip``: the update u is replaced by ``-byzantine-scale * u`` (u = the gradient or
  delta it sends, or ``received - returned`` weights for algorithms that return weights);
- ``gaussian``: u is replaced by N(0, ``byzantine-sigma``^2) noise;
- ``nan`` / ``inf``: every entry NaN / +Inf;
- ``wrong-shape``: the first tensor gets one extra entry;
- ``label-flip``: trains on labels ``C - 1 - y`` (classifiers only).

Attacks that need the honest clients' updates are simulated on the server (an *omniscient*
adversary that sees every honest reply of the round; off by default):

- ``alie`` ("A little is enough", Baruch et al. 2019): every Byzantine sends mu - z sigma, the
  coordinate-wise mean and standard deviation of the honest updates, with
  z = Phi^-1((n - s) / n), s = floor(n/2 + 1) - f for n replies of which f Byzantine (or the
  node config's ``byzantine-z``); small enough to hide inside the honest spread, so median- and
  distance-based rules pick it, and all Byzantines send the same vector (they collude);
- ``ipm`` (inner-product manipulation, Xie et al. 2020): every Byzantine sends -epsilon mu
  (``byzantine-epsilon``, default 0.1), which makes the inner product of the aggregate with the
  true mean negative when enough of them get through;
- ``min-max`` / ``min-sum`` (Shejwalkar & Houmansadr, NDSS 2021, their aggregation-agnostic
  attacks): every Byzantine sends mu - gamma p, p the perturbation ``byzantine-direction``
  (``std``: the coordinate-wise standard deviation, the default; ``unit``: mu / ||mu||;
  ``sign``: sign(mu)), gamma the largest that the paper's halving search (gamma_init = 10,
  tau = 1e-5) finds with the malicious vector no farther from any honest update than the
  honest updates are from each other (Min-Max: max_i ||m - g_i|| <= max_ij ||g_i - g_j||) or
  with its sum of squared distances to them no larger than any honest update's (Min-Sum).

A targeted attack, ``backdoor``, trains on a poisoned copy of the node's data
(``pflower.testbed.backdoor``).

Such a node trains honestly and tags its reply (metric ``byzantine-omniscient``); the
testbed's ServerApp (``pflower.testbed.server_app``, for the run config ``attack-simulation =
true``) inserts ``OmniscientAttack`` into the strategy's reply pipeline, a stage between
admission and the bounds that replaces the tagged replies with the attack vector computed
from the untagged ones, in update space: what such a client would send, which the bounds
then judge as any reply. Without it the node refuses to run: a real client
cannot see the others' updates, and an ALIE node that silently behaved honestly would make a
robustness table lie. Off by default: a node without ``byzantine`` is honest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch.utils.data import TensorDataset

from pflower.strategies import aggregators
from pflower.testbed import backdoor
from pflower.wire import ARRAYS, OMNISCIENT_TAG, ClientUpdate

if TYPE_CHECKING:
    from pflower.config import Config
    from pflower.strategies.client import ClientJob

log = logging.getLogger("flwr.pflower")

ATTACKS = (
    "none",
    "sign-flip",
    "gaussian",
    "nan",
    "inf",
    "wrong-shape",
    "label-flip",
    "alie",
    "ipm",
    "min-max",
    "min-sum",
    "backdoor",
)
UPDATE_ATTACKS = ("sign-flip", "gaussian", "nan", "inf", "wrong-shape")
#: attacks simulated on the server; the reply's metric OMNISCIENT_KEY names which
OMNISCIENT = {"alie": 1, "ipm": 2, "min-max": 3, "min-sum": 4}
#: Min-Max / Min-Sum perturbation directions, by the code their tag carries
DIRECTIONS = {"std": 1, "unit": 2, "sign": 3}
OMNISCIENT_KEY = OMNISCIENT_TAG  # the wire's: the server drops it without this module


def attack_of(node_config: Mapping) -> str:
    """The node's attack (``byzantine`` in its node config), validated."""
    attack = str(node_config.get("byzantine", "none"))
    if attack not in ATTACKS:
        raise ValueError(f"node config 'byzantine' = {attack!r}: must be one of {ATTACKS}")
    return attack


def omniscient_tag(attack: str, node_config: Mapping, attack_simulation: bool) -> dict:
    """The metrics an ALIE / IPM node adds to its honest reply (empty for other nodes)."""
    if attack not in OMNISCIENT:
        return {}
    if not attack_simulation:
        raise ValueError(
            f"node config 'byzantine' = {attack!r} needs the honest clients' updates: set the run "
            "config 'attack-simulation' = true (the server then simulates the omniscient "
            "adversary); a real client cannot see them"
        )
    direction = str(node_config.get("byzantine-direction", "std"))
    if direction not in DIRECTIONS:
        raise ValueError(
            f"node config 'byzantine-direction' = {direction!r}: must be one of "
            f"{tuple(DIRECTIONS)}"
        )
    return {
        OMNISCIENT_KEY: OMNISCIENT[attack],
        "byzantine-z": float(node_config.get("byzantine-z", 0.0)),
        "byzantine-epsilon": float(node_config.get("byzantine-epsilon", 0.1)),
        "byzantine-direction": DIRECTIONS[direction],
    }


def alie_z(n: int, f: int) -> float:
    """Baruch et al.'s z_max for n inputs of which f Byzantine: the largest z such that the
    Byzantine vector is still closer to the mean than s = floor(n/2 + 1) - f honest inputs.
    Where the Byzantines are a majority of the round (s <= 0: any z gets them chosen) s is
    taken as 1, the largest z the paper's formula gives (Phi^-1((n - 1) / n))."""
    s = max(1, n // 2 + 1 - f)
    return NormalDist().inv_cdf((n - s) / n)


def alie(honest: torch.Tensor, n: int, f: int, z: float = 0.0) -> torch.Tensor:
    """ALIE's vector mu - z sigma over the honest rows (coordinate-wise; sigma unbiased);
    ``z`` = 0 means Baruch et al.'s z_max for n replies of which f Byzantine."""
    z = z or alie_z(n, f)
    std = honest.std(dim=0) if len(honest) > 1 else torch.zeros_like(honest[0])
    return honest.mean(dim=0) - z * std


def ipm(honest: torch.Tensor, epsilon: float) -> torch.Tensor:
    """IPM's vector -epsilon times the honest mean."""
    return -epsilon * honest.mean(dim=0)


def perturbation(honest: torch.Tensor, direction: str) -> torch.Tensor:
    """Min-Max / Min-Sum's p over the honest rows: ``std`` (coordinate-wise, unbiased),
    ``unit`` (mu / ||mu||) or ``sign`` (sign(mu))."""
    mu = honest.mean(dim=0)
    if direction == "std":
        return honest.std(dim=0) if len(honest) > 1 else torch.zeros_like(mu)
    if direction == "unit":
        return mu / mu.norm().clamp_min(1e-12)
    if direction == "sign":
        return torch.sign(mu)
    raise ValueError(f"direction {direction!r}: must be one of {tuple(DIRECTIONS)}")


def min_max_min_sum(
    honest: torch.Tensor, direction: str, objective: str, gamma_init: float = 10.0
) -> torch.Tensor:
    """Shejwalkar & Houmansadr's aggregation-agnostic attack: m = mu - gamma p, gamma by
    their halving search from ``gamma_init`` until it moves by less than tau = 1e-5, kept
    where the condition holds (``objective`` ``min-max``: max_i ||m - g_i||^2 <= max_ij
    ||g_i - g_j||^2; ``min-sum``: sum_i ||m - g_i||^2 <= max_i sum_j ||g_i - g_j||^2).
    gamma = 0 (the mean) where no tried gamma holds."""
    x = honest.to(torch.float64)
    mu, p = x.mean(dim=0), perturbation(x, direction)
    pairwise = torch.cdist(x, x) ** 2
    limit = pairwise.max() if objective == "min-max" else pairwise.sum(dim=1).max()

    def holds(gamma: float) -> bool:
        distances = ((x - (mu - gamma * p)) ** 2).sum(dim=1)
        value = distances.max() if objective == "min-max" else distances.sum()
        return bool(value <= limit)

    gamma, step, good = gamma_init, gamma_init, 0.0
    while abs(good - gamma) > 1e-5:  # the paper's loop: lambda_succ against lambda
        if holds(gamma):
            good = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return (mu - good * p).to(honest.dtype)


def corrupt(
    record: ArrayRecord,
    received: ArrayRecord,
    returns_weights: bool,
    attack: str,
    node_config: Mapping,
    seed: int = 0,
) -> ArrayRecord:
    """The reply ``record`` after ``attack``; ``received`` is what the server sent (needed to
    attack the update of algorithms that return weights)."""
    arrays = {k: a.numpy() for k, a in record.items()}
    if attack == "wrong-shape":
        first = next(iter(arrays))
        arrays[first] = np.append(arrays[first].ravel(), 0).astype(arrays[first].dtype)
        return ArrayRecord({k: Array(v) for k, v in arrays.items()})
    sent = {k: received[k].numpy() for k in arrays} if returns_weights else None
    update = {k: sent[k] - v for k, v in arrays.items()} if returns_weights else arrays
    rng = np.random.default_rng(seed)
    if attack == "sign-flip":
        scale = float(node_config.get("byzantine-scale", 1.0))
        bad = {k: -scale * u for k, u in update.items()}
    elif attack == "gaussian":
        sigma = float(node_config.get("byzantine-sigma", 1.0))
        bad = {k: rng.normal(0.0, sigma, u.shape) for k, u in update.items()}
    elif attack in ("nan", "inf"):
        bad = {k: np.full_like(u, np.nan if attack == "nan" else np.inf) for k, u in update.items()}
    elif attack == "backdoor":  # its update, trained on the poisoned data, boosted
        boost = backdoor.settings(node_config)[3]
        bad = {k: boost * u for k, u in update.items()}
    else:
        raise ValueError(f"attack {attack!r} does not act on replies")
    out = {k: (sent[k] - bad[k]) if returns_weights else bad[k] for k in bad}
    return ArrayRecord(
        {k: Array(np.ascontiguousarray(v, dtype=arrays[k].dtype)) for k, v in out.items()}
    )


def flip_labels(dataset: TensorDataset, num_classes: int) -> TensorDataset:
    """The same examples with labels ``C - 1 - y``."""
    x, y = dataset.tensors
    return TensorDataset(x, (num_classes - 1 - y.long()).to(y.dtype))


# --- the client side: what the experiment ClientApp of a Byzantine node does ---------------
def before_training(job: ClientJob, node_config: Mapping, cfg: Config) -> dict:
    """Prepare this node's attack on ``job``: ``label-flip`` swaps its training labels; ALIE /
    IPM nodes get the tag to add to their (honest) reply's metrics. Nothing for honest nodes."""
    from pflower.task.data import batched, dataset_info
    from pflower.task.train import is_classifier

    attack = attack_of(node_config)  # "none" unless a Byzantine node
    # refused before any training when the run does not simulate the omniscient adversary
    tag = omniscient_tag(attack, node_config, cfg.attack_simulation)
    if attack == "label-flip" and is_classifier(job.model):
        flipped = flip_labels(job.train_loader.dataset, dataset_info(cfg).num_classes)
        job.train_loader = batched(flipped, cfg.batch_size, True, job.train_loader.generator)
    if attack == "backdoor":
        if not is_classifier(job.model):
            raise ValueError("node config 'byzantine' = 'backdoor': needs a classifier")
        target, side, fraction, _ = backdoor.settings(node_config)
        shape = dataset_info(cfg).input_shape
        data = job.train_loader.dataset
        poisoned = backdoor.poison(data, shape, target, side, fraction, seed=job.partition_id)
        job.train_loader = batched(poisoned, cfg.batch_size, True, job.train_loader.generator)
    return tag


def after_training(
    records: dict[str, ArrayRecord],
    key: str,
    received: ArrayRecord,
    node_config: Mapping,
    seed: int,
) -> dict[str, ArrayRecord]:
    """The reply's records after this node's update attack (unchanged for other nodes)."""
    attack = attack_of(node_config)
    # a backdoor node's update is its own (trained on poisoned data) unless boosted
    boosted = attack == "backdoor" and backdoor.settings(node_config)[3] != 1.0
    if attack in UPDATE_ATTACKS or boosted:
        records = {
            **records,
            key: corrupt(records[key], received, key == ARRAYS, attack, node_config, seed),
        }
    return records


# --- the server side: the omniscient adversary, simulated ---------------------------------------
def simulate_omniscient(
    server_round: int,
    current: Mapping[str, np.ndarray],
    updates: list[ClientUpdate],
    *,
    weights: bool,
) -> list[ClientUpdate]:
    """Replace the replies that ALIE / IPM nodes tagged by the omniscient adversary's vector
    over this round's untagged replies. The attack acts in update space: ``current - w`` when
    the replies are weights (``weights``)."""
    tagged = [u for u in updates if OMNISCIENT_KEY in u.metrics]
    if not tagged:
        return updates
    honest = [u for u in updates if OMNISCIENT_KEY not in u.metrics]
    if not honest:
        log.warning("round %d: attack simulation has no honest reply to attack", server_round)
        return honest
    rows = [
        {k: current[k] - u.tensors[k] for k in current} if weights else u.tensors for u in honest
    ]
    X, layout = aggregators.stack(rows)
    out = []
    for u in updates:
        metrics = dict(u.metrics)
        code = metrics.pop(OMNISCIENT_KEY, None)
        z, eps = metrics.pop("byzantine-z", 0.0), metrics.pop("byzantine-epsilon", 0.1)
        direction = metrics.pop("byzantine-direction", DIRECTIONS["std"])
        if code is None:
            out.append(u)
            continue
        if code == OMNISCIENT["alie"]:
            vector = alie(X, len(updates), len(tagged), z)
        elif code == OMNISCIENT["ipm"]:
            vector = ipm(X, eps)
        else:  # min-max, min-sum
            name = {v: k for k, v in OMNISCIENT.items()}[int(code)]
            way = {v: k for k, v in DIRECTIONS.items()}[int(direction)]
            vector = min_max_min_sum(X, way, name)
        bad = aggregators.unstack(vector, layout)
        if weights:
            bad = {k: (current[k] - bad[k]).astype(current[k].dtype) for k in bad}
        out.append(ClientUpdate(u.node_id, bad, metrics, u.extra))
    log.info("round %d: attack simulation replaced %d replies", server_round, len(tagged))
    return out


class OmniscientAttack:
    """The omniscient adversary, simulated as a stage of the reply pipeline
    (``pipeline.ReplyPipeline.insert``): each round's tagged replies replaced by the attack
    vector over its untagged ones (``simulate_omniscient``)."""

    def __call__(self, rnd, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        return simulate_omniscient(rnd.number, rnd.current, updates, weights=rnd.weights)

