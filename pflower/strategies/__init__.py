"""pflower's strategies (server halves) and client halves, by algorithm name.

Public API: import a strategy into your own Flower ServerApp, e.g.
``from pflower.strategies import FedAvg``. ``ALGORITHMS`` maps each ``algorithm`` name of
the run config to its registration (``registry.Algorithm``: strategy, client half, which
parameters cross the wire, defaults); each algorithm's file declares its own entries and
this module only collects them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

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
from pflower.strategies.client import ClientHalf, ClientJob, measured
from pflower.strategies.combine import adaptive_clipping, robust_aggregator
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
from pflower.strategies.privacy import DPSettings
from pflower.strategies.registry import Algorithm
from pflower.strategies.scaffold import Scaffold, ScaffoldClient
from pflower.strategies.server import PersonalizedStrategy
from pflower.strategies.server_opt import ServerOptimizer
from pflower.task.run_model import build_run_model, split_by_rule
from pflower.task.split import Split
from pflower.wire import ClientUpdate, settings_fingerprint

if TYPE_CHECKING:
    from pflower.settings import RunSettings

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


def strategy_kwargs(cfg: RunSettings, shared_names: Sequence[str] | None = None) -> dict:
    """The base-strategy settings of a run config (``PersonalizedStrategy``'s parameters)."""
    return {
        "fraction_train": cfg.fraction_train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "evaluate_every": cfg.evaluate_every,
        "final_evaluate_fraction": cfg.final_evaluate_fraction,
        "max_in_flight": cfg.max_in_flight,
        "pull_interval": cfg.pull_interval,
        "lr": cfg.lr,
        "lr_schedule": cfg.lr_schedule,
        "lr_warmup_fraction": cfg.lr_warmup_fraction,
        "lr_halve_every": cfg.lr_halve_every,
        "server_optimizer": ServerOptimizer.of(cfg),
        "pretrain_rounds": cfg.pretrain_rounds,
        "pretrain_lr": cfg.effective_pretrain_lr,
        "shared_names": shared_names,
        "seed": cfg.seed,
        "sample_seed": cfg.sample_seed,
        "holdout_fraction": cfg.holdout_fraction,
        "robust": robust_aggregator(cfg) or False,  # False: the run config names none
        "clipping": adaptive_clipping(cfg) or False,
        "byzantine": cfg.robust_byzantine,
        "max_update_norm": cfg.max_update_norm,
        "update_norm_growth": cfg.update_norm_growth,
        "max_num_examples": cfg.max_num_examples,
        "max_failed_rounds": cfg.max_failed_rounds,
        "algorithm": cfg.algorithm,
        "settings_fingerprint": settings_fingerprint(cfg),
        "privacy": DPSettings.of(cfg),
    }


def make_strategy(cfg: RunSettings, shared_names=None) -> PersonalizedStrategy:
    """The strategy of ``cfg.algorithm`` with the run config's settings.

    ``shared_names`` (the wire split's shared parameters) is needed with pre-training."""
    return get_algorithm(cfg.algorithm).strategy(cfg, **strategy_kwargs(cfg, shared_names))


def wire_split(model: nn.Module, cfg: RunSettings) -> Split:
    """Which parameters of ``model`` cross the wire (shared) under ``cfg.algorithm``."""
    return split_by_rule(model, cfg, get_algorithm(cfg.algorithm).wire_split)


def personal_split(model: nn.Module, cfg: RunSettings) -> Split:
    """Which parameters of ``model`` the personalized model adapts under ``cfg.algorithm``."""
    return split_by_rule(model, cfg, get_algorithm(cfg.algorithm).personal_split)


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
    "strategy_kwargs",
    "measured",
    "personal_split",
    "wire_split",
]
