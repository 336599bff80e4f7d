"""How a run scales with the number of simulated clients on one machine.

FedAlt (or FedAvg) on ``synthetic-leaf`` with at most 100 training samples per client, 10%
of the clients per round, evaluation of 10% every 5 rounds and the final evaluation
(``final-evaluate-fraction``'s default), through Flower's simulation engine
(``run_simulation``, Ray, one CPU per client) or ``LocalGrid`` (in process). Reported per
run, one JSON line:

- ``wall_s``: the whole run, engine start-up included;
- ``startup_s``: from the ServerApp's start to the first training message (node discovery);
- ``round_cpu_s``: CPU seconds of the process tree (this process, Ray's workers) per training
  round, median over rounds 2.. (round 1 also loads data in each worker);
- ``final_eval_cpu_s``: CPU seconds of the tree during the last evaluation;
- ``peak_rss_gib``: the largest summed resident memory of the tree, sampled every 0.2 s.

CPU and memory are read from ``/proc`` (Linux), for this process and every descendant.

    python benchmarks/scale.py --clients 1000 --engine simulation
    python benchmarks/scale.py --clients 10 100 1000 --engine simulation local \
        --algorithm fedalt fedavg
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree() -> dict[int, tuple[float, int]]:
    """pid -> (CPU seconds, RSS bytes) for this process and all its descendants."""
    stats: dict[int, tuple[int, float, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        ppid, utime, stime, rss = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[21])
        stats[int(entry)] = (ppid, (utime + stime) / TICK, rss * PAGE)
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in stats.items():
            if ppid == parent and pid not in mine:
                mine.add(pid)
                frontier.append(pid)
    return {pid: stats[pid][1:] for pid in mine if pid in stats}


class TreeMonitor:
    """Cumulative CPU of the process tree (a process that exits keeps its last reading) and
    the peak of its summed RSS, sampled in a background thread."""

    def __init__(self, period: float = 0.2) -> None:
        self.cpu_of: dict[int, float] = {}
        self.peak_rss = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def sample(self) -> float:
        tree = _tree()
        with self._lock:
            for pid, (cpu, _) in tree.items():
                self.cpu_of[pid] = max(cpu, self.cpu_of.get(pid, 0.0))
            self.peak_rss = max(self.peak_rss, sum(rss for _, rss in tree.values()))
            return sum(self.cpu_of.values())

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.sample()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.sample()


def config(algorithm: str, clients: int, rounds: int, out: str) -> dict:
    return {
        "algorithm": algorithm,
        "dataset": "synthetic-leaf",
        "partitioner": "natural",
        "max-train-samples": 100,
        "model": "mlp",
        "split": "head",
        "pretrain-rounds": 0,
        "num-server-rounds": rounds,
        "fraction-train": 0.1,
        "fraction-evaluate": 0.1,
        "evaluate-every": 5,
        "finetune-epochs": 1,
        "lr": 0.05,
        "outputs-dir": out,
    }


def run_one(
    algorithm: str, clients: int, engine: str, rounds: int, out: str, extra: dict | None = None
) -> dict:
    from pflower.strategies.server import PersonalizedStrategy

    marks: dict[str, list[float]] = {"train": [], "evaluate": [], "evaluated": []}
    monitor = TreeMonitor()
    originals = {
        name: getattr(PersonalizedStrategy, name)
        for name in ("configure_train", "configure_evaluate", "aggregate_evaluate")
    }

    def marking(name, key):
        def wrapped(self, *args, **kwargs):
            if key != "evaluated":
                marks[key].append((time.monotonic(), monitor.sample()))
            result = originals[name](self, *args, **kwargs)
            if key == "evaluated":
                marks[key].append((time.monotonic(), monitor.sample()))
            return result

        return wrapped

    PersonalizedStrategy.configure_train = marking("configure_train", "train")
    PersonalizedStrategy.configure_evaluate = marking("configure_evaluate", "evaluate")
    PersonalizedStrategy.aggregate_evaluate = marking("aggregate_evaluate", "evaluated")
    run = {**config(algorithm, clients, rounds, out), **(extra or {})}
    start, cpu0 = time.monotonic(), monitor.sample()
    server_start: list[float] = []
    try:
        if engine == "simulation":
            from flwr.simulation import run_simulation

            from pflower.client_app import build_client_app
            from pflower.server_app import build_server_app

            reports = []

            def on_report(report):
                reports.append(report)

            app = build_server_app(run, on_report=on_report)
            app_main = app._main

            def timed_main(grid, context):
                server_start.append(time.monotonic())
                return app_main(grid, context)

            app._main = timed_main
            run_simulation(
                server_app=app,
                client_app=build_client_app(run),
                num_supernodes=clients,
                backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
            )
            (report,) = reports
        else:
            from pflower.testbed.local_grid import run_local

            server_start.append(time.monotonic())
            report = run_local(run, clients)
    finally:
        for name, fn in originals.items():
            setattr(PersonalizedStrategy, name, fn)
    wall, cpu = time.monotonic() - start, monitor.stop() - cpu0
    trains = marks["train"]
    # CPU of each training round: from its configure_train to the next phase's start
    bounds = sorted(trains + marks["evaluate"])
    per_round = [
        bounds[bounds.index(t) + 1][1] - t[1] for t in trains if bounds.index(t) + 1 < len(bounds)
    ]
    last_eval, last_done = marks["evaluate"][-1], marks["evaluated"][-1]
    return {
        "clients": clients,
        "engine": engine,
        "algorithm": algorithm,
        "rounds": rounds,
        **{k: v for k, v in (extra or {}).items()},
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "startup_s": round(trains[0][0] - server_start[0], 1),
        "round_cpu_s": round(statistics.median(per_round[1:] or per_round), 2),
        "final_eval_cpu_s": round(last_done[1] - last_eval[1], 2),
        "final_eval_wall_s": round(last_done[0] - last_eval[0], 1),
        "final_evaluated": int(report.final.get("clients", 0)),
        "peak_rss_gib": round(monitor.peak_rss / 2**30, 2),
        "personal_accuracy": report.final.get("personal-accuracy"),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument(
        "--engine", nargs="+", default=["simulation"], choices=["simulation", "local"]
    )
    parser.add_argument("--algorithm", nargs="+", default=["fedalt"], choices=["fedalt", "fedavg"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="/tmp/pflower-scale")
    parser.add_argument(
        "--jsonl",
        type=Path,
        default=None,
        help="append each run's JSON line to this file (stdout also carries the runs' own "
        "console tables: redirecting it gave a file of mixed lines)",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config keys, e.g. max-in-flight=4",
    )
    args = parser.parse_args(argv)
    from pflower.config import Config

    extra = {k: v for k, v in (item.split("=", 1) for item in args.set)}
    extra = {
        k: Config.from_run_config({k: v}).model_dump(by_alias=True)[k] for k, v in extra.items()
    }
    for clients in args.clients:
        for engine in args.engine:
            for algorithm in args.algorithm:
                result = run_one(algorithm, clients, engine, args.rounds, args.out, extra)
                print(json.dumps(result), flush=True)
                if args.jsonl is not None:
                    with args.jsonl.open("a") as fh:
                        fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
