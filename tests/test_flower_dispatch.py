"""pflower.flower.dispatch: Flower's simulation dispatcher through an index by node.

The reference is Flower's own ``InMemoryLinkState.get_message_ins``, run on an identical copy
of a stand-in state (its lock, its message store and an expiry check in the place of
``_check_stored_messages``) through the same sequence of stores, deliveries, expiries and
looks, as the engine's dispatcher makes them (every node, in turn, each tick)."""

from __future__ import annotations

import copy
import random
import threading
from types import SimpleNamespace

import pytest
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

from pflower.flower import dispatch as flower_dispatch
from pflower.flower.dispatch import get_message_ins, index_message_dispatch

FLOWER_GET_MESSAGE_INS = InMemoryLinkState.__dict__["get_message_ins"]
if getattr(FLOWER_GET_MESSAGE_INS, "_pflower_indexed", False):  # patched by an earlier test
    FLOWER_GET_MESSAGE_INS = InMemoryLinkState._flower_get_message_ins


class StandInState:
    """What ``get_message_ins`` reads of an ``InMemoryLinkState``; ``expired`` holds the ids
    whose time to live has passed (Flower's check deletes them when it meets them)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.message_ins_store: dict[str, SimpleNamespace] = {}
        self.expired: set[str] = set()

    def _check_stored_messages(self, message_ids: set[str], run_id=None) -> None:
        for msg_id in message_ids & self.expired:
            self.message_ins_store.pop(msg_id, None)


def message(msg_id: str, node: int, run: int) -> SimpleNamespace:
    meta = SimpleNamespace(message_id=msg_id, dst_node_id=node, run_id=run, delivered_at="")
    return SimpleNamespace(metadata=meta)


def delivered(messages) -> list[str]:
    return [m.metadata.message_id for m in messages]


def state_of(state: StandInState) -> dict[str, bool]:
    """Which live (unexpired) messages are stored, and whether each was delivered."""
    return {
        k: m.metadata.delivered_at != ""
        for k, m in state.message_ins_store.items()
        if k not in state.expired
    }


@pytest.mark.skipif(
    "run_id" not in __import__("inspect").signature(FLOWER_GET_MESSAGE_INS).parameters,
    reason="compares the index with Flower 1.41's get_message_ins(run_id=...), which this "
    "Flower does not have (its fallback: test_flower_boundary)",
)
@pytest.mark.parametrize("seed", range(5))
def test_every_look_returns_what_flowers_returns(seed):
    rng = random.Random(seed)
    nodes = [rng.getrandbits(62) for _ in range(12)]
    ours, flowers = StandInState(), StandInState()
    counter = 0
    for tick in range(60):
        # the ServerApp stores messages (several to one node at times), some expire, some
        # replies are pulled (their messages deleted) between the dispatcher's ticks
        for _ in range(rng.randrange(0, 6)):
            counter += 1
            msg = message(f"m{counter}", rng.choice(nodes), rng.choice([1, 1, 2]))
            ours.message_ins_store[msg.metadata.message_id] = msg
            flowers.message_ins_store[msg.metadata.message_id] = copy.deepcopy(msg)
        stored = list(flowers.message_ins_store)
        for msg_id in rng.sample(stored, k=min(len(stored), rng.randrange(0, 3))):
            ours.expired.add(msg_id)
            flowers.expired.add(msg_id)
        for msg_id in rng.sample(stored, k=min(len(stored), rng.randrange(0, 3))):
            ours.message_ins_store.pop(msg_id, None)
            flowers.message_ins_store.pop(msg_id, None)
        limit = rng.choice([1, 1, 2, None])
        run_id = rng.choice([None, None, 1])
        for node in nodes:  # the dispatcher's tick
            got = get_message_ins(ours, node, limit, run_id=run_id)
            want = FLOWER_GET_MESSAGE_INS(flowers, node, limit, run_id=run_id)
            assert delivered(got) == delivered(want), (tick, node)
            assert all(m.metadata.dst_node_id == node for m in got)
        # after a whole tick, the same live messages stored, the same delivered (an expired
        # one may stay longer in ours: it is deleted at its own node's look, not at others')
        assert state_of(ours) == state_of(flowers), tick
    assert counter > 100


def test_a_message_stored_between_two_looks_is_found():
    """The index is rebuilt when the store has changed: a message stored after a node's
    look, or after the look of another node, is found at its node's next look."""
    state = StandInState()
    assert get_message_ins(state, 7, 1) == []
    state.message_ins_store["a"] = message("a", 7, 1)
    assert delivered(get_message_ins(state, 7, 1)) == ["a"]
    assert get_message_ins(state, 7, 1) == []  # delivered: not again
    state.message_ins_store["b"] = message("b", 8, 1)
    state.message_ins_store["c"] = message("c", 7, 1)
    assert delivered(get_message_ins(state, 8, None)) == ["b"]
    del state.message_ins_store["a"]  # its reply pulled
    assert delivered(get_message_ins(state, 7, None)) == ["c"]
    with pytest.raises(AssertionError):
        get_message_ins(state, 7, 0)


def test_index_message_dispatch_replaces_flowers_method_and_can_be_undone():
    try:
        index_message_dispatch()
        index_message_dispatch()  # idempotent
        assert InMemoryLinkState.get_message_ins is get_message_ins
        assert InMemoryLinkState._flower_get_message_ins is FLOWER_GET_MESSAGE_INS
    finally:
        flower_dispatch.restore_message_dispatch()
    assert InMemoryLinkState.get_message_ins is FLOWER_GET_MESSAGE_INS


def test_a_flower_whose_dispatcher_changed_is_left_alone(monkeypatch):
    def get_message_ins(self, node_id, limit, *, run_id=None):  # another Flower's
        return [m for m in self.message_ins_store.values() if m.metadata.dst_node_id == node_id]

    monkeypatch.setattr(InMemoryLinkState, "get_message_ins", get_message_ins)
    with pytest.raises(RuntimeError, match="not Flower 1.41's .*leaves its dispatcher"):
        index_message_dispatch()
    assert InMemoryLinkState.get_message_ins is get_message_ins
