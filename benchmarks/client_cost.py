"""What a training message costs a client besides training, and a round's CPU outside it.

Runs one configuration through ``LocalGrid`` (every client in this process, one message at a
time, so every CPU second is seen) and times, in CPU seconds of the process (all threads:
torch's intra-op workers spend training CPU outside the calling thread):

- ``train_ms``: the algorithm's local training (``ClientHalf.train``: the local epochs and
  the reply's tensors), per training message, median;
- ``setup_ms``: the rest of the ClientApp's handling of that message (run config, model,
  data, personal state, reseeding, received arrays -> torch, the reply message), median;
  ``setup_repeat_ms`` the same over the messages to a client this process has served
  before (its data cached);
- ``non_training_share``: per training round, the share of the process's CPU seconds (from
  one ``configure_train`` to the next phase) spent outside ``ClientHalf.train`` (sampling,
  messages, reply checks, aggregation, client set-up), median over rounds 2.. (round 1 also
  loads the data).

Two presets: ``leaf`` (the scale benchmark's clients: FedAlt, MLP, ``synthetic-leaf``, at most
100 training samples, one local epoch, 10% of ``--clients`` per round) and ``mnist`` (the
issue's 20 MLP clients on ``mnist-5k``, every client every round).

    python benchmarks/client_cost.py --preset leaf --clients 1000
    python benchmarks/client_cost.py --preset mnist --clients 20
    python benchmarks/client_cost.py --preset mnist --clients 20 --engine simulation

``--engine simulation`` runs the same through Flower's ``run_simulation`` (Ray workers, one
CPU each). The clients then run in other processes: each training reply carries the CPU
seconds its worker process spent in ``ClientHalf.train`` (the metric ``bench-train-cpu-s``,
added by this harness's wrapper around pflower's ClientApp), and a round's CPU is the whole
process tree's (this process, Ray's GCS, raylet and workers, read from ``/proc``) from one
``configure_train`` to the next phase. ``non_training_share`` is then everything else: the
engine's messaging and scheduling, Ray's own processes, the ClientApp's set-up, the server;
``non_training_cpu_s_per_round`` splits it (median over rounds 2..) into this process (the
ServerApp and Flower's dispatcher), the Ray workers outside ``ClientHalf.train`` and Ray's
own processes.
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

sys.path.insert(0, str(ROOT / "benchmarks"))

from scale import config as scale_config  # noqa: E402

PRESETS = {
    # the scale benchmark's clients; evaluation only at the end, one local epoch
    "leaf": {**scale_config("fedalt", 0, 5, ""), "evaluate-every": 100, "local-epochs": 1},
    "mnist": {
        "algorithm": "fedalt",
        "dataset": "mnist-5k",
        "model": "mlp",
        "split": "head",
        "pretrain-rounds": 0,
        "num-server-rounds": 5,
        "fraction-train": 1.0,
        "evaluate-every": 100,
        "local-epochs": 1,
        "finetune-epochs": 1,
    },
}


def measure(preset: str, clients: int, out: str) -> dict:
    from pflower.client_app import build_client_app
    from pflower.config import Config
    from pflower.strategies import get_algorithm
    from pflower.strategies.server import PersonalizedStrategy
    from pflower.testbed.local_grid import run_local

    run = {**PRESETS[preset], "outputs-dir": out}
    cfg = Config.from_run_config(run)
    half = type(get_algorithm(cfg.algorithm).client)
    train_fn, local = half.train, threading.local()
    messages: list[tuple[float, float]] = []  # (whole message, training) CPU s
    trained: list[float] = []  # training CPU s, in order, for the round totals

    def timed_train(self, job, config):
        start = time.process_time()
        try:
            return train_fn(self, job, config)
        finally:
            local.train = time.process_time() - start
            trained.append(local.train)

    app = build_client_app(run)

    seen: set[int] = set()
    repeat: list[float] = []  # set-up of training messages to a client seen before

    def client(msg, context):
        local.train, start = None, time.process_time()
        reply = app(msg, context)
        if local.train is not None:  # a training message
            messages.append((time.process_time() - start, local.train))
            if context.node_id in seen:
                repeat.append(messages[-1][0] - local.train)
            seen.add(context.node_id)
        return reply

    marks: list[tuple[str, float, int]] = []  # (phase, process CPU s, trainings so far)
    originals = {
        n: getattr(PersonalizedStrategy, n) for n in ("configure_train", "configure_evaluate")
    }

    def marking(name):
        def wrapped(self, *args, **kwargs):
            marks.append((name, time.process_time(), len(trained)))
            return originals[name](self, *args, **kwargs)

        return wrapped

    half.train = timed_train
    for name in originals:
        setattr(PersonalizedStrategy, name, marking(name))
    started = time.monotonic()
    try:
        run_local(run, clients, client_app=client)
    finally:
        half.train = train_fn
        for name, fn in originals.items():
            setattr(PersonalizedStrategy, name, fn)
    shares = []
    for (phase, cpu, done), (_, cpu_next, done_next) in zip(marks, marks[1:]):
        if phase == "configure_train":
            round_cpu = cpu_next - cpu
            shares.append(1 - sum(trained[done:done_next]) / round_cpu)
    setup = [total - train for total, train in messages]
    return {
        "preset": preset,
        "clients": clients,
        "messages": len(messages),
        "train_ms": round(1000 * statistics.median(t for _, t in messages), 2),
        "setup_ms": round(1000 * statistics.median(setup), 2),
        "setup_over_train": round(
            statistics.median(setup) / statistics.median(t for _, t in messages), 3
        ),
        "repeat_messages": len(repeat),
        "setup_repeat_ms": round(1000 * statistics.median(repeat), 2) if repeat else None,
        "non_training_share": round(statistics.median(shares[1:] or shares), 3),
        "wall_s": round(time.monotonic() - started, 1),
    }


TRAIN_CPU = "bench-train-cpu-s"


class TimedClientApp:
    """pflower's ClientApp, its training replies stamped with the CPU seconds the worker
    process spent in ``ClientHalf.train`` (``TRAIN_CPU``). Picklable for Ray: the wrapped
    app is built, and ``train`` wrapped, in the worker on its first message."""

    def __init__(self, run: dict) -> None:
        self.run, self.app, self.half = run, None, None

    def __call__(self, message, context):
        if self.app is None:
            from pflower.client_app import build_client_app
            from pflower.config import Config
            from pflower.strategies import get_algorithm

            half = type(get_algorithm(Config.from_run_config(self.run).algorithm).client)
            if not getattr(half, "_bench_timed", False):  # once per worker process
                train_fn = half.train

                def timed_train(this, job, config):
                    start = time.process_time()
                    try:
                        return train_fn(this, job, config)
                    finally:
                        half._bench_spent += time.process_time() - start

                half.train, half._bench_timed = timed_train, True
            self.app, self.half = build_client_app(self.run), half
        self.half._bench_spent = 0.0
        reply = self.app(message, context)
        spent = self.half._bench_spent
        if spent and reply.has_content() and "metrics" in reply.content:
            reply.content["metrics"][TRAIN_CPU] = spent
        return reply


def measure_simulation(preset: str, clients: int, out: str) -> dict:
    """The non-training share of a round under ``run_simulation`` (see the module's doc)."""
    started = time.monotonic()
    sim = simulate({**PRESETS[preset], "outputs-dir": out}, clients)
    rounds, trained, kinds = sim["round_cpu_s"], sim["round_train_cpu_s"], sim["kinds"]
    shares = [1 - sum(t) / total for t, total in zip(trained, rounds)]
    every = [t for round_ in trained for t in round_]
    return {
        "preset": preset,
        "clients": clients,
        "engine": "simulation",
        "messages": len(every),
        "train_ms": round(1000 * statistics.median(every), 2),
        "round_cpu_s": [round(c, 2) for c in rounds],
        "round_train_cpu_s": [round(sum(t), 2) for t in trained],
        "non_training_share": round(statistics.median(shares[1:] or shares), 3),
        "non_training_cpu_s_per_round": {
            k: round(statistics.median(v[1:] or v), 3) for k, v in kinds.items()
        },
        "wall_s": round(time.monotonic() - started, 1),
    }


def simulate(run: dict, clients: int) -> dict:
    """``run`` through ``run_simulation`` on ``clients`` SuperNodes (one CPU, one torch
    thread per Ray worker): per training round, the process tree's CPU seconds
    (``round_cpu_s``), each reply's CPU in ``ClientHalf.train`` (``round_train_cpu_s``) and
    the tree's CPU by kind of process (``kinds``: server, workers outside training, Ray)."""
    from flwr.clientapp import ClientApp
    from flwr.simulation import run_simulation
    from scale import TreeMonitor

    from pflower.server_app import build_server_app
    from pflower.strategies.server import PersonalizedStrategy

    timed = TimedClientApp(run)
    app = ClientApp()
    for kind in ("train", "evaluate", "query"):
        getattr(app, kind)()(timed)
    monitor = TreeMonitor()
    marks: list[tuple[str, float]] = []  # (phase, tree CPU s)
    snapshots: list[dict[int, float]] = []  # per mark: pid -> CPU s so far
    trained: list[list[float]] = []  # per training round: each reply's training CPU s
    originals = {
        n: getattr(PersonalizedStrategy, n)
        for n in ("configure_train", "configure_evaluate", "aggregate_train")
    }

    def marking(name):
        def wrapped(self, *args, **kwargs):
            marks.append((name, monitor.sample()))
            snapshots.append(dict(monitor.cpu_of))
            for pid in snapshots[-1]:
                _kind(pid)  # while it lives
            return originals[name](self, *args, **kwargs)

        return wrapped

    def collecting(self, server_round, replies):
        replies = list(replies)
        trained.append(
            [
                float(m.content["metrics"][TRAIN_CPU])
                for m in replies
                if m.has_content() and TRAIN_CPU in m.content.get("metrics", {})
            ]
        )
        return originals["aggregate_train"](self, server_round, replies)

    PersonalizedStrategy.configure_train = marking("configure_train")
    PersonalizedStrategy.configure_evaluate = marking("configure_evaluate")
    PersonalizedStrategy.aggregate_train = collecting
    try:
        run_simulation(
            server_app=build_server_app(run),
            client_app=app,
            num_supernodes=clients,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    finally:
        for name, fn in originals.items():
            setattr(PersonalizedStrategy, name, fn)
        monitor.stop()
    rounds = [
        cpu_next - cpu
        for (phase, cpu), (_, cpu_next) in zip(marks, marks[1:])
        if phase == "configure_train"
    ]
    # where the rest went, per round: this process (the ServerApp and Flower's dispatcher),
    # the Ray workers outside ClientHalf.train (the ClientApp's set-up, Flower's worker
    # side, (de)serialising messages) and Ray's own processes (GCS, raylet, monitors)
    kinds: dict[str, list[float]] = {"server": [], "workers-outside-training": [], "ray": []}
    spans = [
        (before, after)
        for (phase, _), before, after in zip(marks, snapshots, snapshots[1:])
        if phase == "configure_train"
    ]
    for (before, after), train in zip(spans, trained):
        spent = {k: 0.0 for k in kinds}
        for pid, cpu in after.items():
            spent[_kind(pid)] += cpu - before.get(pid, 0.0)
        spent["workers-outside-training"] -= sum(train)
        for k, v in spent.items():
            kinds[k].append(v)
    return {"round_cpu_s": rounds, "round_train_cpu_s": trained, "kinds": kinds}


_KINDS: dict[int, str] = {}


def _kind(pid: int) -> str:
    """``server`` (this process), ``workers-outside-training`` (a Ray worker: its command
    line starts with ``ray::`` once it runs a task or actor) or ``ray`` (Ray's own
    processes). Read while the process lives (called at every mark); a worker read before
    it took its ``ray::`` title is read again."""
    if pid == os.getpid():
        return "server"
    if _KINDS.get(pid) != "workers-outside-training":
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            # a worker's title, or a worker before it took one (the raylet's own command
            # line names default_worker.py among its options, not as its program)
            worker = args[0].startswith(b"ray::") or any(
                a.endswith(b"default_worker.py") for a in args[:2]
            )
            _KINDS[pid] = "workers-outside-training" if worker else "ray"
        except OSError:
            pass
    return _KINDS.get(pid, "ray")


def measure_floor(preset: str, clients: int, out: str) -> dict:
    """The engine's own cost for the same messages: Flower's ``FedAvg`` and a ClientApp that
    sends the received arrays straight back (no pflower code on either side, no training),
    ``run_simulation`` as in ``measure_simulation``. Per training round (rounds 2..): the
    process tree's CPU seconds and their split as there."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from scale import TreeMonitor

    from pflower.config import Config
    from pflower.task.data import dataset_info
    from pflower.task.models import build_model

    run = {**PRESETS[preset], "outputs-dir": out}
    cfg = Config.from_run_config(run)
    info = dataset_info(cfg)
    model = build_model(cfg.model, info.input_shape, info.num_classes)  # the same arrays
    rounds = int(run["num-server-rounds"])
    monitor = TreeMonitor()
    snapshots: list[dict[int, float]] = []

    class MarkedFedAvg(FedAvg):
        def configure_train(self, *args, **kwargs):
            monitor.sample()
            snapshots.append(dict(monitor.cpu_of))
            for pid in snapshots[-1]:
                _kind(pid)
            return super().configure_train(*args, **kwargs)

    client = ClientApp()

    @client.train()
    def echo(msg, context):
        content = RecordDict(
            {"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 100})}
        )
        return Message(content=content, reply_to=msg)

    server = ServerApp()

    @server.main()
    def main_(grid, context):
        strategy = MarkedFedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=clients,
            min_available_nodes=clients,
        )
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds)

    started = time.monotonic()
    try:
        run_simulation(
            server_app=server,
            client_app=client,
            num_supernodes=clients,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    finally:
        monitor.stop()
    kinds: dict[str, list[float]] = {"server": [], "workers-outside-training": [], "ray": []}
    for before, after in zip(snapshots, snapshots[1:]):
        spent = {k: 0.0 for k in kinds}
        for pid, cpu in after.items():
            spent[_kind(pid)] += cpu - before.get(pid, 0.0)
        for k, v in spent.items():
            kinds[k].append(v)
    totals = [sum(v) for v in zip(*kinds.values())]
    return {
        "preset": preset,
        "clients": clients,
        "engine": "simulation-floor",
        "round_cpu_s": [round(c, 2) for c in totals],
        "round_cpu_s_median": round(statistics.median(totals[1:] or totals), 3),
        "cpu_s_per_round": {k: round(statistics.median(v[1:] or v), 3) for k, v in kinds.items()},
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="leaf")
    parser.add_argument("--clients", type=int, nargs="+", default=[1000])
    parser.add_argument(
        "--engine", choices=["local", "simulation", "simulation-floor"], default="local"
    )
    parser.add_argument("--out", default="/tmp/pflower-client-cost")
    args = parser.parse_args(argv)
    how = {
        "local": measure,
        "simulation": measure_simulation,
        "simulation-floor": measure_floor,
    }[args.engine]
    for clients in args.clients:
        print(json.dumps(how(args.preset, clients, args.out)), flush=True)


if __name__ == "__main__":
    main()
