"""Helpers shared by the algorithm tests: a client job on a small offline data set."""

from __future__ import annotations

from flwr.app import Context, RecordDict

from pflower.client_app import make_job, parse_config
from pflower.strategies.base import ClientJob

BASE = {
    "dataset": "digits",
    "model": "mlp",
    "split": "head",
    "batch-size": 32,
    "finetune-epochs": 1,
    "partitioner": "iid",
}


def job_for(overrides, partition_id=0, state=None, server_round=1) -> ClientJob:
    """The ClientJob the ClientApp would build for ``partition_id`` of 4 (digits, MLP)."""
    cfg = parse_config(frozenset({**BASE, **overrides}.items()))
    context = Context(
        run_id=1,
        node_id=partition_id + 1,
        state=state or RecordDict(),
        node_config={"partition-id": partition_id, "num-partitions": 4},
        run_config={},
    )
    return make_job(cfg, context, server_round)
