"""The benchmarks' shared driver: runs in worker processes, progress lines, partial results."""

from __future__ import annotations

import json
import logging
import statistics
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


def percent_cell(values, digits: int = 2) -> str:
    """Fractions as a table cell: mean ± sample std in percent ("–" if none; std 0 for one)."""
    values = [100 * v for v in values if v is not None]
    if not values:
        return "–"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def quiet_worker() -> None:
    """A benchmark worker process: one torch thread (the pool runs processes side by side),
    Flower's and pflower's logs at errors only."""
    import torch

    torch.set_num_threads(1)
    for name in ("flwr", "pflower"):
        logging.getLogger(name).setLevel(logging.ERROR)


def pooled_accuracy(rows: list[dict], key: str = "personal-accuracy") -> float:
    """Accuracy pooled over the clients' test examples (each client weighted by its count)."""
    total = sum(r["num-examples"] for r in rows)
    return sum(r[key] * r["num-examples"] for r in rows) / total
