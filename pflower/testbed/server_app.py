"""The testbed's ServerApp: the production ServerApp with the experiment side attached.

``attach(strategy, cfg)`` inserts what the run config asks of the testbed into the strategy
before the run starts: with ``attack-simulation = true``, the simulated omniscient adversary
(``attacks.OmniscientAttack``) as a stage of the reply pipeline. ``app`` is the component to
name for ``flwr run`` in robustness experiments with ALIE / IPM nodes (``serverapp =
"pflower.testbed.server_app:app"`` beside ``clientapp = "pflower.testbed.client_app:app"`` in
``[tool.flwr.app.components]``); ``local_grid.run_local`` attaches it too. The production
ServerApp refuses ``attack-simulation = true``: it never honours an attack tag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from flwr.serverapp import ServerApp

from pflower.config import Config
from pflower.server_app import build_server_app
from pflower.strategies import PersonalizedStrategy
from pflower.testbed.attacks import OmniscientAttack


def attach(strategy: PersonalizedStrategy, cfg: Config) -> None:
    """The testbed's stages for ``cfg``, inserted into ``strategy``'s reply pipeline."""
    if cfg.attack_simulation:
        strategy.pipeline.insert(OmniscientAttack())


def experiment_server_app(
    overrides: Mapping | None = None,
    on_report: Callable | None = None,
    out: Path | None = None,
) -> ServerApp:
    """``server_app.build_server_app`` with ``attach``."""
    return build_server_app(overrides, on_report, out, prepare=attach)


app = experiment_server_app()
