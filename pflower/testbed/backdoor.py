"""A targeted attack: the backdoor, and the probe that measures it on every client.

The attack of Bagdasaryan et al. ("How To Backdoor Federated Learning", AISTATS 2020) in the
setting of Sun et al. ("Can You Really Backdoor Federated Learning?", 2019): a Byzantine node
(node config ``byzantine = "backdoor"``) trains honestly on a poisoned copy of its data, in
which a ``backdoor-fraction`` (default 0.5) of its training examples carry the trigger and
the label ``backdoor-target`` (default 0); the trigger is a ``backdoor-trigger`` x
``backdoor-trigger`` patch (default 4) in the bottom-right corner of every channel, set to
the brightest value of the node's data. Its update is then boosted by ``backdoor-boost``
(default 1: none; ``attacks.corrupt`` applies it in update space); a boost chosen to land
just inside the server's bound is the strongest version (``benchmarks/default_defence.py
--attack backdoor`` aims at the bound as its adaptive attacker does). Accuracy on clean
data barely moves, which is why the untargeted benchmarks never saw it.

**The probe.** A node whose node config holds ``backdoor-target`` (attacker or not, in clean
runs too) adds to each evaluation reply ``backdoor-success``: the share of its test examples
of another class that its personalized model, once the trigger is stamped on them,
classifies as the target; ``global-backdoor-success`` the same for the global model where
the algorithm evaluates one; and ``backdoor-holds-target`` (1 if its training data hold the
target class: the clients whose personal layers have seen that label, the ones the
backdoor's shared features reach most easily). Accuracy metrics are untouched: the probe
evaluates the same model again, on the triggered copy.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from pflower.task import train as training
from pflower.task.data import batched

TARGET, TRIGGER, FRACTION, BOOST = 0, 4, 0.5, 1.0


def settings(node_config: Mapping) -> tuple[int, int, float, float]:
    """(target, trigger side, poisoned fraction, boost) from the node config, validated."""
    target = int(node_config.get("backdoor-target", TARGET))
    side = int(node_config.get("backdoor-trigger", TRIGGER))
    fraction = float(node_config.get("backdoor-fraction", FRACTION))
    boost = float(node_config.get("backdoor-boost", BOOST))
    if target < 0:
        raise ValueError(f"node config 'backdoor-target' = {target}: must be a class (>= 0)")
    if side < 1:
        raise ValueError(f"node config 'backdoor-trigger' = {side}: must be >= 1 (pixels)")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"node config 'backdoor-fraction' = {fraction}: must be in (0, 1]")
    if not boost > 0.0:
        raise ValueError(f"node config 'backdoor-boost' = {boost}: must be > 0")
    return target, side, fraction, boost


def stamp(x: torch.Tensor, input_shape: tuple[int, ...], side: int, value: float) -> torch.Tensor:
    """A copy of the examples ``x`` (rows of ``input_shape``, or flattened) with the trigger:
    the bottom-right ``side`` x ``side`` pixels of every channel set to ``value``."""
    if len(input_shape) < 2:
        raise ValueError(
            f"node config 'byzantine' = 'backdoor' stamps an image trigger; inputs of shape "
            f"{input_shape} are no images"
        )
    h, w = input_shape[-2:]
    if side > min(h, w):
        raise ValueError(f"node config 'backdoor-trigger' = {side}: larger than the {h}x{w} image")
    images = x.reshape(len(x), *input_shape).clone()
    images[..., h - side :, w - side :] = value
    return images.reshape(x.shape)


def poison(
    dataset: TensorDataset, input_shape, target: int, side: int, fraction: float, seed: int
) -> TensorDataset:
    """The attacker's training set: ``fraction`` of its examples (drawn with ``seed``)
    stamped and relabelled ``target``, the rest as they are."""
    x, y = dataset.tensors
    count = max(1, round(fraction * len(x)))
    chosen = torch.from_numpy(np.random.default_rng(seed).permutation(len(x))[:count])
    x, y = x.clone(), y.clone()
    x[chosen] = stamp(x[chosen], input_shape, side, float(x.max()))
    y[chosen] = target
    return TensorDataset(x, y)


def triggered(dataset: TensorDataset, input_shape, target: int, side: int) -> TensorDataset:
    """The probe's set: the examples of another class than ``target``, stamped, labelled
    ``target`` (a model's accuracy on it is the attack's success)."""
    x, y = dataset.tensors
    other = y.long() != target
    x, y = x[other], y[other]
    value = float(x.max()) if len(x) else 0.0
    return TensorDataset(stamp(x, input_shape, side, value), torch.full_like(y, target))


class Probe:
    """The backdoor's measurement during one evaluation message: while it is active (``with
    probe:``), every evaluation of the client's test set (``task.train.evaluate``, whichever
    model the half evaluates: the global one, a mixture, the personalized one) is followed
    by the same model's on the triggered test set, so that ``metrics`` can name which of them
    was the personalized one."""

    def __init__(self, job, input_shape, node_config: Mapping) -> None:
        target, side, _, _ = settings(node_config)
        self.test_loader = job.test_loader
        data = job.test_loader.dataset
        self.loader: DataLoader = batched(
            triggered(data, input_shape, target, side), job.test_loader.batch_size or 64
        )
        labels = job.train_loader.dataset.tensors[1].long()
        self.holds = float(bool((labels == target).any()))
        self.seen: list[tuple[dict, float]] = []  # (an evaluation's result, its success)

    def __enter__(self) -> Probe:
        _ACTIVE.probe = self
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.probe = None

    def record(self, model, loader, device, out: dict) -> None:
        if loader is self.test_loader and len(self.loader.dataset):
            success = float(_EVALUATE(model, self.loader, device)["accuracy"])
            self.seen.append((out, success))

    def metrics(self, reported: Mapping) -> dict[str, float]:
        """The probe's metrics for the half's ``reported`` evaluation metrics: each success
        is that of the last evaluation whose loss and accuracy the half reported as
        ``personal-`` / ``global-``."""
        out = {"backdoor-holds-target": self.holds}
        names = {"personal": "backdoor-success", "global": "global-backdoor-success"}
        for which, name in names.items():
            key = f"{which}-accuracy"
            if key not in reported:
                continue
            for result, success in reversed(self.seen):
                if (result.get("accuracy"), result.get("loss")) == (
                    reported[key],
                    reported.get(f"{which}-loss"),
                ):
                    out[name] = success
                    break
        return out


#: the probe active in this thread (clients of a LocalGrid may evaluate side by side)
_ACTIVE = threading.local()
_EVALUATE = training.evaluate


def _probed_evaluate(model, loader, device="cpu"):
    """``task.train.evaluate``, and the active probe's triggered evaluation of that model."""
    out = _EVALUATE(model, loader, device)
    probe = getattr(_ACTIVE, "probe", None)
    if probe is not None:
        probe.record(model, loader, device, out)
    return out


# the testbed attaches from outside: every evaluation an algorithm runs goes through the
# module's function, which is what the probe needs to see (APFL evaluates its mixture there)
training.evaluate = _probed_evaluate
