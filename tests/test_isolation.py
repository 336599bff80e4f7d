"""Two clients served by the same process never see each other's personal values.

The ClientApp keeps one model per thread and config and overwrites it with every message; a
client half that failed to overwrite its personal part (e.g. FFGG not re-drawing w, or a
stateful algorithm not loading its own state) would start from the previous client's
values. For every algorithm: client B's replies after client A was served in the same
process equal B's replies in a fresh process, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from pflower import client_app
from pflower.config import Config
from pflower.strategies import ALGORITHMS, build_run_model, wire_split
from pflower.task.split import get_tensors

BASE = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "batch-size": 64,
    "finetune-epochs": 1,
    "local-steps": 3,
    "personal-steps": 2,
}
RUN_EXTRA = {
    "l2gd": {"fraction-train": 1.0},
    "br-ffgg": {"robust-aggregator": "median"},
    "pflego": {"model": "pflego-mlp"},
}
ROUND_EXTRA = {
    "l2gd": {"l2gd-mix": 0.5, "l2gd-steps": 2},
    "pflego": {"pflego-head-lr": 0.1},
    "apfl": {"apfl-round": 2},
}


def fresh_process() -> None:
    """Forget every model and config the ClientApp cached (what a new process has)."""
    client_app._thread_model.cache_clear()
    client_app.parse_config.cache_clear()
    client_app._thread_loaders.cache_clear()


def messages(algorithm, overrides):
    cfg = Config.from_run_config(overrides)
    model = build_run_model(cfg)
    shared = ArrayRecord(get_tensors(model, wire_split(model, cfg).shared))
    out = []
    for kind in (MessageType.TRAIN, MessageType.EVALUATE):
        config = {
            "server-round": 2,
            "lr": 0.05,
            "lr-scale": 1.0,
            "phase": "train",
            **ROUND_EXTRA.get(algorithm, {}),
        }
        content = RecordDict({"arrays": shared, "config": ConfigRecord(config)})
        if algorithm == "scaffold" and kind == MessageType.TRAIN:
            content["control"] = ArrayRecord(
                {k: Array(np.full_like(a.numpy(), 0.01)) for k, a in shared.items()}
            )
        out.append((kind, content))
    return out


def serve(app, content, kind, pid, state):
    context = Context(
        run_id=1,
        node_id=pid + 1,
        state=state,
        node_config={"partition-id": pid, "num-partitions": 4},
        run_config={},
    )
    reply = app(Message(content=content, dst_node_id=pid + 1, message_type=kind), context)
    assert not reply.has_error(), reply.error.reason
    arrays = {
        k: {n: a.numpy().copy() for n, a in r.items()}
        for k, r in reply.content.array_records.items()
    }
    return arrays, dict(reply.content["metrics"])


def session(app, msgs, pid, state):
    """A train then an evaluate message for one client."""
    return [serve(app, content, kind, pid, state) for kind, content in msgs]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_client_served_after_another_gets_what_it_gets_alone(task_identity, algorithm):
    overrides = {**BASE, "algorithm": algorithm, **RUN_EXTRA.get(algorithm, {})}
    msgs = messages(algorithm, overrides)
    app = client_app.build_client_app(overrides)

    fresh_process()
    alone = session(app, msgs, pid=1, state=RecordDict())
    fresh_process()
    session(app, msgs, pid=0, state=RecordDict())  # client A, then B in the same process
    after = session(app, msgs, pid=1, state=RecordDict())

    for (arrays_a, metrics_a), (arrays_b, metrics_b) in zip(alone, after):
        assert arrays_a.keys() == arrays_b.keys()
        for key in arrays_a:
            for name in arrays_a[key]:
                np.testing.assert_array_equal(arrays_a[key][name], arrays_b[key][name])
        assert metrics_a == metrics_b
