"""The ClientApp: message -> ClientJob (model, split, data, personal state) -> client half -> reply.

Node config (set per SuperNode; the simulation engine sets the first two itself):
``partition-id`` and ``num-partitions`` choose this client's data; ``state-dir`` (optional)
keeps personal state in a directory on the device instead of ``context.state``;
``byzantine`` (optional, for robustness experiments) makes the node attack
(``pflower/experiments/attacks.py``); ``delay-s`` (optional, for straggler experiments)
makes it wait that many seconds before each training reply
(``pflower/experiments/stragglers.py``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping

import torch
from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pflower.config import Config
from pflower.context_store import open_store, scope_job
from pflower.experiments import attacks
from pflower.experiments.stragglers import straggler_delay
from pflower.strategies import build_run_model, get_algorithm, wire_split
from pflower.strategies.client import ClientJob, measured
from pflower.task.data import load_client_data
from pflower.task.models import GLOBAL_RNG
from pflower.task.node_data import DATA_PATH
from pflower.task.split import Split, get_tensors
from pflower.task.train import resolve_device
from pflower.wire import (
    ARRAYS,
    CONFIG,
    METRICS,
    QUERY,
    SERVER_ROUND,
)


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
    train_loader, test_loader = load_client_data(
        cfg, partition_id, num_partitions, dtype, node.get(DATA_PATH)
    )
    # Reproducible whatever process runs this client: seed by (seed, client, round).
    salt = (cfg.seed * 1_000_003 + partition_id * 10_007 + server_round) % 2**63
    with GLOBAL_RNG:  # never inside another thread's stream (ClientJob.global_rng)
        torch.manual_seed(salt)  # for a user's model that draws from the global generator
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


def build_client_app(overrides: Mapping | None = None) -> ClientApp:
    """A ClientApp; ``overrides`` are run-config keys applied over ``context.run_config``
    (``flwr.simulation.run_simulation`` passes no run config, so tests and benchmarks do)."""
    app = ClientApp()

    def setup(msg: Message, context: Context) -> tuple[Config, ClientJob, Mapping]:
        cfg = parse_config(frozenset({**context.run_config, **(overrides or {})}.items()))
        config = dict(msg.content[CONFIG])
        job = make_job(cfg, context, int(config.get(SERVER_ROUND, 0)))
        job.receive(msg.content.array_records, config)
        # the state this message may start from: this run's scope, written before its round
        scope_job(job, config, training=msg.metadata.message_type == MessageType.TRAIN)
        return cfg, job, config

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg, job, config = setup(msg, context)
        half = get_algorithm(cfg.algorithm).client
        # robustness experiments: a Byzantine node (node config ``byzantine``) attacks
        tag = attacks.before_training(job, context.node_config, cfg)
        records, key, metrics = half.reply(job, config)
        seed = job.partition_id * 7919 + int(config.get(SERVER_ROUND, 0))
        records = attacks.after_training(
            records, key, msg.content[ARRAYS], context.node_config, seed
        )
        delay = straggler_delay(cfg, context.node_config)
        if delay:
            time.sleep(delay)
        content = RecordDict({**records, METRICS: MetricRecord(measured({**metrics, **tag}))})
        return Message(content=content, reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """Answers the strategy's start-up question: which partition is this node (and how
        many training examples does it hold)?"""
        pid = context.node_config.get("partition-id")
        answer = {"partition-id": int(pid)} if pid is not None else {}
        asked = str(msg.content[CONFIG].get(QUERY, "")).split(",") if CONFIG in msg.content else []
        if "num-train" in asked:
            cfg = parse_config(frozenset({**context.run_config, **(overrides or {})}.items()))
            node = context.node_config
            train, _ = load_client_data(
                cfg, int(pid), int(node["num-partitions"]), data_path=node.get(DATA_PATH)
            )
            answer["num-train"] = len(train.dataset)
        metrics = MetricRecord(answer)
        return Message(content=RecordDict({METRICS: metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        cfg, job, config = setup(msg, context)
        metrics = measured(get_algorithm(cfg.algorithm).client.evaluate(job, config))
        return Message(content=RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)

    return app


app = build_client_app()
