"""Reading an experiment file and validating it whole (every run's config) before
anything runs.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pflower.config import ConfigError
from pflower.experiment.grid import _grid, _runs_of
from pflower.experiment.spec import (
    ATTACK,
    ENGINES,
    EXPERIMENT_KEYS,
    NO_ATTACK,
    RESERVED,
    SECTIONS,
    Experiment,
    ExperimentError,
    Run,
    _slug,
    run_config,
)


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
    threads = meta.get("threads", 1)
    _expect(
        isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1,
        "threads",
        threads,
    )
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
        threads=threads,
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
        from pflower.testbed.attacks import attack_of

        try:
            attack_of(node_config)
        except ValueError as err:
            raise ExperimentError(f"{where} key 'node-config': {err}") from None
        attacks[name] = {"fraction": float(fraction), "node-config": dict(node_config)}
    return attacks


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
