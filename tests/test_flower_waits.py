"""Flower's fixed waits in deployment and how pflower shortens them (``pflower.flower.waits``):
the SuperNode loop's sleeps capped at the poll interval, the object pull's first retry after
the given seconds; both refused, naming what changed, on a Flower without them."""

from __future__ import annotations

import time

import pytest
from flwr.supercore.inflatable import inflatable_utils as objects
from flwr.supernode import start_client_internal as loop

import pflower.flower as boundary
from pflower.flower import waits as flower_waits
from pflower.flower.waits import CappedTime, cap_pull_backoff, cap_supernode_polls, pull_backoff


@pytest.fixture
def flower(monkeypatch):
    """Flower's module state as it was after the test: the loop's ``time``, the defaults."""
    monkeypatch.setattr(loop, "time", loop.time)
    for fn in (objects.pull_objects, objects.pull_and_inflate_object_from_tree):
        for key, value in (
            ("initial_backoff", 1),
            ("backoff_cap", 10),
            ("max_tries_per_object", 500),
        ):
            monkeypatch.setitem(fn.__kwdefaults__, key, value)
    return monkeypatch


class _NoReplyYet:
    """A SuperNode state whose ClientApp has not replied for ``polls`` checks."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def get_messages_legacy(self, is_reply):
        if self.polls == 0:
            raise StopIteration  # the test ends here
        self.polls -= 1
        return []


@pytest.mark.skipif(
    not hasattr(loop, "_push_messages")
    or "get_messages_legacy" not in __import__("inspect").getsource(loop._push_messages),
    reason="drives Flower 1.41's SuperNode loop with a stand-in of its 1.41 state",
)  # fmt: skip
def test_flower_s_supernode_loop_sleeps_at_most_the_poll_interval(flower):
    slept = []
    flower.setattr(flower_waits.time, "sleep", slept.append)
    with pytest.raises(StopIteration):  # Flower's own wait for a reply: 0.5 s per check
        loop._push_messages(_NoReplyYet(2), None, None, None)
    assert slept == [0.5, 0.5]
    cap_supernode_polls(0.05)
    assert isinstance(loop.time, CappedTime) and loop.time.monotonic is time.monotonic
    with pytest.raises(StopIteration):
        loop._push_messages(_NoReplyYet(3), None, None, None)
    assert slept[2:] == [0.05, 0.05, 0.05]
    loop.time.sleep(3)  # the idle poll's
    loop.time.sleep(0.01)  # shorter waits are left as they are
    assert slept[5:] == [0.05, 0.01]


def test_a_missing_object_is_retried_after_the_shortened_backoff(flower):
    asked = []

    def pull(object_id):
        asked.append(time.monotonic())
        if len(asked) == 1:
            raise objects.ObjectUnavailableError(object_id)
        return b"content"

    def first_retry_after() -> float:
        asked.clear()
        assert objects.pull_objects(["a"], pull) == {"a": b"content"}
        return asked[1] - asked[0]

    assert pull_backoff() == 1 and first_retry_after() >= 0.75  # Flower's: 1 s +- 20%
    cap_pull_backoff(0.02)
    assert pull_backoff() == 0.02 and first_retry_after() < 0.5
    defaults = objects.pull_and_inflate_object_from_tree.__kwdefaults__
    assert defaults["initial_backoff"] == 0.02  # the ClientApp's pull of its message


def test_later_retries_grow_to_twice_the_first_and_the_pull_is_as_patient_as_flowers(flower):
    """An object that arrives late is asked for again at most 2 x the first wait later (with
    Flower's growth, waits of 0.2, 0.4, 0.8 s put rounds 1.4 s apart), and a pull still gives
    up no sooner than Flower's: 500 retries growing from 1 s to 10 s, ~83 min."""
    asked = []

    def pull(object_id):
        asked.append(time.monotonic())
        if len(asked) < 6:
            raise objects.ObjectUnavailableError(object_id)
        return b"content"

    cap_pull_backoff(0.02)
    assert objects.pull_objects(["a"], pull) == {"a": b"content"}
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert len(gaps) == 5 and max(gaps) < 0.04 * 1.2 + 0.03  # 0.02, 0.04, 0.04... +- 20%
    defaults = objects.pull_objects.__kwdefaults__
    assert defaults["backoff_cap"] == 0.04
    waits = [min(0.02 * 2 ** min(k, 60), 0.04) for k in range(defaults["max_tries_per_object"])]
    flowers = [min(2 ** min(k, 60), 10) for k in range(500)]
    assert sum(waits) >= sum(flowers) > 80 * 60
    cap_pull_backoff(0.02)  # again: from Flower's own settings, not from the shortened ones
    assert defaults["max_tries_per_object"] == len(waits)


def test_a_flower_without_these_waits_is_refused_naming_what_changed(flower):
    flower.setattr(loop, "time", object())
    with pytest.raises(RuntimeError, match="does not import `time`"):
        cap_supernode_polls(0.2)
    flower.setattr(loop, "time", time)
    flower.setattr(boundary.inspect, "getsource", lambda module: "time.sleep(5)")
    with pytest.raises(RuntimeError, match="no longer sleeps 3 s"):
        cap_supernode_polls(0.2)
    flower.delitem(objects.pull_objects.__kwdefaults__, "backoff_cap")
    with pytest.raises(RuntimeError, match="has no `backoff_cap`"):
        cap_pull_backoff(0.2)
    flower.delitem(objects.pull_objects.__kwdefaults__, "initial_backoff")
    with pytest.raises(RuntimeError, match="has no `initial_backoff`"):
        cap_pull_backoff(0.2)


@pytest.mark.parametrize("seconds", [0.0, 0.001, 3.5, float("nan")])
def test_a_wait_outside_its_range_is_refused(seconds, flower):
    with pytest.raises(ValueError, match=r"must be in \[0.01, 3\] seconds"):
        cap_supernode_polls(seconds)
    with pytest.raises(ValueError, match=r"must be in \[0.01, 3\] seconds"):
        cap_pull_backoff(seconds)


def test_the_supernode_launcher_refuses_a_bad_poll_before_it_starts_flower(capsys):
    from pflower.deploy.supernode import main

    with pytest.raises(SystemExit) as done:
        main(["--poll-interval", "10", "--superlink", "127.0.0.1:1"])
    assert done.value.code == 2
    assert "must be in [0.01, 3] seconds" in capsys.readouterr().err


def test_the_kit_starts_its_supernodes_and_warm_superexecs_with_the_poll_interval(tmp_path):
    from pflower.deploy.flower_cli import supernode_command, warm_exec_command

    plain = supernode_command(tmp_path, "supernode-0", "127.0.0.1:9093", 9194, {"a": 1})
    assert plain[0].endswith("flower-supernode") and "--poll-interval" not in plain
    fast = supernode_command(tmp_path, "supernode-0", "127.0.0.1:9093", 9194, {"a": 1}, 0.2)
    assert fast[1:5] == ["-m", "pflower.deploy.supernode", "--poll-interval", "0.2"]
    assert fast[5:] == plain[1:]  # flower-supernode's own arguments, unchanged
    assert warm_exec_command(9194, 42, 0.2)[-2:] == ["--poll-interval", "0.2"]
    assert "--poll-interval" not in warm_exec_command(9194, 42)
