"""The grid: every combination of ``[grid]`` and a run's own ``grid`` values, crossed with
the seeds, as runs with their labels.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from pflower.experiment.spec import RESERVED, ExperimentError, Run

#: the run-config key of the client sample's seed: each run's ``seed`` unless set
SAMPLE_SEED = "sample-seed"


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
            # a reproducible sample (a table's rows compare like with like, a rerun repeats
            # it), unless the file asks otherwise (-1: secret, as the app's default)
            config.setdefault(SAMPLE_SEED, seed)
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
