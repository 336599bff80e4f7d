"""pflower's strategies (server halves) and client halves, by algorithm name.

Public API: import a strategy into your own Flower ServerApp, e.g.
``from pflower.strategies import FedAvg``. ``ALGORITHMS`` maps each ``algorithm`` name of
the run config to its registration (``registry.Algorithm``: strategy, client half, which
parameters cross the wire, defaults); each algorithm's file declares its own entries and
this module only collects them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from torch import nn

from pflower.config import MODELS
from pflower.strategies import apfl as _apfl
from pflower.strategies import async_ffgg as _async_ffgg
from pflower.strategies import fedalt as _fedalt
from pflower.strategies import fedavg as _fedavg
from pflower.strategies import ffgg as _ffgg
from pflower.strategies import l2gd as _l2gd
from pflower.strategies import pflego as _pflego
from pflower.strategies import scaffold as _scaffold
from pflower.strategies.apfl import APFL, APFLClient
from pflower.strategies.async_ffgg import AsyncFFGG
from pflower.strategies.client import ClientHalf, ClientJob
from pflower.strategies.fedalt import (
    FedAlt,
    FedAltClient,
    FedSim,
    FedSimClient,
)
from pflower.strategies.fedavg import (
    FedAvg,
    FedAvgClient,
    FedAvgFineTuneClient,
    Local,
    LocalClient,
    LocalGDClient,
)
from pflower.strategies.ffgg import (
    BRFFGG,
    FFGG,
    FFGGClient,
    LocalFFGG,
    LocalFFGGClient,
)
from pflower.strategies.l2gd import L2GD, L2GDClient
from pflower.strategies.pflego import PFLEGO, PFLEGOClient
from pflower.strategies.registry import Algorithm
from pflower.strategies.scaffold import Scaffold, ScaffoldClient
from pflower.strategies.server import PersonalizedStrategy, strategy_kwargs
from pflower.task.data import dataset_info
from pflower.task.linear import SyntheticLinear
from pflower.task.models import build_model, build_user_model, import_object
from pflower.task.split import Split, make_split
from pflower.task.train import set_objective
from pflower.wire import ClientUpdate

if TYPE_CHECKING:
    from pflower.config import Config

#: every algorithm of the app, each declared (strategy, client half, wire split, settings,
#: defaults) in its own file; ``pflower.config.Config`` composes their settings
ALGORITHMS: dict[str, Algorithm] = {
    name: entry
    for module in (_fedavg, _fedalt, _ffgg, _scaffold, _l2gd, _pflego, _apfl, _async_ffgg)
    for name, entry in module.ALGORITHMS.items()
}


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"key 'algorithm' = {name!r}: must be one of {sorted(ALGORITHMS)}"
        ) from None


def make_strategy(cfg: Config, shared_names=None) -> PersonalizedStrategy:
    """The strategy of ``cfg.algorithm`` with the run config's settings.

    ``shared_names`` (the wire split's shared parameters) is needed with pre-training."""
    return get_algorithm(cfg.algorithm).strategy(cfg, **strategy_kwargs(cfg, shared_names))


def build_run_model(cfg: Config) -> nn.Module:
    """The run's model, built identically (seeded) on the server and on every client, with
    the run's loss and task attached (``training.set_objective``).

    ``model`` is a built-in name or ``module:Class`` (``build_user_model``)."""
    if cfg.model == "synthetic-linear":
        model: nn.Module = SyntheticLinear(cfg.linear_dtheta, cfg.linear_dw)
    else:
        info = dataset_info(cfg)
        if cfg.model in MODELS:
            model = build_model(
                cfg.model,
                info.input_shape,
                info.num_classes,
                adapters=cfg.split == "adapter",
                seed=cfg.seed,
            )
        else:
            model = build_user_model(cfg.model, info.input_shape, info.num_classes, seed=cfg.seed)
    load = functools.partial(import_object, key="loss")
    return set_objective(model, cfg.loss, cfg.effective_task, load)


def _split(model: nn.Module, cfg: Config, rule: str) -> Split:
    if rule == "config":
        return make_split(model, cfg.split, cfg.personal_patterns)
    return make_split(model, rule)


def wire_split(model: nn.Module, cfg: Config) -> Split:
    """Which parameters of ``model`` cross the wire (shared) under ``cfg.algorithm``."""
    return _split(model, cfg, get_algorithm(cfg.algorithm).wire_split)


def personal_split(model: nn.Module, cfg: Config) -> Split:
    """Which parameters of ``model`` the personalized model adapts under ``cfg.algorithm``."""
    return _split(model, cfg, get_algorithm(cfg.algorithm).personal_split)


__all__ = [
    "ALGORITHMS",
    "APFL",
    "APFLClient",
    "AsyncFFGG",
    "BRFFGG",
    "Algorithm",
    "build_run_model",
    "ClientHalf",
    "ClientJob",
    "ClientUpdate",
    "FFGG",
    "FFGGClient",
    "FedAlt",
    "FedAltClient",
    "FedAvg",
    "FedAvgClient",
    "FedAvgFineTuneClient",
    "L2GD",
    "L2GDClient",
    "Local",
    "LocalClient",
    "LocalFFGG",
    "LocalFFGGClient",
    "LocalGDClient",
    "FedSim",
    "FedSimClient",
    "PFLEGO",
    "PFLEGOClient",
    "PersonalizedStrategy",
    "Scaffold",
    "ScaffoldClient",
    "get_algorithm",
    "make_strategy",
    "personal_split",
    "wire_split",
]
