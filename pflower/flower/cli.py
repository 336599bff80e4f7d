"""How ``flwr run`` reads a run config, for ``pflower run`` / ``pflower check-config``
(``pflower.launch``), which validate it before Flower does.

Flower 1.41 parses ``--run-config`` and flattens ``[tool.flwr.app.config]`` with helpers of
``flwr.common.config`` that its top-level package does not export (``parse_config_args``,
``flatten_dict``). pflower uses Flower's own, so that the keys and values it checks are the
ones Flower will send: a re-implementation could accept what Flower refuses. Where an upgrade
moved them, ``FlowerDrift``: ``pflower run`` then skips its own check with a warning and
lets ``flwr run`` (and the ServerApp's own validation at start) refuse a bad key;
``pflower check-config`` says it cannot check.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from pflower.flower import FlowerDrift

MODULE = "flwr.common.config"


def _flowers(name: str):
    try:
        return getattr(importlib.import_module(MODULE), name)
    except (ImportError, AttributeError) as err:
        raise FlowerDrift(
            f"Flower's {MODULE}.{name}, with which flwr run reads a run config, is not where "
            f"Flower 1.41 has it ({type(err).__name__}: {err})"
        ) from err


def flatten_dict(config: dict) -> dict:
    """``[tool.flwr.app.config]`` as flat keys, as Flower flattens it."""
    return _flowers("flatten_dict")(config)


def parse_config_args(items: list[str] | None) -> dict:
    """``--run-config`` arguments as ``flwr run`` parses them."""
    return _flowers("parse_config_args")(items)


def with_own_bin(environ) -> dict[str, str]:
    """``environ`` with this Python's ``bin/`` first on ``PATH``: Flower's processes start
    theirs (``flower-superexec``, ``flwr-clientapp``, the local SuperLink) from ``PATH``, so a
    virtual environment that is not activated must still be the one they find."""
    here = str(Path(sys.executable).parent)
    rest = [p for p in environ.get("PATH", "").split(os.pathsep) if p and p != here]
    return {**environ, "PATH": os.pathsep.join([here, *rest])}
