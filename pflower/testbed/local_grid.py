"""A Flower ``Grid`` that hands every message to a ClientApp in this process, one at a time.

Flower's simulation engine (``flwr run .``, ``run_simulation``) is the way to run pflower. It
spends a fixed ~0.1 s polling per ``send_and_receive`` and a Ray hop per message, which
dominates problems whose clients compute for a millisecond: the thousands of rounds of
Mishchenko et al.'s synthetic experiments. ``LocalGrid`` removes the transport and keeps
everything else: the same strategy objects (``Strategy.start``), the same ``ClientApp``
(called as Flower calls it, ``app(message, context)``), one ``Context`` per node that persists
across rounds (``context.state`` is the node's store), message ids and ``reply_to``. A
ClientApp that raises produces an error reply, as in Flower. ``tests/test_local_grid.py``
checks that a run on it equals the same run on the simulation engine.

With ``workers`` > 0 the ClientApp calls run in that many threads and ``push_messages``
returns at once (replies come back as ``pull_messages`` finds them done), as a SuperLink
does: what an asynchronous server (``AsyncFFGG``) and straggler experiments (a node config
``delay-s``, with the experiment ClientApp of ``pflower.testbed.client_app``) need.
``silent`` nodes never answer (a device that died).

Used by the benchmarks and tests; not a deployment path.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from pflower.flower import local as flower_local


class LocalGrid(Grid):
    """``num_nodes`` nodes in this process, node i with ``partition-id = i``.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        Number of nodes (and partitions).
    run_config : mapping (default: empty)
        ``context.run_config`` of every node.
    node_configs : mapping of int to mapping (default: none)
        Extra node-config entries per partition id (e.g. ``state-dir``).
    seed : int (default: 0)
        Seed of the node ids (random, as on a SuperLink, so that nothing may rely on them).
    workers : int (default: 0)
        0: each message runs when pushed. > 0: messages run in that many threads.
    silent : iterable of int (default: none)
        Partition ids whose nodes never reply.
    """

    #: what ``pflower.flower.grids.engine_of`` reports: an in-process engine
    ENGINE = "local"

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: Mapping | None = None,
        node_configs: Mapping[int, Mapping] | None = None,
        seed: int = 0,
        run_id: int = 1,
        workers: int = 0,
        silent: Iterable[int] = (),
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes = {num_nodes}: must be >= 1")
        self.app = client_app
        self.run_id = run_id
        ids = random.Random(seed).sample(range(1, 1 << 62), num_nodes)
        self.contexts: dict[int, Context] = {
            node: Context(
                run_id=run_id,
                node_id=node,
                node_config={
                    "partition-id": i,
                    "num-partitions": num_nodes,
                    **dict((node_configs or {}).get(i, {})),
                },
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i, node in enumerate(ids)
        }
        self._replies: dict[str, Message | Future] = {}
        self.client_seconds: dict[int, float] = {}  # compute time per node, summed
        self.silent = {
            node
            for node, c in self.contexts.items()
            if c.node_config["partition-id"] in set(silent)
        }
        self._pool = ThreadPoolExecutor(workers) if workers > 0 else None
        self._lock = threading.Lock()
        self._node_locks = {node: threading.Lock() for node in self.contexts}
        # messages need a task identity (the SuperLink's) on flwr >= 1.38
        flower_local.ensure_task_identity(run_id)
        self._unavailable, self._raised = flower_local.error_codes()

    # --- Grid API --------------------------------------------------------------------------
    def set_run(self, run) -> None:
        self.run_id = run.run_id

    @property
    def run(self):
        return flower_local.empty_run(self.run_id)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message's ClientApp now (or hand it to a worker thread); its reply waits
        for ``pull_messages``."""
        ids = []
        for msg in messages:
            msg_id = str(uuid4())
            flower_local.stamp_message_id(msg, msg_id)
            ids.append(msg_id)
            if msg.metadata.dst_node_id in self.silent:
                continue
            if self._pool is None:
                self._replies[msg_id] = self._deliver(msg)
            else:
                self._replies[msg_id] = self._pool.submit(self._deliver, msg)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = []
        for i in list(message_ids):
            reply = self._replies.get(i)
            if reply is None or (isinstance(reply, Future) and not reply.done()):
                continue
            del self._replies[i]
            out.append(reply.result() if isinstance(reply, Future) else reply)
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout=None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        pending = [self._replies[i] for i in ids if isinstance(self._replies.get(i), Future)]
        wait(pending, timeout=timeout)  # as Flower: what has not come back by then is missing
        return self.pull_messages(ids)

    # --- delivery --------------------------------------------------------------------------
    def _deliver(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        context = self.contexts.get(node)
        if context is None:
            return Message(Error(self._unavailable, f"no node {node}"), reply_to=msg)
        start = time.perf_counter()
        try:
            with self._node_locks[node]:  # a node handles one message at a time
                reply = self.app(msg, context)
        except Exception as err:  # Flower turns a raising ClientApp into an error reply
            reply = Message(
                Error(self._raised, f"{type(err).__name__}: {err}"),
                reply_to=msg,
            )
        with self._lock:
            self.client_seconds[node] = self.client_seconds.get(node, 0.0) + (
                time.perf_counter() - start
            )
        return reply


def run_local(
    overrides: Mapping,
    num_nodes: int,
    client_app: ClientApp | None = None,
    out: Path | None = None,
    **kwargs,
):
    """Run the config ``overrides`` on a ``LocalGrid``: the ServerApp's ``run``, with the testbed's
    stages attached (``server_app.attach``), and the experiment ClientApp
    (``pflower.testbed.client_app``: the production app, with the Byzantine and straggler behaviour
    that ``node_configs`` and the ``straggler-*`` keys ask for) or ``client_app``, its outputs into
    ``out`` (default: a new directory under ``outputs-dir``). Returns the ``RunReport``."""
    from pflower.config import Config
    from pflower.server_app import run
    from pflower.testbed.client_app import experiment_client_app
    from pflower.testbed.server_app import attach

    cfg = Config.from_run_config(dict(overrides))
    app = client_app or experiment_client_app(overrides)
    return run(LocalGrid(app, num_nodes, seed=cfg.seed, **kwargs), cfg, out, prepare=attach)
