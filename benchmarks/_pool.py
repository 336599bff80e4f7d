"""A script benchmark's driver (``ffgg_synthetic.py``): runs in worker processes, progress
lines, partial results. Sweeps over methods and seeds are experiment files instead."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def run_pool(
    one: Callable[[tuple], dict],
    jobs: Sequence[tuple],
    workers: int,
    out: Path,
    header: dict,
    label: Callable[[dict], str],
) -> list[dict]:
    """``one(job)`` for every job in ``workers`` processes, in order. After each run prints
    ``label(result)`` and rewrites ``out/results.json`` as ``{**header, "runs": [...]}``, so
    a long sweep that is stopped still leaves what it finished."""
    results: list[dict] = []
    with ProcessPoolExecutor(workers) as pool:
        for result in pool.map(one, jobs):
            results.append(result)
            print(f"{label(result)} ({result['seconds']:.0f} s)", flush=True)
            (out / "results.json").write_text(json.dumps({**header, "runs": results}))
    return results
