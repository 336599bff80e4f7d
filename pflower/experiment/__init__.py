"""Experiments as files: a grid of runs (algorithms x splits x seeds x any key) in one TOML
file, run by one command, resumable, in parallel, summarized in one table and two plots.

    python -m pflower.experiment benchmarks/experiments/mnist-5c.toml
    pflower experiment benchmarks/experiments/mnist-5c.toml --workers 2 --only FedAvg FedAlt

The file::

    [experiment]
    name = "mnist-5c"            # default: the file's name
    engine = "local-grid"        # "local-grid" (LocalGrid, in process) or "simulation"
    nodes = 50                   # simulated clients of every run
    seeds = [0, 1, 2]            # every run once per seed
    workers = 0                  # runs side by side; 0: one per CPU core (simulation: 1)
    out = "outputs/experiments/mnist-5c"   # default: outputs/experiments/<name>
    baseline = "FedAvg"          # optional: a run whose global model "hurt" is counted against

    [base]                       # run-config keys of every run (docs/reference/run-config.md)
    dataset = "mnist-5k"
    num-server-rounds = 40

    [grid]                       # optional: every combination, crossed with every [[run]]
    split = ["head", "input"]

    [[run]]                      # one method: a name and its run-config keys
    name = "FedAlt"
    algorithm = "fedalt"
    grid = { lr = [0.01, 0.05] } # optional: a grid of this run only

Optional, for tables of their own::

    [experiment]
    columns = ["localized-accuracy"]     # more final metrics as table columns
    pivot = ["attack"]                   # a second table: these grid keys' values as columns
    pivot-metric = "honest-accuracy"     # its cells (default: personal-accuracy)

    [attacks.sign-flip-10]               # Byzantine nodes, named (local-grid engine only)
    fraction = 0.1                       # partitions 0 .. round(0.1 x nodes) - 1 attack
    node-config = { byzantine = "sign-flip", byzantine-scale = 4.0 }

    [[run]]
    name = "FFGG median"
    algorithm = "br-ffgg"
    grid = { attack = ["none", "sign-flip-10"] }   # 'attack' names an [attacks] table

A run with an attack reports ``honest-accuracy``: the personalized accuracy pooled over the
test examples of the honest clients only (every run of a file with ``[attacks]`` does; with
no attack it is the pooled accuracy). A run with ``holdout-fraction`` reports
``personal-accuracy-trained`` and ``personal-accuracy-new`` (the held-out clients, pooled).

A run's config is ``base``, then the grid point, then the run's keys, then the command's
``--set`` keys, then ``seed``, and ``sample-seed`` = ``seed`` where none of these set it (a
reproducible client sample; ``sample-seed = -1`` in the file asks for the secret one). Its
label is the name followed by the grid point (``FedAlt split=head lr=0.01``). Every run's
whole config is validated when the file is loaded (``pflower.config.Config``: an unknown key
or a bad value names the run, the key, the value and what is allowed), before anything runs.

Output directory: ``runs/<label>/seed-<s>/`` holds each run's own outputs (``report.write``:
results.json, clients.csv, config.json, plots) and its console log (``log.txt``);
``summary.csv`` has one row per run, ``table.md`` the mean ± std over seeds per label,
``curves.png`` accuracy and training loss per round per label (mean over seeds, band:
min..max over seeds), ``clients.png`` the per-client final accuracy of each label side by
side. A run is finished when its ``run.json`` exists and its recorded config is the one the
file asks for: rerunning the command runs only what is missing (or changed).
"""

from __future__ import annotations

from pflower.experiment.command import main, parser
from pflower.experiment.loading import load
from pflower.experiment.plots import plot_clients, plot_curves
from pflower.experiment.progress import Progress
from pflower.experiment.rows import clients_of, hurt_vs, row_of
from pflower.experiment.running import execute, finished, read_row, run_one
from pflower.experiment.spec import (
    ATTACK,
    ENGINES,
    EXPERIMENT_KEYS,
    NO_ATTACK,
    RESERVED,
    RUN_FINISHED,
    SECTIONS,
    Experiment,
    ExperimentError,
    Run,
    attack_record,
    run_config,
)
from pflower.experiment.tables import pivot_table, table, write_summary

__all__ = [
    "ATTACK",
    "ENGINES",
    "EXPERIMENT_KEYS",
    "NO_ATTACK",
    "RESERVED",
    "RUN_FINISHED",
    "SECTIONS",
    "Experiment",
    "ExperimentError",
    "Progress",
    "Run",
    "attack_record",
    "clients_of",
    "execute",
    "finished",
    "hurt_vs",
    "load",
    "main",
    "parser",
    "pivot_table",
    "plot_clients",
    "plot_curves",
    "read_row",
    "row_of",
    "run_config",
    "run_one",
    "table",
    "write_summary",
]
