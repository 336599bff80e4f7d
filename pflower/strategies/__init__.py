"""pflower's strategies (server halves) and client halves, by algorithm name.

Public API: import a strategy into your own Flower ServerApp, e.g.
``from pflower.strategies import FedAvg``. ``ALGORITHMS`` maps each ``algorithm`` name of
the run config to its registration (``registry.Algorithm``: strategy, client half, which
parameters cross the wire, settings); each algorithm's file declares its own entries
(``ALGORITHMS`` in the file) and this module only collects them: every module of this
package that has them, in the order of the files' names, then every module an installed
package names in the entry-point group ``pflower.algorithms`` (an algorithm of your own for
pflower's app: its keys must be in the app's ``[tool.flwr.app.config]`` too). The console
(``pflower algorithms``), the run config, the docs' key reference and the tests all read it.
"""

from __future__ import annotations

import importlib
import pkgutil
import textwrap
from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points
from types import ModuleType
from typing import TYPE_CHECKING

from torch import nn

from pflower.strategies.apfl import APFL, APFLClient
from pflower.strategies.async_ffgg import AsyncFFGG
from pflower.strategies.client import ClientHalf, ClientJob, measured
from pflower.strategies.combine import adaptive_clipping, robust_aggregator
from pflower.strategies.ditto import Ditto, DittoClient
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
from pflower.strategies.fedbabu import FedBABU, FedBABUClient
from pflower.strategies.fedprox import FedProx, FedProxClient, FedProxFineTuneClient
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

#: the entry-point group under which an installed package names its algorithm modules
ENTRY_POINTS = "pflower.algorithms"


def algorithm_modules() -> Iterable[ModuleType]:
    """This package's modules that declare ``ALGORITHMS`` (by file name), then the modules
    the installed packages name in ``ENTRY_POINTS``."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "ALGORITHMS"):
            yield module
    for point in sorted(entry_points(group=ENTRY_POINTS), key=lambda p: p.name):
        yield point.load()


def collect(modules: Iterable[ModuleType]) -> dict[str, Algorithm]:
    """Every registration of ``modules``; a name registered twice is refused, by both."""
    found: dict[str, Algorithm] = {}
    for module in modules:
        for name, entry in module.ALGORITHMS.items():
            if name in found:
                raise ValueError(
                    f"algorithm {name!r} registered twice: by {found[name].strategy.__module__} "
                    f"and by {module.__name__}"
                )
            found[name] = entry
    return found


#: every algorithm of the app, each declared in its own file; ``pflower.config.Config``
#: composes their settings
ALGORITHMS: dict[str, Algorithm] = collect(algorithm_modules())


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
        "step_bound": cfg.robust_step_bound,
        "algorithm": cfg.algorithm,
        "settings_fingerprint": settings_fingerprint(cfg),
        "privacy": DPSettings.of(cfg),
    }


def make_strategy(cfg: RunSettings, shared_names=None) -> PersonalizedStrategy:
    """The strategy of ``cfg.algorithm`` with the run config's settings.

    ``shared_names`` (the wire split's shared parameters) is needed with pre-training."""
    strategy = get_algorithm(cfg.algorithm).strategy
    return strategy.from_config(cfg, **strategy_kwargs(cfg, shared_names))


def list_algorithms(argv: Sequence[str] = ()) -> int:
    """``pflower algorithms``: every registered algorithm (the value of the run-config key
    ``algorithm``), its strategy, what crosses the wire and its own keys."""
    if argv:
        print("usage: pflower algorithms   (the registered algorithms and their keys)")
        return 0 if argv[0] in ("-h", "--help") else 2
    for name, entry in ALGORITHMS.items():
        paragraph = " ".join((entry.strategy.__doc__ or "").strip().split("\n\n")[0].split())
        keys = [f.alias or n for s in entry.settings for n, f in s.model_fields.items()]
        where = f"{entry.strategy.__module__}.{entry.strategy.__name__}"
        wrap = {"initial_indent": "  ", "subsequent_indent": "  ", "break_on_hyphens": False}
        print(name)
        print(textwrap.fill(f"{where}: {paragraph}", 96, **wrap))
        print(textwrap.fill(f"keys: {', '.join(keys) or 'none of its own'}", 96, **wrap))
    return 0


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
    "Ditto",
    "DittoClient",
    "FFGG",
    "FFGGClient",
    "FedAlt",
    "FedAltClient",
    "FedAvg",
    "FedAvgClient",
    "FedAvgFineTuneClient",
    "FedBABU",
    "FedBABUClient",
    "FedProx",
    "FedProxClient",
    "FedProxFineTuneClient",
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
    "list_algorithms",
    "make_strategy",
    "strategy_kwargs",
    "measured",
    "personal_split",
    "wire_split",
]
