"""pflower's strategies (server halves) and client halves, by algorithm name.

Public API: import a strategy into your own Flower ServerApp, e.g.
``from pflower.strategies import FedAvg``. ``ALGORITHMS`` maps each ``algorithm`` name of
the run config to its strategy, its client half and which parameters cross the wire.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from pflower.config import MODELS, Config
from pflower.strategies.apfl import APFL, APFLClient, apfl_strategy
from pflower.strategies.async_ffgg import ASYNC_FFGG_DEFAULTS, AsyncFFGG, async_ffgg_strategy
from pflower.strategies.base import PersonalizedStrategy, strategy_kwargs
from pflower.strategies.client import ClientHalf, ClientJob
from pflower.strategies.fedalt import (
    FedAlt,
    FedAltClient,
    FedSim,
    FedSimClient,
    fedalt_strategy,
    fedsim_strategy,
)
from pflower.strategies.fedavg import (
    FedAvg,
    FedAvgClient,
    FedAvgFineTuneClient,
    Local,
    LocalClient,
    LocalGDClient,
    fedavg_strategy,
    local_strategy,
)
from pflower.strategies.ffgg import (
    BR_FFGG_DEFAULTS,
    FFGG,
    FFGGClient,
    LocalFFGG,
    LocalFFGGClient,
    ffgg_strategy,
    local_ffgg_strategy,
)
from pflower.strategies.l2gd import L2GD, L2GD_DEFAULTS, L2GDClient, l2gd_strategy
from pflower.strategies.pflego import PFLEGO, PFLEGO_DEFAULTS, PFLEGOClient, pflego_strategy
from pflower.strategies.scaffold import Scaffold, ScaffoldClient, scaffold_strategy
from pflower.task.data import dataset_info
from pflower.task.linear import SyntheticLinear
from pflower.task.models import build_model, build_user_model, import_object
from pflower.task.split import Split, make_split
from pflower.task.train import set_objective
from pflower.wire import ClientUpdate


@dataclass(frozen=True)
class Algorithm:
    """An algorithm of the app: how to build its strategy, its client half, its wire split.

    ``wire_split``: ``"config"`` uses the run config's ``split`` (the personal part stays
    on the client); ``"none"`` shares every parameter (FedAvg); ``"full"`` shares none
    (local training). ``personal_split``: the split whose personal part the personalized
    model adapts (differs from the wire split for FedAvg + fine-tuning). ``defaults``: the
    values this algorithm uses for run-config keys left at ``auto`` (``config.AUTO``),
    declared in the algorithm's own file.
    """

    strategy: Callable[..., PersonalizedStrategy]
    client: ClientHalf
    wire_split: str = "config"
    personal_split: str = "config"
    defaults: Mapping[str, Any] = field(default_factory=dict)


ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm(fedavg_strategy, FedAvgClient(), "none", "none"),
    "fedavg-ft": Algorithm(fedavg_strategy, FedAvgFineTuneClient(), "none", "config"),
    "local": Algorithm(local_strategy, LocalClient(), "full", "full"),
    "fedalt": Algorithm(fedalt_strategy, FedAltClient()),
    "fedsim": Algorithm(fedsim_strategy, FedSimClient()),
    # the literature's names for FedAlt / FedSim with the head split (config enforces it)
    "fedrep": Algorithm(fedalt_strategy, FedAltClient()),
    "fedper": Algorithm(fedsim_strategy, FedSimClient()),
    "ffgg": Algorithm(ffgg_strategy, FFGGClient()),
    "local-ffgg": Algorithm(local_ffgg_strategy, LocalFFGGClient()),
    "local-gd": Algorithm(fedavg_strategy, LocalGDClient(), "none", "none"),
    "scaffold": Algorithm(scaffold_strategy, ScaffoldClient(), "none", "none"),
    # L2GD averages whole local models: all of x_m crosses the wire and all of it is personal
    "l2gd": Algorithm(l2gd_strategy, L2GDClient(), "none", "full", L2GD_DEFAULTS),
    "pflego": Algorithm(pflego_strategy, PFLEGOClient(), defaults=PFLEGO_DEFAULTS),
    # APFL sends the whole global copy w; v and alpha (a whole model) stay on the client
    "apfl": Algorithm(apfl_strategy, APFLClient(), "none", "full"),
    # BR-FFGG (Alg. 5): FFGG's clients, the server steps with the robust rule of the config
    "br-ffgg": Algorithm(ffgg_strategy, FFGGClient(), defaults=BR_FFGG_DEFAULTS),
    # Asynchronous FFGG (Alg. 3): FFGG's clients, a server loop that applies each gradient
    "async-ffgg": Algorithm(async_ffgg_strategy, FFGGClient(), defaults=ASYNC_FFGG_DEFAULTS),
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
