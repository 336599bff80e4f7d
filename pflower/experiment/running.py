"""Running the unfinished runs in worker processes, and resuming: a run is finished when
its ``run.json`` exists and its recorded config is the one the file asks for.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

from pflower.experiment.progress import Progress
from pflower.experiment.rows import row_of
from pflower.experiment.spec import RUN_FINISHED, Experiment, Run, attack_record, run_config


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
    # a run recorded before 'sample-seed' existed sampled from random.Random(seed), which is
    # what sample-seed = seed draws: the same run
    recorded.setdefault("sample-seed", recorded.get("seed"))
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
    if todo:
        jobs = [
            {
                "run": r,
                "config": run_config(r, experiment),
                "dir": str(r.directory(experiment.out)),
                "engine": experiment.engine,
                "nodes": experiment.nodes,
                "threads": experiment.threads,
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
    # one thread unless asked (``threads``): runs go side by side, and a second thread spins
    # on a busy box: FedAvg 40 rounds 73 CPU-s with 2 threads vs 8.6 with 1, Local 61 vs 12
    # (2-core box with another experiment running)
    torch.set_num_threads(job["threads"])
    started, cpu = time.perf_counter(), _cpu_seconds(resource)
    with open(directory / "log.txt", "w") as logfile, _redirected(logfile):
        if job["engine"] == "simulation":
            _simulate(job, directory)
        else:
            from pflower.testbed.local_grid import run_local

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
                "torch-threads": torch.get_num_threads(),
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

    from pflower.testbed.client_app import experiment_client_app
    from pflower.testbed.server_app import experiment_server_app

    reports: list = []
    run_simulation(
        server_app=experiment_server_app(job["config"], on_report=reports.append, out=directory),
        client_app=experiment_client_app(job["config"]),
        num_supernodes=job["nodes"],
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    if not reports:  # the engine logs a ServerApp's exception and returns
        raise RuntimeError("the ServerApp did not finish (its error is in log.txt)")


def read_row(run: Run, experiment: Experiment) -> dict | None:
    directory = run.directory(experiment.out)
    if not finished(run, experiment):
        return None
    return row_of(directory)
