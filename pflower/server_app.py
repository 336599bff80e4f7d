"""The ServerApp: run config -> Config -> strategy -> strategy.start(...) -> report."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from pflower import checkpoint, quiet, report
from pflower.config import Config, ConfigError
from pflower.flower import FlowerDrift
from pflower.flower import dp as flower_dp
from pflower.strategies import (
    PersonalizedStrategy,
    build_run_model,
    get_algorithm,
    make_strategy,
    personal_split,
    wire_split,
)
from pflower.strategies.history import WireCount
from pflower.strategies.settle import RunFailed
from pflower.task import linear
from pflower.task.fingerprint import expected_data_kind, model_fingerprint
from pflower.task.split import Split, get_tensors
from pflower.wire import DATA_KIND, MODEL_FINGERPRINT

log = logging.getLogger("flwr.pflower")


def split_name(cfg: Config) -> str:
    rule = get_algorithm(cfg.algorithm).personal_split
    if rule != "config":
        return rule
    return f"patterns {cfg.split_patterns}" if cfg.split_patterns else cfg.split


def check_split(cfg: Config, split: Split, personal: Split) -> None:
    """Refuse, before any client is contacted, a split that leaves the algorithm nothing to
    federate or nothing to personalize (e.g. ``split = "full"`` or a ``*`` pattern)."""
    entry = get_algorithm(cfg.algorithm)
    chosen = f"key 'split' = {cfg.split!r}" + (
        f" / 'split-patterns' = {cfg.split_patterns!r}" if cfg.split_patterns else ""
    )
    if entry.wire_split == "config" and split.num_shared == 0:
        raise ConfigError(
            f"{chosen}: leaves no shared parameter, and {cfg.algorithm!r} federates the "
            "shared part; choose a split that keeps some parameters shared (or 'local' for "
            "no federation)"
        )
    if entry.personal_split == "config" and personal.num_personal == 0:
        raise ConfigError(
            f"{chosen}: leaves no personal parameter, and {cfg.algorithm!r} personalizes "
            "the personal part; choose a split with a personal part (or 'fedavg' for one "
            "shared model)"
        )


#: what may attach to a run's strategy from outside before it starts (``run``'s ``prepare``)
Prepare = Callable[[PersonalizedStrategy, Config], None]


def run(
    grid: Grid, cfg: Config, out: Path | None = None, prepare: Prepare | None = None
) -> report.RunReport:
    """Run ``cfg`` on the nodes of ``grid``; write the outputs (into ``out``, or a new
    directory under ``outputs-dir``) and print the summary. ``prepare(strategy, cfg)``, if
    given, attaches to the strategy what the production path has not (the testbed inserts
    its simulation of an omniscient adversary as a stage of the reply pipeline)."""
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = build_run_model(cfg)
    split, personal = wire_split(model, cfg), personal_split(model, cfg)
    check_split(cfg, split, personal)
    log.info("pflower: %s on %s, model %s", cfg.algorithm, cfg.dataset, cfg.model)
    ignored = cfg.ignored_keys()
    if ignored:  # set, but another algorithm's: say so once instead of dropping them silently
        log.warning(
            "pflower: keys ignored by algorithm %r (they belong to other algorithms): %s",
            cfg.algorithm,
            ", ".join(f"{k}={v!r}" for k, v in ignored.items()),
        )
    log.info("personalized part: %s", personal.describe())
    log.info(
        "on the wire: %d of %d parameters", split.num_shared, split.num_shared + split.num_personal
    )
    strategy = make_strategy(cfg, split.shared)
    # the handshake: every node runs this model and data
    strategy.nodes.expected_facts.update(
        {MODEL_FINGERPRINT: model_fingerprint(model), DATA_KIND: expected_data_kind(cfg.dataset)}
    )
    if prepare is not None:  # what attaches from outside (the testbed's attack simulation)
        prepare(strategy, cfg)
    elif cfg.attack_simulation:
        raise ConfigError(
            "key 'attack-simulation' = true: pflower's ServerApp never simulates an attack; "
            "robustness experiments run the testbed's (serverapp = "
            "'pflower.testbed.server_app:app', or pflower.testbed.local_grid.run_local)"
        )
    # With FedAvg pre-training the whole model travels first; the strategy splits it after.
    initial = [n for n, _ in model.named_parameters()] if cfg.pretrain_rounds else split.shared
    tensors = get_tensors(model, initial)
    resume = None  # a checkpoint this run continues (pflower.checkpoint)
    fab_hash = fab_hash_of(grid)
    if cfg.resume_from:
        resume_from = str(report.resolve(cfg.resume_from, fab_hash))
        tensors, resume = resume_point(cfg, strategy, model, split, tensors, resume_from)
    if out is None:
        out = report.output_dir(cfg, fab_hash)
    else:
        out.mkdir(parents=True, exist_ok=True)
    log.info("pflower: outputs in %s", out)
    wire = WireCount(grid)  # the array bytes of every message, by round
    evaluate_fn = checkpointing(cfg, out, strategy, grid, server_evaluation(cfg, strategy, grid))
    with report.console(cfg), report.Tracker(cfg, out) as tracker:
        final = strategy.start(
            grid=wire,
            initial_arrays=ArrayRecord(tensors),
            num_rounds=cfg.total_rounds,
            timeout=cfg.round_timeout or None,  # 0: RoundDeadline
            evaluate_fn=after_round(strategy, wire, tracker, evaluate_fn),
            **({"resume": resume} if resume else {}),
        )
    for entry in strategy.history:  # rounds the hook did not see (an asynchronous server's)
        entry.wire = wire.by_round.get(entry.round, entry.wire)
    result = report.RunReport(
        cfg=cfg,
        split=f"{split_name(cfg)} ({100 * personal.personal_fraction:.2f}% personal)",
        num_nodes=len(list(grid.get_node_ids())),
        rounds=strategy.history,
        clients=strategy.final_clients,
        seconds=time.perf_counter() - started,
        shared=final.arrays.to_torch_state_dict() if final is not None else None,
        run_tag=strategy.run_tag,
        fab_hash=fab_hash,
        sampling=strategy.nodes.sampling,
        refused=list(strategy.nodes.refusals),
    )
    out = report.write(result, out)
    table = report.summary_table(result)
    print(f"\n{table}\n\nresults: {out}\n", flush=True)
    return result


def fab_hash_of(grid: Grid) -> str:
    """The hash of the FAB this run came from (Flower's run info: ``flwr run`` packs the app
    into a FAB and runs it from an installed copy); "" for a run in process (``LocalGrid``,
    Flower's ``run_simulation``), which has no FAB."""
    try:
        return str(grid.run.fab_hash or "")
    except Exception:  # noqa: BLE001 - a Grid without run info (a test's, a user's own)
        return ""


def resume_point(
    cfg: Config, strategy, model: torch.nn.Module, split: Split, tensors: dict,
    path: str | None = None,
) -> tuple[dict, checkpoint.Checkpoint | None]:  # fmt: skip
    """What ``resume-from`` (found at ``path``: ``report.resolve``) starts from: a
    checkpoint's round, arrays and strategy state (the run continues), or a file's shared
    parameters (a warm start)."""
    path = path or cfg.resume_from
    found = checkpoint.read(path)
    if isinstance(found, checkpoint.Checkpoint):
        if found.continuable and continuable(strategy):
            found.check(cfg)
            # up to the last pre-training round the whole model travels, the shared part after
            whole = cfg.pretrain_rounds and found.round <= cfg.pretrain_rounds
            names = [n for n, _ in model.named_parameters()] if whole else split.shared
            checkpoint.check_arrays(found, get_tensors(model, names))
            log.info("resume-from: continuing the run of %s", checkpoint.describe(found))
            return dict(found.arrays), found
        log.warning(
            "resume-from: %s cannot be continued by %r: starting from its shared parameters",
            checkpoint.describe(found),
            cfg.algorithm,
        )
        found = found.arrays
    return resumed(path, found, tensors), None


def resumed(path: str, saved: dict, tensors: dict) -> dict:
    """The shared parameters ``saved`` (read from ``path``, ``resume-from``), checked against
    the model."""
    mismatch = {k for k in tensors if k not in saved or saved[k].shape != tensors[k].shape}
    if mismatch or set(saved) != set(tensors):
        raise ValueError(
            f"key 'resume-from' = {path!r}: its tensors do not match this run's shared "
            f"parameters (e.g. {sorted(mismatch or set(saved) ^ set(tensors))[:3]})"
        )
    log.info("resuming from %s", path)
    return {k: saved[k].to(tensors[k].dtype) for k in tensors}


def after_round(strategy, wire: WireCount, tracker: report.Tracker, evaluate_fn):
    """Wrap Flower's per-round ``evaluate_fn`` hook (called after each round's training and
    evaluation): the round's bytes into its log, its console line, its tracking scalars."""

    noted = []  # the "train loss –" note, said once per run

    def stamp(server_round: int):
        entry = next((e for e in reversed(strategy.history) if e.round == server_round), None)
        if entry is not None:
            entry.wire = wire.by_round.get(server_round, {})
        return entry

    def evaluate(server_round: int, arrays: ArrayRecord):
        # the round's bytes first: ``evaluate_fn`` writes the round's checkpoint, and a run
        # resumed from it reports what the checkpoint holds
        stamp(server_round)
        result = evaluate_fn(server_round, arrays) if evaluate_fn else None
        entry = stamp(server_round)  # an entry the server's evaluation added
        if entry is not None:
            log.info(report.round_line(entry, strategy.num_rounds))
            note = None if noted else report.loss_note(entry, strategy.algorithm)
            if note:
                log.info(note)
                noted.append(note)
            tracker.add_round(entry)
        return result

    return evaluate


def checkpointing(cfg: Config, out: Path, strategy, grid: Grid, evaluate_fn):
    """Wrap Flower's per-round ``evaluate_fn`` hook: a checkpoint of ``strategy`` into
    ``out/checkpoints/`` every ``checkpoint-every`` rounds (``pflower.checkpoint``)."""
    every = checkpoint.interval(cfg, grid)
    if not every:
        return evaluate_fn
    keep = cfg.checkpoint_keep
    return checkpoint.Checkpointer(
        cfg, out, strategy, every, keep, evaluate_fn, continuable=continuable(strategy)
    )


def continuable(strategy) -> bool:
    """Whether ``checkpoint.continue_rounds`` can continue ``strategy``: one that runs
    Flower's synchronous round loop (``AsyncFFGG`` runs its own)."""
    return (
        isinstance(strategy, PersonalizedStrategy)
        and type(strategy).start is PersonalizedStrategy.start
    )


def server_evaluation(cfg: Config, strategy, grid: Grid):
    """Server-side metrics after every round (and of the initial model, round 0), kept in
    the strategy's history. For ``synthetic-linear``: ||theta - theta*||^2 and ||F(theta)||^2
    against the closed form (FFGG §3.1, ``task/linear.py``) of the connected clients (counted
    at round 0, after the strategy has waited for them); none otherwise."""
    if cfg.dataset != "synthetic-linear":
        return None
    references: list[linear.Reference] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if linear.THETA not in arrays:  # e.g. theta kept personal: nothing shared to judge
            return None
        if not references:
            num_nodes = len(list(grid.get_node_ids()))
            clients = [
                linear.make_client(
                    m, n=cfg.linear_n, d_theta=cfg.linear_dtheta, d_w=cfg.linear_dw, seed=cfg.seed
                )
                for m in range(num_nodes)
            ]
            references.append(linear.Reference.build(clients))
        metrics = references[0].metrics(arrays[linear.THETA].numpy())
        strategy.record_server_metrics(server_round, metrics)
        return MetricRecord(metrics)

    return evaluate


#: pflower's refusals whose message says it all (key, value and what is allowed; the rounds
#: that applied no reply and why): the run fails with it, and its traceback is noise
# a round that would exceed dp-epsilon (pflower.strategies.privacy); a Flower that has not
# what the adapters need (pflower.flower.FlowerDrift): one line that names it
ONE_LINE_FAILURES = (ConfigError, RunFailed, flower_dp.budget_exhausted(), FlowerDrift)


class OneLineFailures(logging.Filter):
    """Flower logs the exception that ended a ServerApp with its traceback ("ServerApp raised
    an exception", "Simulation raised an exception"), then its exit code. For pflower's own
    refusals (``ONE_LINE_FAILURES``) the ServerApp has already logged the one line that says
    why: this filter on Flower's logger leaves the traceback out of Flower's record. The run
    still ends as failed, with the message as its status details (``pflower run`` prints them
    and exits 1)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ONE_LINE_FAILURES):
            record.exc_info, record.exc_text = None, None
        return True


def one_line_failures() -> None:
    """Install ``OneLineFailures`` on Flower's logger (once per process): Flower logs the
    exception after the ServerApp has returned, so the filter stays."""
    flower = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineFailures) for f in flower.filters):
        flower.addFilter(OneLineFailures())


def build_server_app(
    overrides: Mapping | None = None,
    on_report: Callable[[report.RunReport], None] | None = None,
    out: Path | None = None,
    prepare: Prepare | None = None,
) -> ServerApp:
    """A ServerApp; ``overrides`` are run-config keys applied over ``context.run_config``
    (``flwr.simulation.run_simulation`` passes no run config); ``on_report`` receives the
    run's report (tests and benchmarks read results from it); ``out``: the output directory
    (default: a new one under ``outputs-dir``); ``prepare``: ``run``'s."""
    app = ServerApp()
    one_line_failures()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        # Parse (and so validate) the whole config before any client is contacted. A bad
        # key or value: one line naming key, value and what is allowed, then the run ends
        # as failed with that message (Flower logs the exception after it, without its
        # traceback: OneLineFailures). So does a run that applied no reply (RunFailed).
        run_config = {**context.run_config, **(overrides or {})}
        if run_config.get("console", "compact") == "compact":  # before Ray's tip at its start
            quiet.third_party()
        try:
            cfg = Config.from_run_config(run_config)
            result = run(grid, cfg, out, prepare)  # the split checked before any message
        except ONE_LINE_FAILURES as err:
            log.error("pflower: %s", err)
            raise
        if on_report is not None:
            on_report(result)

    return app


app = build_server_app()
