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

    [base]                       # run-config keys of every run (README's key table)
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
``--set`` keys, then ``seed``. Its label is the name followed by the grid point
(``FedAlt split=head lr=0.01``). Every run's
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

import argparse
import contextlib
import csv
import itertools
import json
import logging
import math
import os
import random
import re
import statistics
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pflower.config import ConfigError

log = logging.getLogger("flwr.pflower")

ENGINES = ("local-grid", "simulation")
#: the ``[experiment]`` table's keys, with what each must be
EXPERIMENT_KEYS = {
    "name": "a name (letters, digits, '-', '_', '.')",
    "description": "one line of text for the table's header",
    "engine": "one of " + ", ".join(repr(e) for e in ENGINES),
    "nodes": "the number of simulated clients, an integer >= 1",
    "seeds": "a non-empty list of integers >= 0",
    "workers": "runs side by side, an integer >= 0 (0: one per CPU core; simulation: 1)",
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


# --- loading ----------------------------------------------------------------------------------


def load(
    path: str | Path,
    overrides: Mapping[str, Any] | None = None,
    seeds: Sequence[int] | None = None,
    only: Sequence[str] | None = None,
    out: str | Path | None = None,
) -> Experiment:
    """Read and validate an experiment file. ``overrides`` are run-config keys over every
    run's own (``--set``), ``seeds`` replaces the file's, ``only`` keeps the runs whose
    label or name is listed, ``out`` replaces the output directory."""
    path = Path(path)
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ExperimentError(f"experiment file {str(path)!r}: cannot be read ({err})") from None
    for section in spec:
        if section not in SECTIONS:
            raise ExperimentError(
                f"experiment file {str(path)!r}: unknown table [{section}]; allowed: "
                + ", ".join(f"[{s}]" if s != "run" else "[[run]]" for s in SECTIONS)
            )
    meta = _table(spec, "experiment")
    for key in meta:
        if key not in EXPERIMENT_KEYS:
            raise ExperimentError(
                f"[experiment] key {key!r}: unknown; allowed: " + ", ".join(EXPERIMENT_KEYS)
            )
    name = meta.get("name", path.stem)
    _expect(isinstance(name, str) and _slug(name) == name and name, "name", name)
    engine = meta.get("engine", "local-grid")
    _expect(engine in ENGINES, "engine", engine)
    nodes = meta.get("nodes")
    _expect(isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1, "nodes", nodes)
    seeds = list(seeds) if seeds is not None else meta.get("seeds", [0])
    _expect(
        isinstance(seeds, list)
        and seeds
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        and len(set(seeds)) == len(seeds),
        "seeds",
        seeds,
    )
    workers = meta.get("workers", 0)
    _expect(isinstance(workers, int) and workers >= 0, "workers", workers)
    base = _table(spec, "base")
    for where, table in (("[base]", base), ("--set", overrides or {})):
        for key in table:
            if key in RESERVED:
                raise ExperimentError(f"{where} key {key!r}: not here; {RESERVED[key]}")
    grid = _grid(_table(spec, "grid"), "[grid]")
    entries = spec.get("run", [])
    if not isinstance(entries, list) or not entries:
        raise ExperimentError(
            f"experiment file {str(path)!r}: no [[run]] table; every method is one [[run]] "
            "with a 'name' and its run-config keys"
        )
    runs: list[Run] = []
    labels: list[str] = []
    for i, entry in enumerate(entries):
        runs_of, label_list = _runs_of(entry, i, base, grid, seeds, dict(overrides or {}))
        runs += runs_of
        labels += label_list
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise ExperimentError(f"[[run]] labels {duplicates} occur more than once: rename one")
    baseline = meta.get("baseline")
    if baseline is not None:
        _expect(baseline in labels, "baseline", baseline, f"; labels: {labels}")
    if only:
        unknown = sorted(set(only) - set(labels) - {r.name for r in runs})
        if unknown:
            raise ExperimentError(f"--only {unknown}: no such run; runs: {labels}")
        runs = [r for r in runs if r.label in only or r.name in only]
        labels = [lab for lab in labels if any(r.label == lab for r in runs)]
        if baseline not in labels:  # filtered out: no column against it
            baseline = None
    columns = meta.get("columns", [])
    _expect(
        isinstance(columns, list) and all(isinstance(c, str) for c in columns), "columns", columns
    )
    pivot = meta.get("pivot", [])
    grid_keys = {k for r in runs for k, _ in r.point}
    _expect(
        isinstance(pivot, list) and all(isinstance(k, str) and k in grid_keys for k in pivot),
        "pivot",
        pivot,
        f"; grid keys: {sorted(grid_keys)}",
    )
    pivot_metric = meta.get("pivot-metric", "personal-accuracy")
    _expect(isinstance(pivot_metric, str), "pivot-metric", pivot_metric)
    attacks = _attacks(_table(spec, "attacks"), engine)
    out_dir = Path(out or meta.get("out") or Path("outputs") / "experiments" / name)
    experiment = Experiment(
        name=name,
        path=path,
        engine=engine,
        nodes=nodes,
        seeds=seeds,
        workers=workers,
        out=out_dir,
        runs=runs,
        description=str(meta.get("description", "")),
        baseline=baseline,
        labels=labels,
        columns=columns,
        pivot=pivot,
        pivot_metric=pivot_metric,
        attacks=attacks,
    )
    for run in runs:  # every run's whole config, before anything runs
        _validate(run, experiment)
    return experiment


def _table(spec: Mapping, section: str) -> dict:
    value = spec.get(section, {})
    if not isinstance(value, dict):
        raise ExperimentError(f"[{section}] must be a table of key = value")
    return dict(value)


def _expect(ok: bool, key: str, value: Any, more: str = "") -> None:
    if not ok:
        raise ExperimentError(
            f"[experiment] key {key!r} = {value!r}: must be {EXPERIMENT_KEYS[key]}{more}"
        )


def _attacks(table: Mapping, engine: str) -> dict[str, dict]:
    """The ``[attacks]`` tables: name -> {fraction, node-config}."""
    attacks = {}
    for name, attack in table.items():
        where = f"[attacks.{name}]"
        if name == NO_ATTACK:
            raise ExperimentError(f"{where}: {NO_ATTACK!r} is reserved for no attack")
        if engine != "local-grid":
            raise ExperimentError(
                f"{where}: attacks need engine = 'local-grid' (node configs per node)"
            )
        if not isinstance(attack, dict) or set(attack) != {"fraction", "node-config"}:
            raise ExperimentError(
                f"{where}: must have exactly the keys 'fraction' (of the nodes, in [0, 1)) "
                "and 'node-config' (a table of node-config keys, e.g. byzantine = 'sign-flip')"
            )
        fraction, node_config = attack["fraction"], attack["node-config"]
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ExperimentError(f"{where} key 'fraction' = {fraction!r}: must be a number")
        if not 0 <= fraction < 1:
            raise ExperimentError(f"{where} key 'fraction' = {fraction}: must be in [0, 1)")
        if not isinstance(node_config, dict):
            raise ExperimentError(f"{where} key 'node-config': must be a table")
        from pflower.experiments.attacks import attack_of

        try:
            attack_of(node_config)
        except ValueError as err:
            raise ExperimentError(f"{where} key 'node-config': {err}") from None
        attacks[name] = {"fraction": float(fraction), "node-config": dict(node_config)}
    return attacks


def _grid(table: Mapping, where: str) -> list[tuple[str, list]]:
    grid = []
    for key, values in table.items():
        if not isinstance(values, list) or not values:
            raise ExperimentError(
                f"{where} key {key!r} = {values!r}: must be a non-empty list of values"
            )
        inner = {k for v in values if isinstance(v, dict) for k in v}
        for reserved in sorted(({key} | inner) & set(RESERVED)):
            raise ExperimentError(f"{where} key {reserved!r}: not here; {RESERVED[reserved]}")
        grid.append((key, values))
    return grid


def _runs_of(
    entry: Mapping,
    index: int,
    base: dict,
    grid: list[tuple[str, list]],
    seeds: list[int],
    overrides: dict,
) -> tuple[list[Run], list[str]]:
    if not isinstance(entry, dict):
        raise ExperimentError(f"[[run]] number {index + 1}: must be a table")
    entry = dict(entry)
    name = entry.pop("name", None)
    if not isinstance(name, str) or not name.strip():
        raise ExperimentError(f"[[run]] number {index + 1}: needs a 'name' (a non-empty string)")
    own_grid = _grid(entry.pop("grid", {}), f"[[run]] {name!r} grid")
    for key in list(entry) + [k for k, _ in own_grid]:
        if key in entry and key in dict(own_grid):
            raise ExperimentError(
                f"[[run]] {name!r} key {key!r}: set and in its own grid; keep one of them"
            )
        if key in RESERVED:
            raise ExperimentError(f"[[run]] {name!r} key {key!r}: not here; {RESERVED[key]}")
        if key in dict(grid):
            raise ExperimentError(
                f"[[run]] {name!r} key {key!r}: also in [grid]; a run sets a key or the "
                "shared grid varies it, not both (give this run its own 'grid' instead)"
            )
    axes = grid + own_grid
    runs, labels = [], []
    for values in itertools.product(*(v for _, v in axes)):
        point = tuple((k, v) for (k, _), v in zip(axes, values))
        varying = [(k, v) for k, v in point if len(dict(axes)[k]) > 1]
        label = " ".join([name] + [_show(k, v) for k, v in varying])
        labels.append(label)
        keys = _expand(point)
        for key in set(keys) & set(entry):
            raise ExperimentError(
                f"[[run]] {name!r} key {key!r}: set and also by a grid value; keep one of them"
            )
        for seed in seeds:
            config = {**base, **keys, **entry, **overrides, "seed": seed}
            runs.append(Run(label, name, point, seed, config))
    return runs, labels


def _expand(point: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A grid point's run-config keys: a value that is a table sets each of its keys
    (``data = [{synthetic-gamma = 0.5, synthetic-beta = 0.5}, ...]``: values that go
    together), any other value its own key."""
    keys: dict[str, Any] = {}
    for key, value in point:
        keys.update(value if isinstance(value, dict) else {key: value})
    return keys


def _show(key: str, value: Any) -> str:
    """A grid value in a label: ``key=value``, a table as its ``key=value`` pairs."""
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    return f"{key}={value}"


def _validate(run: Run, experiment: Experiment) -> None:
    from pflower.config import Config

    attack = run.config.get(ATTACK, NO_ATTACK)
    if attack != NO_ATTACK and attack not in experiment.attacks:
        raise ExperimentError(
            f"[[run]] {run.label!r} key {ATTACK!r} = {attack!r}: no such [attacks] table; "
            f"allowed: {[NO_ATTACK, *experiment.attacks]}"
        )
    if experiment.byzantine(run)[0] >= experiment.nodes:
        raise ExperimentError(f"[[run]] {run.label!r}: attack {attack!r} leaves no honest node")
    try:
        Config.from_run_config(run_config(run, experiment))
    except ConfigError as err:
        raise ExperimentError(f"[[run]] {run.label!r} (seed {run.seed}): {err}") from None


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


# --- running ----------------------------------------------------------------------------------


def finished(run: Run, experiment: Experiment) -> bool:
    """Whether the run's directory holds a complete run of exactly this config."""
    from pflower.config import Config

    directory = run.directory(experiment.out)
    try:
        recorded = json.loads((directory / "config.json").read_text())["run-config"]
        meta = json.loads((directory / RUN_FINISHED).read_text())
    except (OSError, ValueError, KeyError):
        return False
    if experiment.attacks and meta.get("attack") != attack_record(run, experiment):
        return False
    expected = json.loads(json.dumps(Config.from_run_config(run_config(run, experiment)).to_flat()))
    # the directory may have moved (--out, a copy): where it wrote is not part of the run
    recorded.pop("outputs-dir", None)
    expected.pop("outputs-dir", None)
    return recorded == expected  # as JSON stores it (tuples: lists)


def execute(experiment: Experiment, progress: bool = True) -> list[dict]:
    """Run every unfinished run (``parallel`` at a time, in worker processes) and return
    every finished run's row (``summary.csv``); failed runs are reported and left out."""
    experiment.out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in experiment.runs if not finished(r, experiment)]
    done = len(experiment.runs) - len(todo)
    if done:
        print(
            f"{experiment.name}: {done} of {len(experiment.runs)} runs already finished "
            f"in {experiment.out} (skipped)",
            file=sys.stderr,
        )
    failures: list[tuple[Run, str]] = []
    bar = Progress(len(experiment.runs), done, enabled=progress)
    workers = max(1, min(experiment.parallel, len(todo)))
    threads = max(1, (os.cpu_count() or 1) // workers)
    if todo:
        jobs = [
            {
                "run": r,
                "config": run_config(r, experiment),
                "dir": str(r.directory(experiment.out)),
                "engine": experiment.engine,
                "nodes": experiment.nodes,
                "threads": threads,
                "attack": attack_record(r, experiment) if experiment.attacks else None,
            }
            for r in todo
        ]
        # spawn, not fork: a forked copy of a process that already imported torch / started
        # Ray's threads can deadlock
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            pending = {pool.submit(run_one, job): job["run"] for job in jobs}
            while pending:
                complete, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in complete:
                    run = pending.pop(future)
                    try:
                        row = future.result()
                        bar.update(f"{run.label} seed {run.seed}: {_score(row)}")
                    except Exception as err:  # one failed run must not stop the others
                        failures.append((run, f"{type(err).__name__}: {err}"))
                        bar.update(f"{run.label} seed {run.seed}: FAILED")
    bar.close()
    for run, error in failures:
        log_path = run.directory(experiment.out) / "log.txt"
        print(f"FAILED {run.label} seed {run.seed}: {error} (log: {log_path})", file=sys.stderr)
    return [row for r in experiment.runs if (row := read_row(r, experiment)) is not None]


def _score(row: Mapping) -> str:
    acc = row.get("personal-accuracy")
    return f"{100 * acc:.2f}%" if isinstance(acc, float) else "done"


def run_one(job: Mapping) -> dict:
    """One run in a worker process: its console into ``log.txt``, its outputs into its
    directory, ``run.json`` last (the mark that it finished); returns its summary row."""
    import resource

    import torch

    directory = Path(job["dir"])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RUN_FINISHED).unlink(missing_ok=True)
    torch.set_num_threads(job["threads"])
    started, cpu = time.perf_counter(), _cpu_seconds(resource)
    with open(directory / "log.txt", "w") as logfile, _redirected(logfile):
        if job["engine"] == "simulation":
            _simulate(job, directory)
        else:
            from pflower.experiments.local_grid import run_local

            attack = job.get("attack") or {"byzantine-nodes": 0}
            byzantine = {i: attack["node-config"] for i in range(attack["byzantine-nodes"])}
            run_local(job["config"], job["nodes"], out=directory, node_configs=byzantine)
    run: Run = job["run"]
    (directory / RUN_FINISHED).write_text(
        json.dumps(
            {
                "label": run.label,
                "name": run.name,
                "grid": dict(run.point),
                "seed": run.seed,
                "engine": job["engine"],
                "nodes": job["nodes"],
                "wall-seconds": time.perf_counter() - started,
                # this process and its children (the simulation engine's Ray workers)
                "cpu-seconds": _cpu_seconds(resource) - cpu,
                **({"attack": job["attack"]} if job.get("attack") else {}),
            },
            indent=2,
        )
    )
    return row_of(directory)


def _cpu_seconds(resource) -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _redirected(logfile):
    """Point this process's stdout and stderr (file descriptors 1 and 2: Flower's and Ray's
    output too) at ``logfile``: the parent's progress bar stays readable."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(logfile.fileno(), 1)
    os.dup2(logfile.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _simulate(job: Mapping, directory: Path) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.simulation import run_simulation

    from pflower.client_app import build_client_app
    from pflower.server_app import build_server_app

    reports: list = []
    run_simulation(
        server_app=build_server_app(job["config"], on_report=reports.append, out=directory),
        client_app=build_client_app(job["config"]),
        num_supernodes=job["nodes"],
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    if not reports:  # the engine logs a ServerApp's exception and returns
        raise RuntimeError("the ServerApp did not finish (its error is in log.txt)")


class Progress:
    """Runs done of all, elapsed and ETA: a tqdm bar when tqdm is installed, else one plain
    line per finished run (both on stderr)."""

    def __init__(self, total: int, done: int, enabled: bool = True) -> None:
        self.total, self.done, self.first = total, done, done
        self.started = time.monotonic()
        self.bar = None
        self.enabled = enabled and total > done
        if self.enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=done, unit="run", dynamic_ncols=True)
            except ImportError:
                print(f"{done}/{total} runs done", file=sys.stderr, flush=True)

    def update(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
            return
        elapsed = time.monotonic() - self.started
        rate = (self.done - self.first) / elapsed
        eta = (self.total - self.done) / rate if rate else math.inf
        print(
            f"{self.done}/{self.total} runs done | {_clock(elapsed)} elapsed, ETA "
            f"{_clock(eta)} | {what}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


# --- summary ----------------------------------------------------------------------------------


def row_of(directory: Path) -> dict:
    """A finished run's ``summary.csv`` row: who it is, its final evaluation, its cost."""
    meta = json.loads((directory / RUN_FINISHED).read_text())
    results = json.loads((directory / "results.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    run_config = config["run-config"]
    pretrain = run_config.get("pretrain-rounds", 0)
    rounds = [r for r in results["rounds"] if r["round"] > pretrain and r["train"]]
    trained = [r for r in results["rounds"] if "train-down" in r.get("wire", {})]
    row = {
        "label": meta["label"],
        "name": meta["name"],
        "seed": meta["seed"],
        **{f"grid:{k}": v for k, v in meta["grid"].items()},
        "algorithm": run_config["algorithm"],
        "split": config["split"],
        "rounds": len(results["rounds"]),
        **results["final"],
        # median: the first rounds also pay for loading the data
        "seconds-per-round": statistics.median(r["seconds"] for r in rounds) if rounds else None,
        "train-bytes-down-per-round": _mean(r["wire"]["train-down"] for r in trained),
        "train-bytes-up-per-round": _mean(r["wire"].get("train-up", 0) for r in trained),
        "dropped-replies": results["dropped-replies"],
        "wall-seconds": meta["wall-seconds"],
        "cpu-seconds": meta["cpu-seconds"],
        "path": str(directory),
    }
    clients = clients_of(row)
    if "attack" in meta:  # the honest clients' pooled personalized accuracy
        byzantine = meta["attack"]["byzantine-nodes"]
        row["honest-accuracy"] = _pooled([c for p, c in clients.items() if p >= byzantine])
    holdout = run_config.get("holdout-fraction", 0)
    if holdout:  # held-out partitions: the top fraction of the ids (strategies/nodes.py)
        cutoff = meta["nodes"] - round(holdout * meta["nodes"])
        row["personal-accuracy-trained"] = _pooled([c for p, c in clients.items() if p < cutoff])
        row["personal-accuracy-new"] = _pooled([c for p, c in clients.items() if p >= cutoff])
    return row


def _pooled(clients: list[dict], key: str = "personal-accuracy") -> float | None:
    """``key`` pooled over the clients' test examples (each weighted by its count)."""
    clients = [c for c in clients if key in c]
    total = sum(c["num-examples"] for c in clients)
    return sum(c[key] * c["num-examples"] for c in clients) / total if total else None


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def read_row(run: Run, experiment: Experiment) -> dict | None:
    directory = run.directory(experiment.out)
    if not finished(run, experiment):
        return None
    return row_of(directory)


def clients_of(row: Mapping) -> dict[int, dict]:
    """A run's per-client final metrics (clients.csv), by partition id."""
    path = Path(row["path"]) / "clients.csv"
    if not path.exists():
        return {}
    with open(path) as f:
        return {
            int(float(r["partition-id"])): {k: float(v) for k, v in r.items() if v != ""}
            for r in csv.DictReader(f)
        }


def hurt_vs(rows: list[dict], baseline: str) -> None:
    """Per run: its clients whose personalized accuracy is below the ``baseline`` run's
    global accuracy on the same client and seed (``hurt-vs-baseline``)."""
    base = {r["seed"]: clients_of(r) for r in rows if r["label"] == baseline}
    for row in rows:
        reference = base.get(row["seed"])
        if not reference:
            continue
        mine = clients_of(row)
        row["hurt-vs-baseline"] = sum(
            1
            for pid, m in mine.items()
            if pid in reference
            and "personal-accuracy" in m
            and "global-accuracy" in reference[pid]
            and m["personal-accuracy"] < reference[pid]["global-accuracy"]
        )


def write_summary(experiment: Experiment, rows: list[dict]) -> str:
    """``summary.csv``, ``table.md`` and the comparison plots; returns the table."""
    if experiment.baseline:
        hurt_vs(rows, experiment.baseline)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(experiment.out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    text = table(experiment, rows)
    (experiment.out / "table.md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        log.warning("pflower: no plots (matplotlib missing: pip install 'pflower[plots]')")
        return text
    plot_curves(experiment, rows, experiment.out / "curves.png")
    plot_clients(experiment, rows, experiment.out / "clients.png")
    return text


def _cell(values: list, scale: float = 1.0, digits: int = 2) -> str:
    values = [scale * v for v in values if v is not None and not _nan(v)]
    if not values:
        return "–"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def _nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def table(experiment: Experiment, rows: list[dict]) -> str:
    """Mean ± sample std over seeds, one line per label, in the file's order."""
    regression = rows and all("personal-accuracy" not in r for r in rows)
    metric, scale, unit = ("rmse", 1.0, "RMSE") if regression else ("accuracy", 100.0, "%")
    columns = [
        (f"personalized {unit} (pooled)", f"personal-{metric}", scale, 2),
        ("mean over clients", f"personal-{metric}-mean", scale, 2),
        ("p10 client", f"personal-{metric}-p10", scale, 2),
        ("worst client", f"personal-{metric}-worst", scale, 2),
        ("clients hurt", "clients-hurt", 1.0, 1),
    ]
    if experiment.baseline:
        columns.append((f"hurt vs {experiment.baseline}", "hurt-vs-baseline", 1.0, 1))
    columns += [
        (f"own global {unit}", f"global-{metric}", scale, 2),
        *[(_header(key), key, _scale(key), 2) for key in experiment.columns],
        ("dropped", "dropped-replies", 1.0, 1),
        ("s / round", "seconds-per-round", 1.0, 2),
        ("MB down / round", "train-bytes-down-per-round", 1e-6, 2),
        ("MB up / round", "train-bytes-up-per-round", 1e-6, 2),
    ]
    seeds = sorted({r["seed"] for r in rows})
    head = (
        f"{experiment.name}: {experiment.nodes} clients, engine {experiment.engine}, "
        f"seeds {seeds}; mean ± std over seeds"
    )
    lines = [head + (f" — {experiment.description}" if experiment.description else ""), ""]
    lines.append("| run | split | seeds | " + " | ".join(c[0] for c in columns) + " |")
    lines.append("|---|---|---|" + "---|" * len(columns))
    for label in experiment.labels:
        mine = [r for r in rows if r["label"] == label]
        if not mine:
            continue
        split = mine[0]["split"].split(" (")[0]
        cells = [_cell([r.get(key) for r in mine], s, d) for _, key, s, d in columns]
        lines.append(f"| {label} | {split} | {len(mine)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Pooled: over all test examples; p10 / worst: over clients; clients hurt: "
        "personalized below the run's own global model on the same client"
        + (
            f"; hurt vs {experiment.baseline}: personalized below {experiment.baseline}'s "
            "global model on the same client and seed"
            if experiment.baseline
            else ""
        )
        + "; dropped: replies the server dropped in the whole run (honest clients: 0); "
        "s / round: median wall seconds of a training round after any pre-training; "
        "MB down / up: the arrays of a training round (all its clients) as Flower "
        "serializes them, mean over rounds.",
    ]
    if experiment.pivot:
        lines += ["", *pivot_table(experiment, rows)]
    return "\n".join(lines)


def _scale(key: str) -> float:
    return 100.0 if "accuracy" in key else 1.0


def _header(key: str) -> str:
    return key + (" %" if "accuracy" in key else "")


def pivot_table(experiment: Experiment, rows: list[dict]) -> list[str]:
    """``pivot-metric`` (mean ± std over seeds): one line per label without the pivot keys,
    one column per combination of the pivot keys' values, in the file's order."""
    keys = experiment.pivot

    def split(run: Run) -> tuple[str, tuple]:
        rest = [(k, v) for k, v in run.point if k not in keys and _varies(experiment, k)]
        line = " ".join([run.name] + [_show(k, v) for k, v in rest])
        return line, tuple(_pivot_value(dict(run.point).get(k, "–")) for k in keys)

    places = [split(run) for run in experiment.runs]
    lines_, columns = (
        list(dict.fromkeys(p[0] for p in places)),
        list(dict.fromkeys(p[1] for p in places)),
    )
    values: dict[tuple[str, tuple], list] = {}
    by_label_seed = {(r["label"], r["seed"]): r for r in rows}
    for run, place in zip(experiment.runs, places):
        row = by_label_seed.get((run.label, run.seed))
        if row is not None:
            values.setdefault(place, []).append(row.get(experiment.pivot_metric))
    metric = experiment.pivot_metric
    head = ["run"] + [" ".join(column) for column in columns]
    out = [
        f"{_header(metric)} by {', '.join(keys)} (mean ± std over seeds)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for line in lines_:
        cells = [_cell(values.get((line, c), []), _scale(metric), 2) for c in columns]
        out.append(f"| {line} | " + " | ".join(cells) + " |")
    return out


def _pivot_value(value: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)


def _varies(experiment: Experiment, key: str) -> bool:
    """Whether ``key`` takes more than one value over the experiment's runs."""
    return len({repr(dict(r.point).get(key)) for r in experiment.runs}) > 1


def _curves(rows: list[dict], key: str) -> dict[int, list[float]]:
    """round -> the value of ``key`` in every seed's run (train or evaluate metric)."""
    by_round: dict[int, list[float]] = {}
    for row in rows:
        results = json.loads((Path(row["path"]) / "results.json").read_text())
        for r in results["rounds"]:
            if key == "train-loss":
                from pflower.strategies.history import train_loss

                value = train_loss(r["train"])
            else:
                value = r["evaluate"].get(key)
            if value is not None and math.isfinite(value):
                by_round.setdefault(r["round"], []).append(value)
    return by_round


def plot_curves(experiment: Experiment, rows: list[dict], path: Path) -> None:
    """Personalized test accuracy (evaluated rounds) and training loss per round, one line
    per label: the mean over seeds, the band from the lowest to the highest seed."""
    import matplotlib.pyplot as plt

    regression = all("personal-accuracy" not in r for r in rows)
    metric = "personal-rmse" if regression else "personal-accuracy"
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab10")
    spans = []
    for i, label in enumerate(experiment.labels):
        mine = [r for r in rows if r["label"] == label]
        if not mine:
            continue
        color = colors(i % 10)
        for ax, key, scale in (
            (axes[0], metric, 1 if regression else 100),
            (axes[1], "train-loss", 1),
        ):
            curve = _curves(mine, key)
            if not curve:
                continue
            xs = sorted(curve)
            mean = [scale * statistics.mean(curve[x]) for x in xs]
            lo = [scale * min(curve[x]) for x in xs]
            hi = [scale * max(curve[x]) for x in xs]
            ax.plot(xs, mean, "-o" if len(xs) < 15 else "-", color=color, label=label, ms=3)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
            if key == "train-loss":
                spans += [v for v in lo + hi if v > 0]
    axes[0].set_ylabel(
        "test RMSE (personalized)" if regression else "test accuracy % (personalized, pooled)"
    )
    axes[1].set_ylabel("training loss (clients' mean)")
    if spans and max(spans) / min(spans) > 100:  # a diverging run would flatten the rest
        axes[1].set_yscale("log")
    for ax, title in zip(axes, ("evaluated rounds", "every round")):
        ax.set_xlabel("round")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if not handles:
        handles, names = axes[1].get_legend_handles_labels()
    fig.legend(handles, names, loc="center right", fontsize=8)
    fig.suptitle(f"{experiment.name}: mean over seeds, band = min..max over seeds")
    for ax in axes:
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_clients(experiment: Experiment, rows: list[dict], path: Path) -> None:
    """Final per-client personalized accuracy of every label side by side (all seeds'
    clients), box and points, the global model's as a second box where the run has one."""
    import matplotlib.pyplot as plt

    regression = all("personal-accuracy" not in r for r in rows)
    metric, scale = ("rmse", 1.0) if regression else ("accuracy", 100.0)
    labels = [lab for lab in experiment.labels if any(r["label"] == lab for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels) + 2), 4.8))
    for i, label in enumerate(labels):
        per = {"personal": [], "global": []}
        for row in (r for r in rows if r["label"] == label):
            for c in clients_of(row).values():
                for which in per:
                    if f"{which}-{metric}" in c:
                        per[which].append(scale * c[f"{which}-{metric}"])
        for which, offset, color in (("personal", -0.18, "C0"), ("global", 0.18, "C1")):
            values = per[which]
            if not values:
                continue
            ax.boxplot(
                values,
                positions=[i + offset],
                widths=0.3,
                showfliers=False,
                patch_artist=True,
                boxprops={"facecolor": color, "alpha": 0.35},
                medianprops={"color": color},
            )
            rng = random.Random(i)  # the same jitter on every redraw
            jitter = [rng.uniform(-0.1, 0.1) for _ in values]
            ax.scatter([i + offset + j for j in jitter], values, s=4, color=color, alpha=0.5)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"test {metric}" + (" %" if not regression else "") + " per client")
    ax.plot([], [], "s", color="C0", alpha=0.5, label="personalized")
    ax.plot([], [], "s", color="C1", alpha=0.5, label="own global model")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"{experiment.name}: every client of every seed, final round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- command line -----------------------------------------------------------------------------


def _value(text: str) -> Any:
    """``--set`` values as TOML reads them (numbers, booleans, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pflower.experiment",
        description="Run an experiment file (a grid of runs) and summarize it.",
    )
    p.add_argument("file", type=Path, help="the experiment's TOML file")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: the file's)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="replace the file's seeds")
    p.add_argument("--only", nargs="+", default=None, metavar="RUN", help="runs by name or label")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="run-config keys over [base] for every run",
    )
    p.add_argument("--workers", type=int, default=None, help="runs side by side")
    p.add_argument("--check", action="store_true", help="validate the file, list runs, stop")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--set {item!r}: must be KEY=VALUE", file=sys.stderr)
            return 2
        overrides[key.strip()] = _value(value.strip())
    try:
        experiment = load(args.file, overrides, args.seeds, args.only, args.out)
    except ConfigError as err:
        print(f"pflower: {err}", file=sys.stderr)
        return 2
    if args.workers is not None:
        experiment.workers = args.workers
    todo = sum(not finished(r, experiment) for r in experiment.runs)
    print(
        f"{experiment.name}: {len(experiment.labels)} runs x {len(experiment.seeds)} seeds = "
        f"{len(experiment.runs)} ({todo} to run), {experiment.nodes} clients each, engine "
        f"{experiment.engine}, {experiment.parallel} at a time -> {experiment.out}",
        file=sys.stderr,
    )
    if args.check:
        for label in experiment.labels:
            print(f"  {label}", file=sys.stderr)
        return 0
    started = time.perf_counter()
    cpu = time.process_time()
    rows = execute(experiment, progress=not args.no_progress)
    text = write_summary(experiment, rows) if rows else "no finished run"
    wall = time.perf_counter() - started
    print(f"\n{text}\n")
    print(
        f"{len(rows)} of {len(experiment.runs)} runs finished; this command: {wall:.0f} s wall, "
        f"{time.process_time() - cpu:.0f} s CPU in this process (each run's own in "
        f"summary.csv: cpu-seconds); outputs: {experiment.out}"
    )
    return 0 if len(rows) == len(experiment.runs) else 1


def cli() -> None:
    """The ``pflower`` console script: ``pflower experiment FILE [options]``."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "experiment":
        print("usage: pflower experiment FILE [options] (pflower experiment --help)")
        raise SystemExit(2)
    raise SystemExit(main(argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
