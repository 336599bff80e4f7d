"""What a round costs on real SuperNodes: the loopback deployment of the README (TLS, SuperNode
authentication, the Fleet gateway; ``pflower.deploy.Federation``), one run of ``--rounds``
rounds, each round's wall seconds from the run's results.json, against the clients' own work.

    python benchmarks/deploy_rounds.py                  # Flower's default: a process per message
    python benchmarks/deploy_rounds.py --warm           # pflower.deploy.warm_exec beside each node
    python benchmarks/deploy_rounds.py --warm --poll-interval 0.2   # and a 0.2 s SuperNode poll
    python benchmarks/deploy_rounds.py --warm --run-config pull-interval=3  # the server: 3 s pulls
    python benchmarks/deploy_rounds.py --supernodes 20 --fraction-train 0.5 --join-leave

Per round: the wall seconds the ServerApp measured from sending the training messages to
aggregating the replies (results.json's rounds: their ``seconds``), and the median
over rounds 2.. (round 1 loads the data). The overhead is that minus the slowest client's
training time (``train-seconds`` the replies carry is not sent; the same run on LocalGrid,
which has no transport, gives the work: ``local_round_s``), and against the same run through
Flower's simulation engine with as many SuperNodes (``run_simulation``: ``simulation_*``,
unless ``--no-simulation``). Before the run, the CPU the idle
federation uses per minute over ``--idle-seconds``, by process (the SuperLink and the gateway
answer the SuperNodes' polls; each SuperNode answers its SuperExec's): what a shorter
``--poll-interval`` costs. Prints one JSON object; every process it started is stopped
by its process id at the end (``Federation.stop_all``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = {
    "algorithm": "fedalt",
    "dataset": "digits",
    "partitioner": "pathological",
    "split": "head",
    "pretrain-rounds": 0,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "local-epochs": 1,
    "personal-epochs": 1,
    "finetune-epochs": 1,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mib(pids: list[int], field: str = "Rss") -> float:
    """Memory of these processes and all below them, MiB (from /proc): ``Rss``, each
    process's resident pages, or ``Pss``, with every page shared among N processes counted
    1/N in each (torch's libraries, which 20 warm SuperExecs map once between them): the sum
    of ``Pss`` is what the processes take from the machine."""
    from pflower.deploy.processes import descendants

    total = 0
    for pid in {p for root in pids for p in (root, *descendants(root))}:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds of these processes and all below them, those that ended included (from
    /proc: each process's user + system time and its waited-for children's)."""
    from pflower.deploy.processes import descendants

    ticks = 0
    for pid in {p for root in pids for p in (root, *descendants(root))}:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def _wait_for(path: Path, pattern: str, proc, timeout: float = 900) -> None:
    """Until ``pattern`` (a regex) matches the log ``path`` while ``flwr run`` (``proc``)
    runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before {pattern!r}")
        time.sleep(0.5)
    raise SystemExit(f"no {pattern!r} after {timeout} s")


def round_seconds(results: dict) -> list[float]:
    return [r["seconds"] for r in results["rounds"] if r.get("seconds")]


def median_after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] or seconds)


def simulation_rounds(run: dict, nodes: int) -> list[float]:
    """The same run through Flower's simulation engine (``run_simulation``, ``nodes``
    SuperNodes, Ray workers of one CPU): each round's wall seconds, as the ServerApp measured
    them."""
    from flwr.simulation import run_simulation

    from pflower.client_app import build_client_app
    from pflower.server_app import build_server_app

    reports = []
    run_simulation(
        server_app=build_server_app(run, on_report=reports.append),
        client_app=build_client_app(run),
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    if len(reports) != 1:
        raise SystemExit("the simulation run did not finish")
    return [r.seconds for r in reports[0].rounds if r.seconds]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--supernodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warm", action="store_true")
    p.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        help="the SuperNodes' poll (pflower.deploy.supernode); default: Flower's 3 s",
    )
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--settle-seconds", type=float, default=15.0)
    p.add_argument(
        "--run-config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config keys on top of the benchmark's (numbers as numbers)",
    )
    p.add_argument("--fraction-train", type=float, default=1.0)
    p.add_argument(
        "--no-simulation",
        action="store_true",
        help="skip the same run through run_simulation (its rounds are the comparison)",
    )
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--superlink-state",
        choices=["sqlite", "memory"],
        default="sqlite",
        help="the SuperLink's state: the kit's SQLite file (default) or Flower's memory",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads per SuperNode's ClientApps (default: the kit's share of the cores)",
    )
    p.add_argument(
        "--task-poll-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="each SuperExec's task poll (default: the kit's, Federation.task_poll_s)",
    )
    p.add_argument(
        "--join-leave",
        action="store_true",
        help="the last SuperNode joins after round 2, SuperNode 0 leaves then (SIGTERM)",
    )
    args = p.parse_args(argv)

    from pflower.deploy import Federation
    from pflower.testbed.local_grid import run_local

    work = Path(args.workdir or tempfile.mkdtemp(prefix="pflower-deploy-"))
    outputs = work / "outputs"
    run = {
        **RUN,
        "num-server-rounds": args.rounds,
        "evaluate-every": args.rounds,
        "fraction-train": args.fraction_train,
        "outputs-dir": str(outputs),
    }
    for item in args.run_config:
        key, _, value = item.partition("=")
        run[key] = json.loads(value) if re.fullmatch(r"-?[\d.e+-]+", value) else value
    fed = Federation(
        work / "fed", supernodes=args.supernodes, port=_free_port(), warm=args.warm,
        poll_interval=args.poll_interval, superlink_state=args.superlink_state,
        threads=args.threads, task_poll_interval=args.task_poll_interval,
    )  # fmt: skip
    started = time.monotonic()
    try:
        fed.up()
        up_s = time.monotonic() - started
        supernodes = [
            int(e["pid"])
            for k, e in fed.entries.items()
            if k.startswith(("supernode", "warm-exec"))
        ]
        time.sleep(args.settle_seconds)  # the warm SuperExecs' zygotes import torch first
        idle_mib = {f: _memory_mib(supernodes, f) for f in ("Rss", "Pss")}
        idle = {k: int(e["pid"]) for k, e in fed.entries.items()}
        cpu0 = {k: _cpu_s([pid]) for k, pid in idle.items()}
        time.sleep(args.idle_seconds)
        idle_cpu = {  # none measured without --idle-seconds
            k: round((_cpu_s([pid]) - cpu0[k]) * 60 / args.idle_seconds, 2)
            for k, pid in idle.items()
            if args.idle_seconds > 0
        }
        late = args.supernodes - 1
        events = []
        if args.join_leave:  # the last node is not there when the run starts
            fed.stop(f"supernode-{late}")
        labels = {k: int(e["pid"]) for k, e in fed.entries.items()}
        by_label0 = {k: _cpu_s([pid]) for k, pid in labels.items()}
        gone: dict[str, float] = {}  # label -> its CPU when it was stopped mid-run
        t0 = time.monotonic()
        if not args.join_leave:
            done = fed.run(run, ROOT, timeout=1800)
            failed = done.returncode != 0 and done.stdout[-3000:] + done.stderr[-3000:]
        else:
            proc = fed.submit(run, ROOT, "run")
            _wait_for(fed.logs / "run.log", r"round +2/\d+ \|", proc)
            fed.start_supernodes([late])
            events.append(f"supernode-{late} joined after round 2 ({time.monotonic() - t0:.0f} s)")
            for k, e in fed.entries.items():  # the joiner (and its warm SuperExec): all its
                if k not in labels:  # CPU is the run's
                    labels[k], by_label0[k] = int(e["pid"]), 0.0
            for k in ("supernode-0", "warm-exec-0"):  # the leaver's CPU, read before it goes
                if k in labels:
                    gone[k] = _cpu_s([labels[k]])
            fed.stop("supernode-0")
            events.append(f"supernode-0 left after round 2 ({time.monotonic() - t0:.0f} s)")
            failed = proc.wait(1800) != 0 and (fed.logs / "run.log").read_text()[-3000:]
        run_s = time.monotonic() - t0
        final = {k: gone[k] if k in gone else _cpu_s([pid]) for k, pid in labels.items()}
        by_label = {k: round(final[k] - by_label0[k], 1) for k in labels}
        run_cpu = sum(final[k] - by_label0[k] for k in labels)
        nodes_now = [
            int(e["pid"])
            for k, e in fed.entries.items()
            if k.startswith(("supernode", "warm-exec"))
        ]
        busy_mib = {f: _memory_mib(nodes_now, f) for f in ("Rss", "Pss")}
        if failed:
            raise SystemExit(failed)
    finally:
        fed.stop_all()
    (results_path,) = outputs.glob("*/results.json")
    results = json.loads(results_path.read_text())
    rounds = round_seconds(results)
    replies = [r.get("train", {}).get("replies") for r in results["rounds"]]
    local = run_local({**run, "outputs-dir": str(work / "local")}, args.supernodes)
    local_rounds = [r.seconds for r in local.rounds if r.seconds]
    simulated = (
        None
        if args.no_simulation
        else simulation_rounds({**run, "outputs-dir": str(work / "simulation")}, args.supernodes)
    )
    result = {
        "supernodes": args.supernodes,
        "warm": args.warm,
        "poll_interval": args.poll_interval,
        "superlink_state": args.superlink_state,
        "threads_per_supernode": fed.threads_per_node,
        "task_poll_s": fed.task_poll_s,
        "run_config": args.run_config,
        "rounds": args.rounds,
        "round_s": [round(s, 2) for s in rounds],
        "replies_per_round": replies,
        "events": events,
        "median_round_s": round(median_after_first(rounds), 2),
        "local_grid_median_round_s": round(median_after_first(local_rounds), 3),
        "simulation_round_s": simulated and [round(s, 2) for s in simulated],
        "simulation_median_round_s": simulated and round(median_after_first(simulated), 2),
        "run_wall_s": round(run_s, 1),
        # the federation's processes (SuperLink with the ServerApp, gateway, SuperNodes, their
        # SuperExecs and ClientApps), not the flwr CLI's
        "run_cpu_s": round(run_cpu, 1),
        "run_cpu_s_by_process": by_label,
        "up_s": round(up_s, 1),
        # the SuperNodes with their SuperExecs (warm ones included) and whatever runs below
        "supernode_rss_mib_idle": round(idle_mib["Rss"], 1),
        "supernode_rss_mib_after_run": round(busy_mib["Rss"], 1),
        "per_supernode_rss_mib_idle": round(idle_mib["Rss"] / args.supernodes, 1),
        "supernode_pss_mib_idle": round(idle_mib["Pss"], 1),
        "supernode_pss_mib_after_run": round(busy_mib["Pss"], 1),
        "per_supernode_pss_mib_idle": round(idle_mib["Pss"] / args.supernodes, 1),
        "idle_cpu_s_per_minute": round(sum(idle_cpu.values()), 2) if idle_cpu else None,
        "idle_cpu_s_per_minute_by_process": idle_cpu,
    }
    result["overhead_s"] = round(result["median_round_s"] - result["local_grid_median_round_s"], 2)
    if simulated:  # what the deployment costs per round beyond the simulation engine
        result["overhead_vs_simulation_s"] = round(
            result["median_round_s"] - result["simulation_median_round_s"], 2
        )
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
