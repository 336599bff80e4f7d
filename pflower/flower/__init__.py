"""Everything pflower does with Flower that Flower's public API does not promise, in one place.

Each module here is one adapter: what it touches in Flower, why (a speed-up or a missing
public route), the Flower versions it was checked against (``CHECKED``), and what happens
when an upgrade changes it. The rule they keep: **never crash, never silent**. An optional
speed-up whose Flower internal has moved, been renamed or changed its source falls back to
Flower's own behaviour, and says so once (``fall_back``); what a run cannot do without (the
DP mechanism's noise helpers) is refused at start, naming what changed. Nothing here imports
a private Flower module when ``pflower`` is imported: a run that uses nothing of an adapter
never loads what the adapter touches.

========================  =============================================  =====================
adapter                   touches (Flower 1.41)                          when it has changed
========================  =============================================  =====================
``dispatch``              ``InMemoryLinkState.get_message_ins`` (class   warning; Flower's own
                          attribute replaced after its source is         dispatcher (also when
                          checked), its ``lock`` and store               the index fails in
                                                                         Flower's thread)
``waits``                 ``start_client_internal.time``, the object     ServerApp: warning and
                          pulls' ``__kwdefaults__``                      Flower's waits; CLIs:
                                                                         refused, by name
``grids``                 the grid classes ``InMemoryGrid`` and          an unknown grid runs
                          ``HttpGrid`` (never their names alone)         the safe path (pulls,
                                                                         deadline) + warning
``dp``                    ``flwr.supercore.differential_privacy``'s      a DP run is refused at
                          clip and noise helpers (Flower's, not          start, naming the
                          re-implemented)                                module
``cli``                   ``flwr.common.config``'s run-config parser;    ``pflower run`` skips
                          ``flwr.cli.flower_config`` (the connection     its check (warning);
                          writer); ``flwr.supernode.cli``'s              the kit's commands
                          ``flower_supernode``                           refuse, by name
``superexec``             ``run_superexec``'s ``get_executor`` hook,     the warm SuperExec
                          ``run_clientapp`` (its keywords, its Runtime   says why, and Flower's
                          API client, ``push_message``,                  own SuperExec runs
                          ``push_task_output``), ``flwr.supercore``'s    (cold); a failing task
                          TLS, interceptor, retry and executor types     prints its traceback
``local``                 ``Run`` (``flwr.supercore.run``), the task     LocalGrid: a plain run
                          identity, ``flwr.common.constant.ErrorCode``   record, the codes'
                          (the testbed's in-process grid)                known values; warning
``texts``                 words Flower prints that the deployment kit    the kit reports
                          reads ("Failed to activate SuperNode",         Flower's own error,
                          "already in use", "SuperNode ID:", ...)        unexplained
========================  =============================================  =====================

The deployment kit (``pflower.deploy``) reaches Flower through ``cli``, ``superexec``,
``texts`` and ``waits``, and drives Flower's processes and ``flwr`` CLI by their public
commands; the in-process ``LocalGrid`` of the tests and benchmarks
(``pflower.testbed.local_grid``) through ``local``. ``docs/flower-boundary.md``
lists every touch; ``tests/test_flower_boundary.py`` takes each internal away and checks the
fallback.
"""

from __future__ import annotations

import inspect
import logging

#: the Flower releases every adapter was checked against (CI's 1.42, the floor 1.35 by
#: ``.ci/compat``, and 1.41, CI's until 2026-11-28)
CHECKED = ("1.35", "1.41", "1.42")

log = logging.getLogger("flwr.pflower")
_said: set[str] = set()


class FlowerDrift(RuntimeError):
    """A Flower internal an adapter relies on is not what it was checked against."""


def fall_back(what: str, err: BaseException, instead: str) -> None:
    """Say once per process that ``what`` is off because Flower changed (``err``), and what
    runs ``instead``."""
    key = f"{what}: {type(err).__name__}"
    if key in _said:
        return
    _said.add(key)
    log.warning(
        "%s is off: %s (%s); %s. pflower's adapters were checked on Flower %s",
        what,
        err,
        type(err).__name__,
        instead,
        ", ".join(CHECKED),
    )


def source_of(load, what: str, instead: str):
    """``(load(), its source)``; ``FlowerDrift`` naming ``what`` where the Flower object
    cannot be imported or read (moved, renamed, or shipped without its source)."""
    try:
        found = load()
        return found, inspect.getsource(found)
    except Exception as err:
        raise FlowerDrift(
            f"{what} cannot be read ({type(err).__name__}: {err}); {instead}"
        ) from err


def flower_version() -> str:
    """The version of the ``flwr`` module in use: its own ``__version__``, which every Flower
    distribution sets (``flwr``, and ``flwr-nightly``, which installs the same module under
    another distribution name, so that ``importlib.metadata.version("flwr")`` fails or finds
    another install's); the ``flwr`` distribution's metadata where the module has none."""
    import flwr

    found = getattr(flwr, "__version__", None)
    if isinstance(found, str) and found:
        return found
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("flwr", "flwr-nightly"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "unknown"
