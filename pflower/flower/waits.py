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
installed Flower still has the wait it shortens, and refuses (``FlowerDrift``), naming it,
when it does not or cannot be read at all: the ServerApp then keeps Flower's waits and says
so once; the deployment kit's commands refuse the option that asked for it.
"""

from __future__ import annotations

import importlib
import math
import time

from pflower.flower import FlowerDrift, source_of

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
    loop, source = source_of(
        lambda: importlib.import_module("flwr.supernode.start_client_internal"),
        "Flower's SuperNode loop (flwr.supernode.start_client_internal)",
        "start the SuperNode without a poll interval",
    )
    if not isinstance(getattr(loop, "time", None), (type(time), CappedTime)):
        raise FlowerDrift(
            "this Flower's SuperNode loop (flwr.supernode.start_client_internal) does not "
            "import `time`: it is not Flower 1.41's loop, whose waits pflower shortens; "
            "start the SuperNode without a poll interval"
        )
    if "time.sleep(3)" not in source:
        raise FlowerDrift(
            "this Flower's SuperNode loop (flwr.supernode.start_client_internal) no longer "
            "sleeps 3 s between pulls: it is not Flower 1.41's loop, whose waits pflower "
            "shortens; start the SuperNode without a poll interval"
        )
    loop.time = CappedTime(seconds)


def _pull_functions():
    try:
        from flwr.supercore.inflatable import inflatable_utils as objects

        return objects.pull_objects, objects.pull_and_inflate_object_from_tree
    except (ImportError, AttributeError) as err:
        raise FlowerDrift(
            f"Flower's object pulls (flwr.supercore.inflatable.inflatable_utils) are not "
            f"where Flower 1.41 has them ({type(err).__name__}: {err})"
        ) from err


#: how much longer than the first retry's wait the later ones may grow (Flower: 10 x 1 s)
BACKOFF_GROWTH = 2
#: each pull function's own (initial_backoff, backoff_cap, max_tries_per_object)
_FLOWERS: dict = {}


def _ramp(initial: float, cap: float) -> list[float]:
    """The waits before the first one at ``cap``: ``initial``, doubling, while below it."""
    waits, delay = [], initial
    while delay < cap:
        waits.append(delay)
        delay *= 2
    return waits


def _give_up_after(initial: float, cap: float, tries: int) -> float:
    """How long a pull waits for a missing object before it gives up: ``tries`` retries, the
    wait doubling from ``initial`` up to ``cap`` (Flower 1.41: 1 s, 10 s, 500 tries: ~83 min)."""
    ramp = _ramp(initial, cap)[:tries]
    return sum(ramp) + (tries - len(ramp)) * cap


def _tries_for(initial: float, cap: float, patience: float) -> int:
    """The fewest retries, from ``initial`` doubling up to ``cap``, that wait ``patience``."""
    ramp = _ramp(initial, cap)
    if sum(ramp) >= patience:
        return next(k for k in range(1, len(ramp) + 1) if sum(ramp[:k]) >= patience)
    return len(ramp) + math.ceil((patience - sum(ramp)) / cap)


def cap_pull_backoff(seconds: float) -> None:
    """Flower's object pulls, in this process, wait ``seconds`` (not 1 s) before their first
    retry of an object that is not there yet, then twice as long, and then no longer than
    ``BACKOFF_GROWTH x seconds`` (Flower: up to 10 s): the defaults of ``initial_backoff`` and
    ``backoff_cap`` that every caller in Flower uses. With Flower's growth, an object that
    arrived 0.7 s after a first retry at 0.2 s waited for the retry at 1.4 s (0.2 + 0.4 +
    0.8): rounds of the loopback deployment fell into two groups, 1.4 s apart. The number of
    tries (``max_tries_per_object``) grows with it, so that a pull still waits at least as long
    as Flower's before it gives up on an object (a large reply on a slow link)."""
    _check(seconds, "the pull backoff")
    for fn in _pull_functions():
        defaults = fn.__kwdefaults__ or {}
        missing = [
            k
            for k in ("initial_backoff", "backoff_cap", "max_tries_per_object")
            if k not in defaults
        ]
        if missing:
            raise FlowerDrift(
                f"this Flower's {fn.__module__}.{fn.__name__} has no `{missing[0]}`: it "
                "is not Flower 1.41's object pull, whose backoff pflower shortens"
            )
        flowers = _FLOWERS.setdefault(  # Flower's own, as first found
            fn,
            (
                defaults["initial_backoff"],
                defaults["backoff_cap"],
                defaults["max_tries_per_object"],
            ),
        )
        cap = min(BACKOFF_GROWTH * seconds, flowers[1])
        tries = max(flowers[2], _tries_for(seconds, cap, _give_up_after(*flowers)))
        defaults.update(initial_backoff=seconds, backoff_cap=cap, max_tries_per_object=tries)


def pull_backoff() -> float | None:
    """The first retry's wait of Flower's object pulls in this process (Flower's: 1 s)."""
    return (_pull_functions()[0].__kwdefaults__ or {}).get("initial_backoff")
