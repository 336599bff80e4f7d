"""Helpers shared by the algorithm tests: a client job on a small offline data set."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from flwr.app import Context, Message, RecordDict

from pflower.client_app import build_client_app, make_job, parse_config
from pflower.strategies.client import ClientJob

# Where the runs of this test process write their outputs: a directory of its own, removed when
# the process ends (a fixed /tmp path shared by every run grew to 1.3 GB over a session's suites)
OUTPUTS_DIR = tempfile.mkdtemp(prefix="pflower-test-outputs-")
_OWNER = os.getpid()


@atexit.register
def _remove_outputs() -> None:
    if os.getpid() == _OWNER:  # not in a forked child that inherited the hook
        shutil.rmtree(OUTPUTS_DIR, ignore_errors=True)


BASE = {
    "dataset": "digits",
    "model": "mlp",
    "split": "head",
    "batch-size": 32,
    "finetune-epochs": 1,
    "partitioner": "iid",
}


def node_context(partition_id=0, state=None) -> Context:
    """The Flower context of the node holding ``partition_id`` of 4."""
    return Context(
        run_id=1,
        node_id=partition_id + 1,
        state=RecordDict() if state is None else state,
        node_config={"partition-id": partition_id, "num-partitions": 4},
        run_config={},
    )


def job_for(overrides, partition_id=0, state=None, server_round=1) -> ClientJob:
    """The ClientJob the ClientApp would build for ``partition_id`` of 4 (digits, MLP)."""
    cfg = parse_config(frozenset({**BASE, **overrides}.items()))
    return make_job(cfg, node_context(partition_id, state), server_round)


def corrupting_app(overrides, partitions, value: float):
    """pflower's ClientApp, except that the nodes of ``partitions`` reply to training with
    ``value`` in every entry of their arrays (a broken or Byzantine client)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord
    from flwr.clientapp import ClientApp

    honest = build_client_app(overrides)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if context.node_config["partition-id"] in partitions:
            record = reply.content["arrays"]
            reply.content["arrays"] = ArrayRecord(
                {k: Array(np.full_like(a.numpy(), value)) for k, a in record.items()}
            )
        return reply

    return answer_the_rest(app, honest)


def answer_the_rest(app, honest):
    """``app`` (a ClientApp that changes only training replies) with its evaluate and query
    messages answered by ``honest``, pflower's own ClientApp; returns ``app``."""

    @app.evaluate()
    def evaluate(msg, context):
        return honest(msg, context)

    @app.query()
    def query(msg, context):
        return honest(msg, context)

    return app


def recording(overrides, seen: dict, received: list):
    """pflower's ClientApp, recording which partitions train in which round (``seen``) and
    every value a client receives: its run and node config, each message's config."""
    honest = build_client_app(overrides)

    def app(msg: Message, context: Context) -> Message:
        received.extend(context.run_config.values())
        received.extend(context.node_config.values())
        received.extend(overrides.values())  # what run_local's ClientApp runs with
        if "config" in msg.content:
            received.extend(msg.content["config"].values())
        if msg.metadata.message_type == "train":
            r = int(msg.content["config"]["server-round"])
            seen.setdefault(r, set()).add(int(context.node_config["partition-id"]))
        return honest(msg, context)

    return app


def pairings(items):
    """Every way to split ``items`` (an even count) into pairs: the buckets of 2 a round of
    them can draw (the reference that replays bucketing without its permutation)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for i, other in enumerate(rest):
        for tail in pairings(rest[:i] + rest[i + 1 :]):
            yield [(first, other), *tail]
