"""What an experiment is: its runs (a label, a seed, a run config), the file's tables and
keys, and what a run is given (its run config, its attack).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pflower.config import ConfigError

ENGINES = ("local-grid", "simulation")
#: the ``[experiment]`` table's keys, with what each must be
EXPERIMENT_KEYS = {
    "name": "a name (letters, digits, '-', '_', '.')",
    "description": "one line of text for the table's header",
    "engine": "one of " + ", ".join(repr(e) for e in ENGINES),
    "nodes": "the number of simulated clients, an integer >= 1",
    "seeds": "a non-empty list of integers >= 0",
    "workers": "runs side by side, an integer >= 0 (0: one per CPU core; simulation: 1)",
    "threads": "torch threads of each run, an integer >= 1 (default 1)",
    "out": "the output directory (relative to the current directory)",
    "baseline": "the label of a run, whose global model 'hurt vs' counts against",
    "columns": "a list of final metrics (summary.csv's columns) to add to the table",
    "pivot": "a list of grid keys: a second table with their values as columns",
    "pivot-metric": "the final metric in the pivot table's cells (default: personal-accuracy)",
}
SECTIONS = ("experiment", "base", "grid", "run", "attacks")
#: the key a run names its attack by (an ``[attacks]`` table; not a run-config key)
ATTACK = "attack"
NO_ATTACK = "none"
#: run-config keys the experiment sets itself
RESERVED = {
    "seed": "set 'seeds' in [experiment]",
    "outputs-dir": "every run writes into the experiment's directory",
}
RUN_FINISHED = "run.json"


class ExperimentError(ConfigError):
    """A bad experiment file; the message names the table, the key and what is allowed."""


@dataclass(frozen=True)
class Run:
    """One run of the experiment: a label (name + grid point), a seed, its run config."""

    label: str
    name: str
    point: tuple[tuple[str, Any], ...]  # the grid values that name it
    seed: int
    config: dict[str, Any]

    @property
    def slug(self) -> str:
        return _slug(self.label)

    def directory(self, out: Path) -> Path:
        return out / "runs" / self.slug / f"seed-{self.seed}"


@dataclass
class Experiment:
    """A parsed, validated experiment file."""

    name: str
    path: Path
    engine: str
    nodes: int
    seeds: list[int]
    workers: int
    out: Path
    runs: list[Run]
    description: str = ""
    baseline: str | None = None
    labels: list[str] = field(default_factory=list)  # in the file's order
    columns: list[str] = field(default_factory=list)
    pivot: list[str] = field(default_factory=list)
    #: torch threads per run (``torch.set_num_threads``): one, since runs go side by side
    #: and a 2-thread torch on a shared 2-core box spends more CPU than it saves
    threads: int = 1
    pivot_metric: str = "personal-accuracy"
    attacks: dict[str, dict] = field(default_factory=dict)  # name -> fraction, node-config

    def byzantine(self, run: Run) -> tuple[int, dict]:
        """The run's number f of Byzantine nodes (partitions 0 .. f - 1) and their node
        config; (0, {}) without an attack."""
        name = run.config.get(ATTACK, NO_ATTACK)
        if name == NO_ATTACK:
            return 0, {}
        attack = self.attacks[name]
        return round(attack["fraction"] * self.nodes), dict(attack["node-config"])

    @property
    def parallel(self) -> int:
        if self.workers:
            return self.workers
        return 1 if self.engine == "simulation" else os.cpu_count() or 1


def run_config(run: Run, experiment: Experiment) -> dict[str, Any]:
    """The flat run config a run gets (its outputs go to its own directory)."""
    config = {k: v for k, v in run.config.items() if k != ATTACK}
    return {**config, "outputs-dir": str(run.directory(experiment.out))}


def attack_record(run: Run, experiment: Experiment) -> dict:
    """What ``run.json`` records of the run's attack (a finished run must match it)."""
    byzantine, node_config = experiment.byzantine(run)
    return {
        "attack": run.config.get(ATTACK, NO_ATTACK),
        "byzantine-nodes": byzantine,
        "node-config": node_config,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")
