"""Flower 1.41's simulation dispatcher, and how pflower makes each of its looks O(1) in the
number of nodes.

Flower's simulation engine hands messages to its workers from one loop
(``flwr/server/superlink/fleet/vce/vce_api.py``, ``add_messages_to_queue``): every 0.1 s,
for every registered node, it asks the link state for that node's next message
(``InMemoryLinkState.get_message_ins``), which walks **every stored message** and runs
Flower's expiry and federation check on each (``_check_stored_messages``) before it looks at
the message's destination. A tick therefore costs nodes x stored messages checks: with
10 000 nodes and pflower's 16 messages in flight, ~160 000 checks per tick, ~66 ms of CPU per
message at 10 000 nodes against ~12 ms at 1 000 (``benchmarks/scale.py``), and
the start-up question to every node (``NodeSampling.learn_partitions``) took 348 s.

``index_message_dispatch`` replaces that method, in this process, by one that reads the same
store through an index of message ids by destination node, rebuilt whenever the store's set
of message ids has changed since the index was built. Each call then checks only the
messages addressed to its node, in the store's order, with Flower's own
``_check_stored_messages``, and returns and marks delivered what Flower's would: the
undelivered, unexpired messages for ``node_id`` (and ``run_id``), at most ``limit``. What
differs is when an expired message is deleted from the store: when a look at its own node
meets it, or when the ServerApp asks for its reply (Flower's ``get_message_res`` checks it
and answers with Flower's expiry error), not when another node's look walks past it; it is
never handed to a worker either way. The ServerApp calls it where Flower's engine runs in
its process (the in-memory grid of ``run_simulation`` and of ``flwr run`` on a simulation
federation); it checks that the installed Flower still has the method it replaces, and
refuses (``FlowerDrift``), naming what changed, when it does not: the ServerApp then keeps
Flower's dispatcher and says so once. Should the index itself fail in Flower's dispatching
thread (an attribute of the link state renamed), Flower's own method is put back and answers
that call and every later one, with the same warning.
"""

from __future__ import annotations

from pflower.flower import FlowerDrift, fall_back, source_of

try:  # public since Flower 1.38; the same function as the older private path
    from flwr.common import now
except ImportError:  # pragma: no cover - the floor's Flower
    from flwr.supercore.date import now

#: what Flower 1.41's ``InMemoryLinkState.get_message_ins`` does, as its source says it
_FLOWER_SOURCE_MARKS = (
    "for msg_id in list(self.message_ins_store.keys()):",
    "self._check_stored_messages({msg_id})",
    "msg_ins.metadata.dst_node_id == node_id",
    'msg_ins.metadata.delivered_at == ""',
)


def _link_state():
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    return InMemoryLinkState


def get_message_ins(self, node_id: int, limit: int | None, *, run_id: int | None = None):
    """``InMemoryLinkState.get_message_ins`` through an index of the stored messages by
    destination node (``index_message_dispatch``); Flower's own method, put back, where the
    index cannot read this link state."""
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    try:
        return _indexed(self, node_id, limit, run_id)
    except (AttributeError, KeyError, TypeError) as err:  # Flower's link state changed
        state = type(self)
        flowers = state.__dict__.get("_flower_get_message_ins")
        if flowers is None:  # pragma: no cover - restored by another thread meanwhile
            flowers = state.get_message_ins
        restore_message_dispatch()
        fall_back(
            "the simulation's dispatch index",
            err,
            "Flower's own dispatcher walks every stored message for every node",
        )
        return flowers(self, node_id, limit, run_id=run_id)


def _indexed(self, node_id: int, limit: int | None, run_id: int | None) -> list:
    found = []
    with self.lock:
        store = self.message_ins_store
        index = self.__dict__.get("_pflower_dispatch_index")
        if index is None or index[0] != store.keys():
            by_node: dict[int, list[str]] = {}
            for msg_id, msg in store.items():
                by_node.setdefault(msg.metadata.dst_node_id, []).append(msg_id)
            index = self._pflower_dispatch_index = (frozenset(store), by_node)
        for msg_id in index[1].get(node_id, ()):
            self._check_stored_messages({msg_id})  # Flower's expiry check (may delete it)
            msg = store.get(msg_id)
            if (
                msg is not None
                and msg.metadata.dst_node_id == node_id
                and (run_id is None or msg.metadata.run_id == run_id)
                and msg.metadata.delivered_at == ""
            ):
                found.append(msg)
            if limit and len(found) == limit:
                break
    delivered_at = now().isoformat()  # Flower's clock, as its own method reads it
    for msg in found:
        msg.metadata.delivered_at = delivered_at
    return found


get_message_ins._pflower_indexed = True


def index_message_dispatch() -> None:
    """Flower's in-memory link state, in this process, finds a node's messages through an
    index by destination node (``get_message_ins`` above); idempotent. ``FlowerDrift`` where
    the installed Flower's link state is not the one checked (moved, or its method's source
    changed): nothing is replaced then."""
    current, source = source_of(
        lambda: _link_state().get_message_ins,
        "Flower's InMemoryLinkState.get_message_ins",
        "pflower leaves its dispatcher as it is",
    )
    if getattr(current, "_pflower_indexed", False):
        return
    state = _link_state()
    missing = [mark for mark in _FLOWER_SOURCE_MARKS if mark not in source]
    if missing:
        raise FlowerDrift(
            "this Flower's InMemoryLinkState.get_message_ins is not Flower 1.41's (it lacks "
            f"{missing[0]!r}): pflower leaves its dispatcher as it is"
        )
    state._flower_get_message_ins = current
    state.get_message_ins = get_message_ins


def restore_message_dispatch() -> None:
    """Flower's own ``get_message_ins`` again (tests)."""
    state = _link_state()
    original = state.__dict__.get("_flower_get_message_ins")
    if original is not None:
        state.get_message_ins = original
        del state._flower_get_message_ins
