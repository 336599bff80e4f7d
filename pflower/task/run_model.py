"""The run's model and its splits, from the run config: built identically (seeded) on the
server and on every client. Below the algorithms: an algorithm's strategy that needs the model
at start (APFL, PFLEGO) builds it here, not through the registry that collects it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from torch import nn

from pflower.settings import MODELS
from pflower.task.data import dataset_info
from pflower.task.linear import SyntheticLinear
from pflower.task.models import build_model, build_user_model, import_object
from pflower.task.split import Split, make_split
from pflower.task.train import set_objective

if TYPE_CHECKING:
    from pflower.settings import RunSettings


def build_run_model(cfg: RunSettings) -> nn.Module:
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


def split_by_rule(model: nn.Module, cfg: RunSettings, rule: str) -> Split:
    """The split of ``model`` by an algorithm's rule (``Algorithm.wire_split`` /
    ``personal_split``): ``"config"`` is the run config's ``split`` (or ``split-patterns``),
    any other rule a preset (``"none"``, ``"full"``)."""
    if rule == "config":
        return make_split(model, cfg.split, cfg.personal_patterns)
    return make_split(model, rule)
