"""Flower 1.41's fixed waits in deployment, and how pflower shortens them where it runs
Flower's own code.

A message crosses the deployment in pieces: a message record first, then its objects (the
arrays, the config...), each side pulling what the other pushed. Three waits of Flower's are
not settings:

- **the SuperNode's idle poll**: with no message for it, the SuperNode's loop
  (``flwr/supernode/start_client_internal.py``) sleeps 3 s before it asks again, and it
  checks every 0.5 s whether the ClientApp's reply is ready to send;
- **the object pull's backoff**: a side that pulls a message whose objects are not all there
  yet (the SuperNode stores a message before its objects arrive, and its ClientApp starts on
  it at once; the ServerApp may see a reply before its objects) waits 1 s, then 2, 4...
  (``flwr/supercore/inflatable/inflatable_utils.py``: ``pull_objects``'s
  ``initial_backoff``);
- **the ServerApp's pull**: Flower's deployment grid sleeps 3 s between its pulls for
  replies (``pflower.strategies.nodes.Window`` pulls every ``pull-interval`` instead).

On the loopback deployment, where a round's work is 0.02 s, these waits were nearly all of a
round (``benchmarks/deploy_rounds.py``). ``cap_supernode_polls`` and ``cap_pull_backoff``
shorten them in the process that calls them: the ServerApp (``pull-interval``), the
deployment kit's SuperNodes (``pflower.deploy.supernode --poll-interval``) and the warm
SuperExec's ClientApps (``pflower.deploy.warm_exec --poll-interval``). Each checks that the
installed Flower still has the wait it shortens, and refuses, naming it, when it does not.
"""

from __future__ import annotations

import inspect
import time

#: Flower 1.41's idle poll of the SuperNode's loop (seconds)
FLOWER_IDLE_POLL_S = 3.0
#: the shortest wait accepted (a node then asks 100 times a second)
MIN_WAIT_S = 0.01


class CappedTime:
    """The ``time`` module as Flower's SuperNode loop sees it: ``sleep`` waits at most
    ``cap`` seconds; every other name is ``time``'s."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str):
        return getattr(time, name)


def _check(seconds: float, what: str) -> None:
    if not MIN_WAIT_S <= seconds <= FLOWER_IDLE_POLL_S:
        raise ValueError(
            f"{what} {seconds}: must be in [{MIN_WAIT_S}, {FLOWER_IDLE_POLL_S:g}] seconds"
        )


def cap_supernode_polls(seconds: float) -> None:
    """Every sleep of Flower's SuperNode loop (its 3 s idle poll, its 0.5 s checks for a
    reply) waits at most ``seconds``, in this process."""
    _check(seconds, "the SuperNode's poll interval")
    from flwr.supernode import start_client_internal as loop

    if not isinstance(getattr(loop, "time", None), (type(time), CappedTime)):
        raise RuntimeError(
            "this Flower's SuperNode loop (flwr.supernode.start_client_internal) does not "
            "import `time`: it is not Flower 1.41's loop, whose waits pflower shortens; "
            "start the SuperNode without a poll interval"
        )
    if "time.sleep(3)" not in inspect.getsource(loop):
        raise RuntimeError(
            "this Flower's SuperNode loop (flwr.supernode.start_client_internal) no longer "
            "sleeps 3 s between pulls: it is not Flower 1.41's loop, whose waits pflower "
            "shortens; start the SuperNode without a poll interval"
        )
    loop.time = CappedTime(seconds)


def _pull_functions():
    from flwr.supercore.inflatable import inflatable_utils as objects

    return objects.pull_objects, objects.pull_and_inflate_object_from_tree


def cap_pull_backoff(seconds: float) -> None:
    """Flower's object pulls, in this process, wait ``seconds`` (not 1 s) before their first
    retry of an object that is not there yet, then twice as long each time, up to Flower's
    cap (10 s): the default of ``initial_backoff`` that every caller in Flower uses."""
    _check(seconds, "the pull backoff")
    for fn in _pull_functions():
        defaults = fn.__kwdefaults__ or {}
        if "initial_backoff" not in defaults:
            raise RuntimeError(
                f"this Flower's {fn.__module__}.{fn.__name__} has no `initial_backoff`: it "
                "is not Flower 1.41's object pull, whose backoff pflower shortens"
            )
        defaults["initial_backoff"] = seconds


def pull_backoff() -> float | None:
    """The first retry's wait of Flower's object pulls in this process (Flower's: 1 s)."""
    return (_pull_functions()[0].__kwdefaults__ or {}).get("initial_backoff")
