"""Flower's executables as the deployment kit runs them: the commands that start a SuperLink
and a SuperNode, registering a SuperNode's key, and Flower's words read out of what its CLI
and its logs print (without colour codes or the box the CLI draws around an error).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from pflower.flower.texts import (
    ALREADY_REGISTERED,
    FLWR_IN_MEMORY_DB_NAME,
)
from pflower.flower.texts import BOX as _BOX
from pflower.flower.texts import LOG_RECORD as _LOG_RECORD

#: the oldest Flower the deployment kit was checked on: with flwr 1.35 the SuperLink starts, but
#: that release's ``flwr`` CLI cannot reach it through the connection the kit writes (the
#: SuperLink logs "Invalid HTTP request"; ``.ci/compat``, 2026-11-28)
OLDEST_FLOWER = (1, 41)


def require_checked_flower(version: str | None = None) -> None:
    """Refuse, at the start, a Flower older than the kit was checked on (``OLDEST_FLOWER``),
    naming both versions: otherwise ``up`` fails minutes later, after the SuperLink started,
    with "the SuperLink did not come up" and no cause."""
    if version is None:  # the module's own (flwr-nightly installs it under another name)
        from pflower import flower

        version = flower.flower_version()
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if parts < OLDEST_FLOWER:
        oldest = ".".join(map(str, OLDEST_FLOWER))
        raise RuntimeError(
            f"the deployment kit needs flwr >= {oldest} (checked on 1.41 and 1.42); this "
            f"environment has flwr {version}, whose flwr CLI cannot reach the SuperLink through "
            f"the connection the kit writes: pip install 'flwr>={oldest}'"
        )


def executable(name: str) -> str:
    """A Flower executable: next to this Python first (the virtual environment's bin/)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def superlink_command(creds: Path, port: int, database: Path | None) -> list[str]:
    """``flower-superlink`` with TLS and CLI-managed SuperNode authentication (only SuperNodes
    whose public key was registered with ``flwr supernode register`` may connect), bound to
    loopback: Flower 1.41 serves its Control API (register keys, submit runs), Runtime API and
    Fleet API on this one port, so only the operator's machine may reach it; devices reach the
    Fleet API through the gateway (``gateway``). ``database``: the SQLite file of its state
    (runs, registered keys, messages; what a restarted SuperLink resumes from), or ``None``
    for Flower's in-memory state (``:flwr-in-memory:``, forgotten when it stops)."""
    return [
        executable("flower-superlink"),
        "--ssl-ca-certfile", str(creds / "ca.crt"),
        "--ssl-certfile", str(creds / "server.pem"),
        "--ssl-keyfile", str(creds / "server.key"),
        "--enable-supernode-auth",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--database", FLWR_IN_MEMORY_DB_NAME if database is None else str(database),
        "--disable-runtime-dependency-installation",
    ]  # fmt: skip


def supernode_command(
    creds: Path,
    key: str,
    superlink: str,
    port: int,
    node_config: Mapping[str, object],
    poll_interval: float | None = None,
) -> list[str]:
    """``flower-supernode`` over TLS (trusting ``ca.crt``), authenticated by its private key,
    with its node config (its data and its ``state-dir``); with ``poll_interval``, Flower's
    SuperNode through ``pflower.deploy.supernode``, its loop's waits capped at that."""
    items = " ".join(
        f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in node_config.items()
    )
    if poll_interval is None:
        start = [executable("flower-supernode")]
    else:
        start = [sys.executable, "-m", "pflower.deploy.supernode"]
        start += ["--poll-interval", f"{poll_interval:g}"]
    return [
        *start,
        "--root-certificates", str(creds / "ca.crt"),
        "--superlink", superlink,
        "--auth-supernode-private-key", str(creds / key),
        "--node-config", items,
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip


def warm_exec_command(
    runtime_port: int, supernode_pid: int, poll_interval: float | None = None
) -> list[str]:
    """``pflower.deploy.warm_exec`` for the SuperNode whose Runtime API is on
    ``127.0.0.1:runtime_port`` (loopback, as Flower's own SuperExec reaches it), ending
    with that SuperNode (``--parent-pid``); with ``poll_interval``, its ClientApps' first
    retry of a missing object after that many seconds."""
    poll = [] if poll_interval is None else ["--poll-interval", f"{poll_interval:g}"]
    return [
        sys.executable, "-m", "pflower.deploy.warm_exec",
        "--runtime-api-address", f"127.0.0.1:{runtime_port}",
        "--insecure",
        "--parent-pid", str(supernode_pid),
        *poll,
    ]  # fmt: skip


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def flower_said(text: str) -> str:
    """Flower's message in ``text`` (the ``flwr`` CLI's output), without colour codes and
    without the box the CLI draws around an error: its border lines (``╭─ Error ─╮``,
    ``╰──╯``) go, its side bars are stripped, the words stay as Flower wrote them."""
    lines = []
    for line in _ANSI.sub("", text).splitlines():
        bare = line.strip()
        if not bare or bare[0] in "╭╰┌└" or not bare.strip(_BOX + " "):
            continue
        lines.append(bare.strip(_BOX).strip() if bare[0] in "│┃" else bare)
    return "\n".join(lines)


def flower_error(log: str, lines: int = 15) -> str:
    """What Flower said when a process died, from its log: the last ERROR record, verbatim
    (Flower's exit message: code, reason, help link), up to the next record; without one,
    the last ``lines`` lines of the log (``flower_said``)."""
    said = flower_said(log).splitlines()
    starts = [n for n, line in enumerate(said) if line.startswith("ERROR")]
    if not starts:
        return "\n".join(said[-lines:])
    block = [_LOG_RECORD.sub("", said[starts[-1]])]
    for line in said[starts[-1] + 1 :]:
        if _LOG_RECORD.match(line):
            break
        block.append(line)
    return "\n".join(block)


def register(creds: Path, key: str, connection_name: str, env: Mapping[str, str]) -> str:
    """Register SuperNode ``key``'s public key with the SuperLink (``flwr supernode
    register``), as the operator does once per device; returns Flower's message
    (``flower_said``: its words, not the box the CLI draws). A key that is registered
    already is not an error (``up`` on an existing directory); anything else Flower refuses
    is raised with Flower's own words."""
    done = subprocess.run(
        [executable("flwr"), "supernode", "register", str(creds / f"{key}.pub"), connection_name],
        # wide enough that the CLI does not wrap Flower's message inside its box
        env={**env, "COLUMNS": "1000"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = flower_said(done.stdout + done.stderr)
    if done.returncode != 0 and ALREADY_REGISTERED not in said.lower():
        raise RuntimeError(f"flwr supernode register {key}.pub failed:\n{said}")
    return said
