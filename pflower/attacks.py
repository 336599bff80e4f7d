"""Byzantine clients for robustness experiments, chosen per SuperNode by node config.

``--node-config "... byzantine='sign-flip'"`` makes that node's ClientApp train honestly and
then corrupt its reply (or, for ``label-flip``, train on corrupted labels):

- ``sign-flip``: the update u is replaced by ``-byzantine-scale * u`` (u = the gradient or
  delta it sends, or ``received - returned`` weights for algorithms that return weights);
- ``gaussian``: u is replaced by N(0, ``byzantine-sigma``^2) noise;
- ``nan`` / ``inf``: every entry NaN / +Inf;
- ``wrong-shape``: the first tensor gets one extra entry;
- ``label-flip``: trains on labels ``C - 1 - y`` (classifiers only).

Attacks that need the honest clients' updates (ALIE, IPM) are not client-side; they are not
implemented here yet. Off by default: a node without ``byzantine`` is honest.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord
from torch.utils.data import TensorDataset

ATTACKS = ("none", "sign-flip", "gaussian", "nan", "inf", "wrong-shape", "label-flip")
UPDATE_ATTACKS = ("sign-flip", "gaussian", "nan", "inf", "wrong-shape")


def attack_of(node_config: Mapping) -> str:
    """The node's attack (``byzantine`` in its node config), validated."""
    attack = str(node_config.get("byzantine", "none"))
    if attack not in ATTACKS:
        raise ValueError(f"node config 'byzantine' = {attack!r}: must be one of {ATTACKS}")
    return attack


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
