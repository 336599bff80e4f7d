"""Node discovery and seeded sampling, the part of a strategy that knows which clients
exist: wait for the federation to settle, learn each node's partition id (and training-set
size) once, sample uniformly **without replacement** from a seeded generator over the nodes
in partition-id order (node ids are random per run), and keep hold-out clients out of
training. ``PersonalizedStrategy`` mixes it in; it expects ``rng``, ``min_available_nodes``,
``holdout_fraction``, ``partition_of``, ``num_train_of`` and ``query_num_train``."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pflower.flower_dispatch import index_message_dispatch
from pflower.flower_waits import cap_pull_backoff
from pflower.wire import CONFIG, METRICS, QUERY

# A child of Flower's logger, so our records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


class RoundDeadline:
    """A ``Grid`` whose exchanges without an explicit timeout wait as long as the work
    needs: ``first`` seconds for the first (start-up, data loading), then ``factor`` times the
    slowest complete exchange so far, at least ``floor`` seconds. A node that died then costs
    a round about ten times its normal length, not an hour. Everything else is the grid's.

    An exchange's length is its slowest reply's, but at most ``spread`` times its *lower
    median* reply's (the ceil(N/2)-th to arrive, over a grid that times its replies:
    ``Window.arrivals``), and an exchange of one message after the first lengthens nothing.
    So a client that answers just before the deadline cannot stretch it: it made the next
    deadline ten times as long, round after round; now, while at most floor(N/2) of an
    exchange's replies are its, the deadline stays within ``factor x spread`` times an
    honest reply's time (an honest straggler up to ``spread`` times the median is waited
    for in full). Flower's engines (simulation, deployment) always run through a
    ``Window``; pflower's in-process ``LocalGrid``, whose clients are this process's own
    code, answers for its silent nodes at once and is timed by the exchange."""

    def __init__(
        self,
        grid: Grid,
        first: float = 600.0,
        factor: float = 10.0,
        floor: float = 120.0,
        spread: float = 10.0,
    ) -> None:
        self.grid, self.first, self.factor, self.floor = grid, first, factor, floor
        self.spread = spread
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
        complete = bool(messages) and len(replies) == len(messages)
        if complete and (len(messages) > 1 or self.slowest is None):
            arrivals = sorted(getattr(self.grid, "arrivals", None) or [])
            if len(arrivals) != len(replies):  # a grid that does not time its replies
                arrivals = [time.monotonic() - started]
            median = arrivals[math.ceil(len(arrivals) / 2) - 1]
            length = min(arrivals[-1], self.spread * median)
            self.slowest = max(self.slowest or 0.0, length)
        return replies


class Window:
    """A ``Grid`` that keeps at most ``size`` messages outstanding (``None``: no limit) and
    pulls replies every ``pull_interval`` seconds: ``send_and_receive`` pushes the first
    ``size``, then one more for each reply pulled, until all are answered or ``timeout`` has
    passed (as Flower's, which pushes them all at once).

    Why: Flower 1.41's simulation engine hands messages to its workers by scanning, every
    0.1 s and for every node, every stored message (``InMemoryLinkState.get_message_ins``),
    so each tick costs nodes x outstanding messages. With 1 000 nodes and a round of 1 000
    messages that is a million message checks per tick; a window keeps it at nodes x
    ``size``. The engine runs a few messages at a time anyway (one per CPU by default), so a
    window of a few times that loses no throughput.

    And why in deployment, with no limit: Flower 1.41's deployment grid (``HttpGrid``) sleeps
    3 s between its pulls, so a round waits on average 1.5 s after the last reply is in (on
    the loopback deployment, where the work of a round is 0.02 s, that was most of a round).
    Everything else is the grid's."""

    def __init__(self, grid: Grid, size: int | None, pull_interval: float = 0.05) -> None:
        if size is not None and size < 1:
            raise ValueError(f"window size {size}: must be >= 1 (None: no limit)")
        if not pull_interval > 0:
            raise ValueError(f"pull interval {pull_interval}: must be > 0 seconds")
        self.grid, self.size, self.pull_interval = grid, size, pull_interval
        self.arrivals: list[float] = []  # the last exchange's reply times (send_and_receive)

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        waiting = list(reversed(list(messages)))  # pop() from the end: the original order
        deadline = None if timeout is None else time.monotonic() + timeout
        outstanding: set[str] = set()
        replies: list[Message] = []
        started = time.monotonic()
        self.arrivals = []  # seconds from the start to each reply (RoundDeadline reads them)
        while waiting or outstanding:
            room = len(waiting) if self.size is None else self.size - len(outstanding)
            if waiting and room > 0:
                batch = [waiting.pop() for _ in range(min(room, len(waiting)))]
                outstanding.update(i for i in self.grid.push_messages(batch) if i)
            got = list(self.grid.pull_messages(outstanding)) if outstanding else []
            replies.extend(got)
            self.arrivals += [time.monotonic() - started] * len(got)
            outstanding.difference_update(m.metadata.reply_to_message_id for m in got)
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not got:
                time.sleep(self.pull_interval)
        return replies


def _count(value) -> int | None:
    """``value`` as a count (a finite non-negative whole number, as a query reply's metric
    carries it), or None: a NaN, Inf, negative or fractional ``partition-id`` or
    ``num-train`` is no count (``int(nan)`` raised and stopped the server)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value < 0 or value != int(value):
        return None
    return int(value)


def _innermost(grid):
    """The grid under pflower's wrappers (``Window``, ``RoundDeadline``)."""
    while hasattr(grid, "grid"):
        grid = grid.grid
    return grid


def polls_slowly(grid) -> bool:
    """Whether ``grid`` (or the grid it wraps) is Flower's deployment grid, whose
    ``send_and_receive`` sleeps 3 s between pulls (``HttpGrid`` in Flower 1.41)."""
    # GrpcGrid: its name in earlier releases
    return type(_innermost(grid)).__name__ in ("HttpGrid", "GrpcGrid")


def shorten_pull_backoff(seconds: float) -> None:
    """Flower's object pulls in this process (the ServerApp's) retry a reply's missing
    objects after ``seconds``, not 1 s (``pflower.flower_waits.cap_pull_backoff``); where
    the installed Flower has no such backoff, a warning and Flower's own wait."""
    try:
        cap_pull_backoff(seconds)
    except RuntimeError as err:
        log.warning("pull-interval: %s; replies are pulled with Flower's own backoff", err)


def index_dispatch() -> None:
    """Flower's simulation engine in this process finds each node's messages through an
    index (``pflower.flower_dispatch``) instead of walking every stored message for every
    node; where the installed Flower's dispatcher is not 1.41's, a warning and Flower's."""
    try:
        index_message_dispatch()
    except RuntimeError as err:
        log.warning("%s", err)


def in_memory_grid(grid) -> bool:
    """Whether ``grid`` (or the grid it wraps) is the simulation engine's in-memory grid."""
    return type(_innermost(grid)).__name__ == "InMemoryGrid"


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
        sizes: dict[int, int] = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error() or METRICS not in reply.content:
                continue
            node = reply.metadata.src_node_id
            pid = _count(reply.content[METRICS].get("partition-id"))
            if pid is not None:
                self.partition_of[node] = pid
            else:
                log.warning("node %d: no usable partition-id; it is sampled after the rest", node)
            size = _count(reply.content[METRICS].get("num-train"))
            if size:
                sizes[node] = size
        # a start-up claim is its node's first claim: it weighs every round (PFLEGO's
        # sum_j N_j) as the claim bound weighs it, never above 10 x the lower median of the
        # nodes' first claims (``checks.ClaimBound``), whatever it says
        self.num_train_of.update(sizes)

    def _in_order(self, replies: Iterable[Message]) -> list[Message]:
        """Replies in partition-id order (the order the nodes were sampled in)."""
        replies = list(replies)
        nodes = self._ordered({m.metadata.src_node_id for m in replies})
        rank = {n: i for i, n in enumerate(nodes)}
        return sorted(replies, key=lambda m: rank[m.metadata.src_node_id])

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
