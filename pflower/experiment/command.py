"""The command line: ``python -m pflower.experiment FILE`` and the ``pflower`` console script
(``pflower experiment FILE``, ``pflower run``, ``pflower check-config``: ``pflower.launch``)."""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pflower.config import ConfigError
from pflower.experiment.loading import load
from pflower.experiment.running import execute, finished
from pflower.experiment.spec import EXPERIMENT_KEYS
from pflower.experiment.tables import write_summary


def _value(text: str) -> Any:
    """``--set`` values as TOML reads them (numbers, booleans, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def file_format() -> str:
    """The experiment file's format, as ``--help`` shows it: the ``[experiment]`` keys as the
    loader checks them (``spec.EXPERIMENT_KEYS``), the tables, an example and the docs."""
    keys = "\n".join(f"    {k:<13} {what}" for k, what in EXPERIMENT_KEYS.items())
    return (
        "the file (TOML):\n"
        "  [experiment]   what the experiment is:\n"
        f"{keys}\n"
        "  [base]         run-config keys every run starts from (docs/reference/run-config.md)\n"
        "  [grid]         key = [values, ...]: every run once per value (its label says which)\n"
        '  [[run]]        name = "...", run-config keys over [base], and optionally\n'
        "                 grid = { key = [values, ...] } for that run alone\n"
        "example: benchmarks/experiments/mnist-5c.toml; the format in full: docs/experiments.md"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pflower experiment",
        description="Run an experiment file (a grid of runs) and summarize it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=file_format(),
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
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: 1)")
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
    if args.threads is not None:
        if args.threads < 1:
            print(f"--threads {args.threads}: must be an integer >= 1", file=sys.stderr)
            return 2
        experiment.threads = args.threads
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
