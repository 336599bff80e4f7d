"""Node discovery and seeded sampling, the part of a strategy that knows which clients
exist: wait for the federation to settle, learn each node's partition id (and training-set
size) once, sample uniformly **without replacement** from a seeded generator over the nodes
in partition-id order (node ids are random per run), and keep hold-out clients out of
training. ``PersonalizedStrategy`` mixes it in; it expects ``rng``, ``min_available_nodes``,
``holdout_fraction``, ``partition_of``, ``num_train_of`` and ``query_num_train``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pflower.wire import CONFIG, METRICS, QUERY

# A child of Flower's logger, so our records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


class RoundDeadline:
    """A ``Grid`` whose exchanges without an explicit timeout wait as long as the work
    needs: ``first`` seconds for the first (start-up, data loading), then ``factor`` times the
    slowest complete exchange so far, at least ``floor`` seconds. A node that died then costs
    a round about ten times its normal length, not an hour. Everything else is the grid's."""

    def __init__(
        self, grid: Grid, first: float = 600.0, factor: float = 10.0, floor: float = 120.0
    ) -> None:
        self.grid, self.first, self.factor, self.floor = grid, first, factor, floor
        self.slowest: float | None = None

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    @property
    def limit(self) -> float:
        if self.slowest is None:
            return self.first
        return max(self.floor, self.factor * self.slowest)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        messages = list(messages)
        if timeout is not None:
            return self.grid.send_and_receive(messages, timeout=timeout)
        started = time.monotonic()
        replies = list(self.grid.send_and_receive(messages, timeout=self.limit))
        if messages and len(replies) == len(messages):  # a complete exchange: its length
            self.slowest = max(self.slowest or 0.0, time.monotonic() - started)
        return replies


class NodeSampling:
    """Which nodes exist, which partition each holds, and who is sampled each round."""

    def wait_for_nodes(self, grid: Grid, timeout: float, settle: float = 1.0) -> list[int]:
        """The connected nodes once at least ``min_available_nodes`` are and the set has not
        changed for ``settle`` seconds (or ``timeout`` has passed)."""
        deadline = time.monotonic() + timeout
        nodes, since = sorted(grid.get_node_ids()), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = sorted(grid.get_node_ids())
            if now != nodes:
                nodes, since = now, time.monotonic()
            elif len(nodes) >= self.min_available_nodes and time.monotonic() - since >= settle:
                break
        return nodes

    def learn_partitions(self, grid: Grid, timeout: float = 60.0) -> None:
        """Ask every node for its ``partition-id`` (a ``query`` message), once; with
        ``query_num_train`` also for its number of training examples (PFLEGO's alpha).

        Node ids are random in each run; ordering nodes by partition id makes the seeded
        sample the same clients in every run. A node that does not answer is ordered after
        the others by its node id. Waits first until the set of connected nodes has been
        stable for ``settle`` seconds (nodes of a simulation or a federation register over a
        moment; asking too early would leave some unordered).
        """
        nodes = self.wait_for_nodes(grid, timeout)
        question = "partition-id,num-train" if self.query_num_train else "partition-id"
        content = RecordDict({CONFIG: ConfigRecord({QUERY: question})})
        messages = [
            Message(content=content, message_type=MessageType.QUERY, dst_node_id=n) for n in nodes
        ]
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error() or METRICS not in reply.content:
                continue
            pid = reply.content[METRICS].get("partition-id")
            if isinstance(pid, (int, float)):
                self.partition_of[reply.metadata.src_node_id] = int(pid)
            size = reply.content[METRICS].get("num-train")
            if isinstance(size, (int, float)) and size > 0:
                self.num_train_of[reply.metadata.src_node_id] = int(size)

    def _ordered(self, nodes: Iterable[int]) -> list[int]:
        unknown = 1 << 62
        return sorted(nodes, key=lambda n: (self.partition_of.get(n, unknown), n))

    def sample(
        self, grid: Grid, fraction: float, everyone: bool = False, train: bool = False
    ) -> list[int]:
        """Uniform sample without replacement of ``max(1, round(fraction * N))`` nodes,
        drawn over the nodes in partition-id order (see ``learn_partitions``)."""
        nodes = self._ordered(grid.get_node_ids())
        while len(nodes) < self.min_available_nodes:
            log.info("waiting for nodes: %d of %d connected", len(nodes), self.min_available_nodes)
            time.sleep(1)
            nodes = self._ordered(grid.get_node_ids())
        if everyone:
            return nodes
        if train and self.holdout_fraction:  # held-out partitions never train
            held = self.held_out(nodes)
            nodes = [n for n in nodes if n not in held]
        return self._ordered(self.rng.sample(nodes, max(1, round(fraction * len(nodes)))))

    def held_out(self, nodes: Sequence[int]) -> set[int]:
        """The nodes whose partition id is among the top ``holdout_fraction`` of the ids."""
        num = len(nodes)
        cutoff = num - round(self.holdout_fraction * num)
        return {n for n in nodes if self.partition_of.get(n, -1) >= cutoff}
