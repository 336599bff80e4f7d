"""The ClientApp: message -> ClientJob (model, split, data, personal state) -> client half -> reply.

Node config (set per SuperNode; the simulation engine sets the first two itself):
``partition-id`` and ``num-partitions`` choose this client's data; ``data-path`` is the node's
own data file (``dataset = "node"``); ``state-dir`` (optional) keeps personal state in a
directory on the device instead of ``context.state``.

This is what a device runs, and only that: Byzantine clients and straggler delays attach from
outside (``pflower.testbed.client_app`` wraps the training step of this very app), and
this module imports nothing under ``pflower.testbed``. A node whose node config or run
config asks for experiment behaviour (``byzantine``, ``delay-s``, ``straggler-delay-s``) is
refused here rather than silently honest or punctual.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pflower import quiet
from pflower.config import Config
from pflower.context_store import open_store, scope_job
from pflower.strategies import build_run_model, get_algorithm, wire_split
from pflower.strategies.client import ClientJob, answer_query, measured
from pflower.task.data import load_client_data
from pflower.task.fingerprint import data_kind
from pflower.task.models import GLOBAL_RNG
from pflower.task.node_data import DATA_PATH
from pflower.task.split import Split, get_tensors
from pflower.task.train import resolve_device
from pflower.wire import CONFIG, METRICS, SERVER_ROUND

#: a training step: (job, config record) -> (reply records, the key of the update's record,
#: metrics); the algorithm's client half's ``reply``
TrainStep = Callable[[ClientJob, Mapping], tuple[dict[str, ArrayRecord], str, Mapping]]
#: runs a training step around the production one, as a Flower mod runs around a ClientApp
#: (but with the job, which a mod never sees): (msg, context, job, config, train) -> its result
WrapTrain = Callable[[Message, Context, ClientJob, Mapping, TrainStep], tuple]
#: an evaluation step: (job, config record) -> metrics; the client half's ``evaluate``
EvaluateStep = Callable[[ClientJob, Mapping], Mapping]
#: runs an evaluation step around the production one: (msg, context, job, config, evaluate)
#: -> its metrics
WrapEvaluate = Callable[[Message, Context, ClientJob, Mapping, EvaluateStep], Mapping]
#: node-config keys of experiment behaviour: only ``pflower.testbed.client_app`` acts on them
EXPERIMENT_NODE_KEYS = ("byzantine", "delay-s", "backdoor-target")


@functools.lru_cache(maxsize=8)
def parse_config(items: frozenset) -> Config:
    return Config.from_run_config(dict(items))


def _model(cfg: Config) -> tuple[torch.nn.Module, Split, dict, torch.device]:
    return _thread_model(cfg, threading.get_ident())


@functools.lru_cache(maxsize=32)
def _thread_model(cfg: Config, thread: int) -> tuple[torch.nn.Module, Split, dict, torch.device]:
    """One model per thread and config (every message overwrites all of its parameters); per
    thread so that ``LocalGrid(workers=...)`` can run clients side by side."""
    device = resolve_device(cfg.device)
    model = build_run_model(cfg).to(device)
    split = wire_split(model, cfg)
    return model, split, get_tensors(model, split.personal), device


#: clients whose loaders each thread keeps (views of the data cache's arrays, not copies)
LOADERS_KEPT = 256


@functools.lru_cache(maxsize=LOADERS_KEPT)
def _thread_loaders(cfg: Config, partition_id: int, num_partitions: int, dtype, data_path, thread):
    """A client's train and test loaders, built once per thread (``load_client_data``: two
    datasets and two DataLoaders, ~40 us a message). Every message reseeds the
    train loader's generator (``make_job``), so a kept loader shuffles as a fresh one would;
    the test loader is not shuffled. Per thread: two clients never share a generator."""
    return load_client_data(cfg, partition_id, num_partitions, dtype, data_path)


def make_job(cfg: Config, context: Context, server_round: int) -> ClientJob:
    node = context.node_config
    try:
        partition_id, num_partitions = int(node["partition-id"]), int(node["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node config lacks {err.args[0]!r}: start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'"
        ) from None
    model, split, init_personal, device = _model(cfg)
    dtype = next(model.parameters()).dtype  # data in the model's precision (float64 models)
    train_loader, test_loader = _thread_loaders(
        cfg, partition_id, num_partitions, dtype, node.get(DATA_PATH), threading.get_ident()
    )
    # Reproducible whatever process runs this client: seed by (seed, client, round).
    salt = (cfg.seed * 1_000_003 + partition_id * 10_007 + server_round) % 2**63
    with GLOBAL_RNG:  # never inside another thread's stream (ClientJob.global_rng)
        # for a user's model that draws from the global generator. On the CPU only the CPU
        # generator: torch.manual_seed also queues lazy seeding of CUDA, XPU and MTIA, each
        # capturing a stack trace, ~1 ms per message where no such device is in use
        if device.type == "cpu":
            torch.default_generator.manual_seed(salt)
        else:
            torch.manual_seed(salt)
    train_loader.generator.manual_seed(salt)
    return ClientJob(
        cfg=cfg,
        partition_id=partition_id,
        num_partitions=num_partitions,
        model=model,
        split=split,
        train_loader=train_loader,
        test_loader=test_loader,
        store=open_store(context.state, node),
        device=device,
        init_personal={k: v.clone() for k, v in init_personal.items()},
        rng_state=torch.Generator().manual_seed(salt).get_state(),
    )


def build_client_app(
    overrides: Mapping | None = None,
    *,
    wrap_train: WrapTrain | None = None,
    wrap_evaluate: WrapEvaluate | None = None,
) -> ClientApp:
    """A ClientApp; ``overrides`` are run-config keys applied over ``context.run_config``
    (``flwr.simulation.run_simulation`` passes no run config, so tests and benchmarks do).

    ``wrap_train`` (optional) runs each training step in place of the client half's
    ``reply``, which it receives as ``train``: the experiment ClientApp
    (``pflower.testbed.client_app``) attaches Byzantine behaviour and straggler delays
    this way. Without it, a node configured for experiment behaviour is refused.
    ``wrap_evaluate`` (optional) likewise runs each evaluation step in place of the half's
    ``evaluate`` (the testbed's backdoor probe)."""
    app = ClientApp()

    def run_config(context: Context) -> Config:
        cfg = parse_config(frozenset({**context.run_config, **(overrides or {})}.items()))
        if cfg.console == "compact":  # before the data set's warnings (pflower.quiet)
            quiet.third_party()
        return cfg

    def setup(msg: Message, context: Context) -> tuple[Config, ClientJob, Mapping]:
        cfg = run_config(context)
        config = dict(msg.content[CONFIG])
        job = make_job(cfg, context, int(config.get(SERVER_ROUND, 0)))
        job.receive(msg.content.array_records, config)
        # the state this message may start from: this run's scope, written before its round
        scope_job(job, config, training=msg.metadata.message_type == MessageType.TRAIN)
        return cfg, job, config

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg, job, config = setup(msg, context)
        step = get_algorithm(cfg.algorithm).client.reply
        if wrap_train is None:
            refuse_experiment_keys(cfg, context.node_config)
            records, _, metrics = step(job, config)
        else:
            records, _, metrics = wrap_train(msg, context, job, config, step)
        content = RecordDict({**records, METRICS: MetricRecord(measured(metrics))})
        return Message(content=content, reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """Answers the strategy's start-up question: which partition is this node, of how
        many, what data and model does it run (and how many training examples does it
        hold)?"""
        cfg = run_config(context)
        node = context.node_config

        def num_train() -> int:
            train, _ = load_client_data(
                cfg,
                int(node["partition-id"]),
                int(node["num-partitions"]),
                data_path=node.get(DATA_PATH),
            )
            return len(train.dataset)

        data = data_kind(cfg.dataset, node.get(DATA_PATH))
        return answer_query(msg, node, data, lambda: _model(cfg)[0], num_train)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        cfg, job, config = setup(msg, context)
        step = get_algorithm(cfg.algorithm).client.evaluate
        if wrap_evaluate is None:
            metrics = measured(step(job, config))
        else:
            metrics = measured(wrap_evaluate(msg, context, job, config, step))
        return Message(content=RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)

    return app


def refuse_experiment_keys(cfg: Config, node_config: Mapping) -> None:
    """Refuse experiment behaviour this app does not carry: a Byzantine node or a straggler
    that silently behaved as an honest, punctual one would make an experiment's table lie."""
    asked = [
        f"node config {k!r} = {node_config[k]!r}" for k in EXPERIMENT_NODE_KEYS if k in node_config
    ]
    if cfg.straggler_delay_s:
        asked.append(f"run config 'straggler-delay-s' = {cfg.straggler_delay_s}")
    if asked:
        raise ValueError(
            f"{'; '.join(asked)}: experiment behaviour, which the production ClientApp "
            "(pflower.client_app:app) does not carry; run the experiment ClientApp "
            "(clientapp = 'pflower.testbed.client_app:app', or "
            "pflower.testbed.client_app.experiment_client_app)"
        )


app = build_client_app()
