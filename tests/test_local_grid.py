"""LocalGrid: Flower's Grid API over a ClientApp in this process."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from helpers import OUTPUTS_DIR

from pflower.testbed.local_grid import LocalGrid


def counting_app() -> ClientApp:
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 1:
            raise RuntimeError("broken node")
        calls = context.state.config_records.get("calls", ConfigRecord({"n": 0}))
        calls["n"] = int(calls["n"]) + 1
        context.state.config_records["calls"] = calls
        metrics = {"pid": context.node_config["partition-id"], "n": calls["n"]}
        return Message(RecordDict({"m": MetricRecord(metrics)}), reply_to=msg)

    return app


def test_replies_errors_and_persistent_node_state(task_identity):
    grid = LocalGrid(counting_app(), 3, node_configs={2: {"state-dir": "/x"}})
    nodes = list(grid.get_node_ids())
    assert len(set(nodes)) == 3 and sorted(nodes) != [0, 1, 2]  # random ids, as on a SuperLink
    by_pid = {grid.contexts[n].node_config["partition-id"]: n for n in nodes}
    assert grid.contexts[by_pid[2]].node_config["state-dir"] == "/x"
    for expected in (1, 2):
        messages = [
            Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in nodes
        ]
        replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(messages)}
        assert set(replies) == set(nodes)
        sent = {m.metadata.message_id for m in messages}
        assert {r.metadata.reply_to_message_id for r in replies.values()} == sent
        assert replies[by_pid[1]].has_error()
        assert "broken node" in replies[by_pid[1]].error.reason
        for pid in (0, 2):
            reply = replies[by_pid[pid]]
            assert reply.content["m"]["pid"] == pid and reply.content["m"]["n"] == expected
    assert grid.pull_messages(["unknown"]) == []


def test_threaded_clients_draw_what_they_draw_alone():
    """FFGG re-draws the personal part from each message's seed with the layers' own
    initialisation (torch's global generator): clients run side by side in threads
    (``LocalGrid(workers=2)``) must give exactly the run with one thread."""
    import numpy as np

    from pflower.testbed.local_grid import run_local

    run = {
        "algorithm": "ffgg",
        "dataset": "digits",
        "partitioner": "iid",
        "num-server-rounds": 3,
        "evaluate-every": 3,
        "fraction-train": 1.0,
        "finetune-epochs": 1,
        "outputs-dir": OUTPUTS_DIR,
    }
    alone = run_local(run, 4)
    for _ in range(2):
        threaded = run_local(run, 4, workers=2)
        assert all(np.array_equal(alone.shared[k], threaded.shared[k]) for k in alone.shared)
        assert threaded.final["personal-accuracy"] == alone.final["personal-accuracy"]


def test_client_loaders_never_draw_from_torchs_global_generator():
    """A pass over a client's loaders leaves torch's global generator alone: it is another
    thread's stream while that thread re-initialises layers (``ClientJob.global_rng``)."""
    import torch

    from pflower.client_app import parse_config
    from pflower.task.data import load_client_data

    cfg = parse_config(frozenset({"dataset": "digits", "partitioner": "iid"}.items()))
    train_loader, test_loader = load_client_data(cfg, 0, 4)
    before = torch.get_rng_state()
    for loader in (train_loader, test_loader):
        for _ in loader:
            pass
    assert torch.equal(before, torch.get_rng_state())


def test_a_clients_kept_loaders_shuffle_as_fresh_ones_and_are_its_threads_own():
    """The ClientApp keeps a client's loaders between messages (``_thread_loaders``): each
    message's batches are those a fresh loader seeded for that message draws, whatever the
    messages before drew, and another thread gets loaders of its own."""
    import threading

    import torch
    from helpers import node_context

    from pflower.client_app import make_job, parse_config
    from pflower.task.data import load_client_data
    from pflower.task.data.loaders import one_pass

    cfg = parse_config(frozenset({"dataset": "digits", "partitioner": "iid"}.items()))

    def batches(loader):
        return [y.tolist() for _, y in one_pass(loader)]

    first = make_job(cfg, node_context(1), 3)
    batches(first.train_loader)  # a pass that moves the kept loader's generator on
    again = make_job(cfg, node_context(1), 3)
    assert again.train_loader is first.train_loader
    fresh, _ = load_client_data(cfg, 1, 4, torch.float32)
    fresh.generator.manual_seed(again.train_loader.generator.initial_seed())
    assert batches(again.train_loader) == batches(fresh)
    assert batches(make_job(cfg, node_context(1), 4).train_loader) != batches(fresh)
    other = []
    thread = threading.Thread(target=lambda: other.append(make_job(cfg, node_context(1), 3)))
    thread.start()
    thread.join()
    assert other[0].train_loader is not first.train_loader
    assert batches(other[0].train_loader) == batches(make_job(cfg, node_context(1), 3).train_loader)
