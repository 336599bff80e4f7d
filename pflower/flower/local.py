"""What the in-process ``LocalGrid`` (``pflower.testbed.local_grid``) takes of Flower's
internals to stand where a SuperLink does: the run record a grid hands out (``Run``, in
``flwr.supercore.run`` since Flower 1.32, ``flwr.common.typing`` before), the task identity
messages are stamped with (``flwr.supercore.task_identity``, Flower >= 1.38) and the error
codes of an error reply (``flwr.common.constant.ErrorCode``), and the id a pushed message
gets (the metadata's private ``_message_id``).

Each falls back to what Flower's public API lets a grid do without it, and says so once
(``fall_back``): a plain record with the run's public fields, no task identity (a Flower
without one needs none), and the codes' values as Flower 1.35-1.42 define them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pflower.flower import FlowerDrift, fall_back

#: ``ErrorCode``'s values in Flower 1.35-1.42 (the fallback)
NODE_UNAVAILABLE, CLIENT_APP_RAISED_EXCEPTION = 5, 2


@dataclass
class PlainRun:
    """A run record with the public fields of Flower's ``Run``."""

    run_id: int
    fab_id: str = ""
    fab_version: str = ""
    fab_hash: str = ""
    override_config: dict = field(default_factory=dict)


def empty_run(run_id: int):
    """Flower's empty ``Run`` of ``run_id``, or a ``PlainRun`` where it has moved."""
    try:
        try:  # flwr >= 1.32
            from flwr.supercore.run import Run
        except ImportError:  # flwr 1.21 to 1.31
            from flwr.common.typing import Run
        return Run.create_empty(run_id)
    except Exception as err:  # any change of Flower's: never the reason a run stops
        fall_back("Flower's run record in LocalGrid", err, "a plain record of its fields")
        return PlainRun(run_id)


def ensure_task_identity(run_id: int) -> None:
    """Stamp this process as a SuperLink's task (messages need it on flwr >= 1.38) unless it
    is one already; a Flower without task identities needs none."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:
        return
    try:
        if TaskIdentity._run_id is None:
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 1
    except Exception as err:  # any change of Flower's: never the reason a run stops
        fall_back("LocalGrid's task identity", err, "messages without one")


def error_codes() -> tuple[int, int]:
    """Flower's ``(NODE_UNAVAILABLE, CLIENT_APP_RAISED_EXCEPTION)`` error codes."""
    try:
        from flwr.common.constant import ErrorCode

        return int(ErrorCode.NODE_UNAVAILABLE), int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION)
    except Exception as err:  # any change of Flower's: never the reason a run stops
        fall_back("Flower's error codes in LocalGrid", err, "the values of Flower 1.35-1.42")
        return NODE_UNAVAILABLE, CLIENT_APP_RAISED_EXCEPTION


def stamp_message_id(msg, message_id: str) -> None:
    """Give a pushed message its id, as a SuperLink does: Flower keeps it in the metadata's
    private ``_message_id`` and has no public setter. Where that no longer sets the id the
    message reports, ``FlowerDrift`` (a grid that silently misroutes replies would be worse
    than none)."""
    msg.metadata.__dict__["_message_id"] = message_id
    if msg.metadata.message_id != message_id:
        raise FlowerDrift(
            "LocalGrid cannot give a message its id: Flower's Metadata no longer reads "
            "'_message_id'"
        )
