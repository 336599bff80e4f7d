"""Processes started, recognised and stopped by pid, with their whole trees (``/proc``)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has ended


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def is_ours(pid: int, command: list[str]) -> bool:
    """Whether process ``pid`` runs ``command`` (its arguments; the interpreter in front of
    a script may differ): a recorded pid reused by another program is never ours."""
    running = cmdline(pid)
    return alive(pid) and bool(command) and running[-(len(command) - 1) :] == command[1:]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren...), from /proc."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parent_of[int(entry.name)] = stat[1]
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parent_of.items() if parent in frontier]
        found.extend(children)
        frontier = children
    return found


def stop_tree(pid: int, timeout: float = 5.0) -> list[int]:
    """SIGTERM ``pid`` alone and give it ``timeout`` to end, then SIGTERM its process group
    and every process below it (Flower starts some children in process groups of their own),
    then SIGKILL what is left after ``timeout``; returns the pids that were signalled.

    One SIGTERM, and only one, to ``pid`` first: Flower's processes answer the first with
    their clean exit (a SuperNode deactivates its node on the SuperLink) and put the default
    handler back, so a second one (the group's, sent at once) killed a SuperNode before it
    signed off, and the SuperLink held its session until its heartbeat lapsed: the next ``up``
    waited 28-82 s for it. Its children stop with it or after it."""
    tree = [pid, *descendants(pid)]  # before the parent ends: its children are reparented
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
    _wait_gone([pid], timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not any(alive(p) for p in tree):
            break
        for target in tree:
            if alive(target):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(target, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        _wait_gone(tree, timeout)
    return tree


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
