"""The run configuration: the run-level keys composed with every algorithm's settings.

``Config`` is one validated pydantic model of Flower's flat run config: ``RunSettings``
(``pflower/settings.py``, the bottom layer) plus the settings each algorithm declares in its own
file (e.g. ``PFLEGOSettings`` in ``pflower/strategies/pflego.py``), collected by the registry
(``pflower.strategies``). It is assembled here, where the layers meet: this module imports the
registry, and nothing below it imports this module (the algorithms name ``Config`` in
annotations only), so the import graph has no circle.

``Config.from_run_config(mapping)`` parses and validates (a bad or unknown key raises a
``ConfigError`` naming the key, the value and what is allowed) and applies the chosen
algorithm's defaults to keys left at ``auto`` (``RunSettings.resolved``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pflower.settings import ConfigError, RunSettings, Settings
from pflower.strategies import ALGORITHMS as REGISTRY
from pflower.strategies.registry import Algorithm

#: every ``algorithm`` name, as the algorithms' files register them
ALGORITHMS: tuple[str, ...] = tuple(REGISTRY)

#: every registered algorithm's settings model, once each, in registration order
ALGORITHM_SETTINGS: tuple[type[Settings], ...] = tuple(
    dict.fromkeys(s for entry in REGISTRY.values() for s in entry.settings)
)


class Config(RunSettings, *reversed(ALGORITHM_SETTINGS)):
    """Validated run configuration shared by the ServerApp and the ClientApp: ``RunSettings``
    plus every algorithm's settings, one flat model (Flower's run config is one flat mapping)."""

    algorithms: ClassVar[Mapping[str, Algorithm]] = REGISTRY


__all__ = ["ALGORITHMS", "ALGORITHM_SETTINGS", "Config", "ConfigError", "RunSettings"]
