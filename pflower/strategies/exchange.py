"""How a round's messages are exchanged: the grid wrappers a strategy's ``start`` puts in
front of Flower's grid -- ``Window``, at most so many messages outstanding and a short pull
interval, and ``RoundDeadline``, a round timeout drawn from the rounds so far -- and the two
adapters of Flower's internals that speed an exchange up (``pflower.flower``: the simulation's
dispatch index, the object pulls' backoff), each with Flower's own behaviour as its fallback.
"""

from __future__ import annotations

import math
import time

from flwr.app import Message
from flwr.serverapp import Grid

from pflower.flower import fall_back, grids
from pflower.flower.dispatch import index_message_dispatch
from pflower.flower.waits import cap_pull_backoff

#: ``max_in_flight`` = 0 on Flower's simulation engine: messages outstanding at once
SIMULATION_WINDOW = 16


class Exchange:
    """How a strategy exchanges its rounds' messages with the grid (``wrap``).

    Parameters
    ----------
    max_in_flight : int (default: 0)
        At most this many messages outstanding at once; 0 (auto): ``SIMULATION_WINDOW`` on
        Flower's simulation engine, no limit elsewhere.
    pull_interval : float (default: 0.05)
        Seconds between the pulls for replies while a round waits.
    """

    def __init__(self, max_in_flight: int = 0, pull_interval: float = 0.05) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight = {max_in_flight}: must be >= 0 (0: auto)")
        if not 0.01 <= pull_interval <= 60:
            raise ValueError(f"pull_interval = {pull_interval}: must be in [0.01, 60] seconds")
        self.max_in_flight, self.pull_interval = max_in_flight, pull_interval

    def wrap(self, grid: Grid, timeout: float | None) -> tuple[Grid, float | None]:
        """``grid`` behind the wrappers its engine needs, and the timeout to run it with: the
        window (``Window``) with short pulls where Flower's engines are, and without a
        ``timeout`` (0 or None) a round deadline drawn from the rounds so far
        (``RoundDeadline``)."""
        engine = grids.engine_of(grid)
        simulated = engine == grids.SIMULATION  # Flower's simulation engine, in this process
        if simulated:
            index_dispatch()
        window = self.max_in_flight or (SIMULATION_WINDOW if simulated else 0)
        if engine == grids.DEPLOYMENT:  # Flower's deployment grid: 3 s pulls, 1 s backoff
            shorten_pull_backoff(min(self.pull_interval, 1.0))
        # a grid not recognised (``other``) takes the safe path: pulled through the window
        if window or engine in (grids.DEPLOYMENT, grids.OTHER):
            grid = Window(grid, window or None, self.pull_interval)
        if not timeout:  # each round waits as long as the work needs
            return RoundDeadline(grid), None
        return grid, timeout


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


def shorten_pull_backoff(seconds: float) -> None:
    """Flower's object pulls in this process (the ServerApp's) retry a reply's missing
    objects after ``seconds``, not 1 s (``pflower.flower.waits.cap_pull_backoff``); where
    the installed Flower has no such backoff, a warning (once) and Flower's own wait."""
    try:
        cap_pull_backoff(seconds)
    except Exception as err:  # any change of Flower's: never the reason a run stops
        fall_back("the short object-pull backoff (pull-interval)", err, "Flower's own backoff")


def index_dispatch() -> None:
    """Flower's simulation engine in this process finds each node's messages through an
    index (``pflower.flower.dispatch``) instead of walking every stored message for every
    node; where the installed Flower's dispatcher is not 1.41's, a warning (once) and
    Flower's."""
    try:
        index_message_dispatch()
    except Exception as err:  # any change of Flower's: never the reason a run stops
        fall_back(
            "the simulation's dispatch index",
            err,
            "Flower's own dispatcher walks every stored message for every node",
        )
