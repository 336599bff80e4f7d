"""How ``flwr run`` reads a run config, for ``pflower run`` / ``pflower check-config``
(``pflower.launch``), which validate it before Flower does.

Flower 1.41 parses ``--run-config`` and flattens ``[tool.flwr.app.config]`` with helpers of
``flwr.common.config`` that its top-level package does not export (``parse_config_args``,
``flatten_dict``). pflower uses Flower's own, so that the keys and values it checks are the
ones Flower will send: a re-implementation could accept what Flower refuses. Where an upgrade
moved them, ``FlowerDrift``: ``pflower run`` then skips its own check with a warning and
lets ``flwr run`` (and the ServerApp's own validation at start) refuse a bad key;
``pflower check-config`` says it cannot check.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pflower.flower import FlowerDrift

MODULE = "flwr.common.config"


def _flowers(name: str):
    try:
        return getattr(importlib.import_module(MODULE), name)
    except (ImportError, AttributeError) as err:
        raise FlowerDrift(
            f"Flower's {MODULE}.{name}, with which flwr run reads a run config, is not where "
            f"Flower 1.41 has it ({type(err).__name__}: {err})"
        ) from err


def flatten_dict(config: dict) -> dict:
    """``[tool.flwr.app.config]`` as flat keys, as Flower flattens it."""
    return _flowers("flatten_dict")(config)


def parse_config_args(items: list[str] | None) -> dict:
    """``--run-config`` arguments as ``flwr run`` parses them."""
    return _flowers("parse_config_args")(items)


#: Flower's writer of the ``flwr`` CLI's configuration (``FLWR_HOME/config.toml``) and its
#: connection type: the deployment kit's ``connection`` writes with them, so that the file is
#: the one this Flower's CLI reads (a hand-written file drifted from it once: 1.35's layout)
CONFIG_MODULES = ("flwr.cli.flower_config", "flwr.cli.typing")


def write_connection(name: str, address: str, root_certificates: str) -> None:
    """Add (or replace) the SuperLink connection ``name`` (TLS, trusting
    ``root_certificates``) in the Flower configuration ``FLWR_HOME`` points at, and make it
    the default, with Flower's own writer; ``FlowerDrift`` naming what moved, for the kit's
    commands to refuse by name."""
    try:
        config, typing = (importlib.import_module(m) for m in CONFIG_MODULES)
        write = config.write_superlink_connection
        default = config.set_default_superlink_connection
        connection = typing.SuperLinkConnection
    except (ImportError, AttributeError) as err:
        raise FlowerDrift(
            f"Flower's flwr CLI configuration writer ({', '.join(CONFIG_MODULES)}) is not where "
            f"Flower 1.41 has it ({type(err).__name__}: {err}); the deployment kit cannot write "
            "the flwr CLI's connection with this Flower"
        ) from err
    write(connection(name, address=address, root_certificates=root_certificates, insecure=False))
    default(name)


#: Flower's SuperNode entry point (the ``flower-supernode`` command's function)
SUPERNODE_MODULE = "flwr.supernode.cli"


def flower_supernode():
    """Flower's ``flower_supernode`` (it reads ``sys.argv``); ``FlowerDrift`` naming the module
    where an upgrade moved it (``python -m pflower.deploy.supernode`` then refuses by name)."""
    try:
        return importlib.import_module(SUPERNODE_MODULE).flower_supernode
    except (ImportError, AttributeError) as err:
        raise FlowerDrift(
            f"Flower's {SUPERNODE_MODULE}.flower_supernode, the flower-supernode command, is not "
            f"where Flower 1.41 has it ({type(err).__name__}: {err}); run flower-supernode "
            "without --poll-interval"
        ) from err


def with_own_bin(environ) -> dict[str, str]:
    """``environ`` with this Python's ``bin/`` first on ``PATH``: Flower's processes start
    theirs (``flower-superexec``, ``flwr-clientapp``, the local SuperLink) from ``PATH``, so a
    virtual environment that is not activated must still be the one they find."""
    here = str(Path(sys.executable).parent)
    rest = [p for p in environ.get("PATH", "").split(os.pathsep) if p and p != here]
    return {**environ, "PATH": os.pathsep.join([here, *rest])}


#: what ``flwr run`` says when the local SuperLink it starts exits or does not come up
#: (Flower 1.41/1.42, ``flwr/cli/local_superlink.py``), and where it says the log is
SUPERLINK_FAILED = re.compile(r"Failed to start local SuperLink.*?See logs at (\S+?)\.?\s*$")
#: what the SuperLink's database migration (alembic) says about a database a newer Flower
#: wrote: its schema revision is one this Flower does not know
UNKNOWN_REVISION = "Can't locate revision"


#: a line inside the box Flower's CLI (typer, rich) draws around an error: its text, wrapped
#: at the console's width (80 columns when its output is not a terminal, as under pflower run)
BOXED = re.compile(r"^\s*│ ?(.*?)\s*│\s*$")


class ErrorBox:
    """Flower's boxed error message, its wrapped lines joined again: ``feed`` each output line;
    it returns the box's text once the box closes (None before and for other lines)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def feed(self, line: str) -> str | None:
        inside = BOXED.match(line)
        if inside:
            self.lines.append(inside.group(1))
            return None
        text, self.lines = " ".join(self.lines), []
        return text or None


def superlink_failure(line: str) -> str | None:
    """For ``flwr run``'s output line saying its local SuperLink failed to start, what the
    SuperLink itself said (the last error line of the log Flower names) and, for a state
    written by another Flower version, how to run on one of its own; None for other lines.
    Flower's own line says only "exited with code 1". A line whose wording has
    changed is not recognised: Flower's message then stands alone."""
    found = SUPERLINK_FAILED.search(line)
    if not found:
        return None
    log_file = Path(found.group(1))
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError as err:
        return f"its log ({log_file}) cannot be read: {err}"
    errors = [x.strip() for x in lines if "error" in x.lower() or UNKNOWN_REVISION in x]
    if not errors:  # Flower 1.41 sends the SuperLink's stderr, its traceback, to /dev/null
        probed = probe_superlink(log_file.parent / "state.db")
        if probed:
            errors, lines = [probed], [*lines, probed]
    said = errors[-1] if errors else (lines[-1].strip() if lines else "(the log is empty)")
    out = f"the local SuperLink said: {said}"
    if any(UNKNOWN_REVISION in x for x in lines):
        out += (
            f"\nIts database in {home()} {FOREIGN_STATE} than this one (flwr {_version()}). "
            f"Run with a Flower home of its own, e.g. FLWR_HOME={own_home()} pflower run ..., "
            "or remove that database."
        )
    return out


#: how ``superlink_failure`` says that the Flower home holds another version's state
FOREIGN_STATE = "was written by another Flower version"


def home() -> str:
    """The Flower home ``flwr`` uses in this environment (``FLWR_HOME``, or ``~/.flwr``)."""
    return os.environ.get("FLWR_HOME") or str(Path.home() / ".flwr")


def own_home() -> str:
    """A Flower home for this Flower version alone: the current one's path with the
    version appended (``~/.flwr-1.41.0``)."""
    return f"{home()}-{_version()}"


#: how long ``probe_superlink`` waits for a SuperLink to fail (one that fails at its
#: database's migration does within 5 s on a 2-core machine)
PROBE_S = 30.0


def probe_superlink(database: Path, timeout: float = PROBE_S) -> str | None:
    """The last line a ``flower-superlink`` on ``database`` writes to stderr when it exits
    within ``timeout`` (its exception), as the issue's user found the cause by hand; None if
    there is no database, or the probe keeps running (stopped then, by its pid). The probe
    listens on a free loopback port, never on the local SuperLink's."""
    import socket
    import subprocess

    if not database.is_file():
        return None
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    exe = Path(sys.executable).parent / "flower-superlink"
    command = [str(exe) if exe.exists() else "flower-superlink", "--insecure", "--simulation",
               "--database", str(database), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    except OSError:
        return None
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    last = [x.strip() for x in err.splitlines() if x.strip()]
    return last[-1] if proc.returncode and last else None


def _version() -> str:
    try:
        from pflower.flower import flower_version

        return flower_version()
    except Exception:  # noqa: BLE001 - a version only makes the hint more precise
        return "this"


#: Flower's local SuperLink (``flwr.cli.constant``, Flower >= 1.40): the environment
#: variables that move its two ports, and their defaults (Flower 1.40-1.42's)
LOCAL_PORTS = {
    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39091",
    "FLWR_LOCAL_CONTROL_API_PORT": "39093",
}


def local_ports(environ: Mapping[str, str]) -> dict[str, int]:
    """The local SuperLink's ports as ``flwr run`` resolves them under ``environ``."""
    return {name: int(environ.get(name) or default) for name, default in LOCAL_PORTS.items()}


@dataclass
class LocalSuperLink:
    """A local SuperLink found listening where ``flwr run`` would connect: its process (where
    the machine shows it), its Flower home (``--database <home>/local-superlink/state.db``)
    and the directory it was started in."""

    port: int
    pid: int | None = None
    home: str | None = None
    cwd: str | None = None

    def describe(self) -> str:
        where = [f"pid {self.pid}"] if self.pid else []
        where += [f"FLWR_HOME={self.home}"] if self.home else []
        where += [f"started in {self.cwd}"] if self.cwd else []
        return f"127.0.0.1:{self.port}" + (f" ({', '.join(where)})" if where else "")


def found_local_superlink(
    environ: Mapping[str, str], timeout: float = 0.5
) -> LocalSuperLink | None:
    """The SuperLink listening on the local SuperLink's port under ``environ``, or None where
    nothing listens there (``flwr run`` then starts one). Its process is read from /proc
    where there is one (Linux): ``flower-superlink ... --port <port>``."""
    import socket

    port = local_ports(environ)["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            pass
    except OSError:
        return None
    found = LocalSuperLink(port)
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            raw = (proc / "cmdline").read_bytes().split(b"\0")
            argv = [a.decode(errors="replace") for a in raw]
        except OSError:
            continue
        if not any(a.endswith("flower-superlink") for a in argv[:2]):
            continue
        options = dict(zip(argv, argv[1:]))
        if options.get("--port") != str(port):
            continue
        found.pid = int(proc.name)
        database = options.get("--database")
        if database and Path(database).parent.name == "local-superlink":
            found.home = str(Path(database).parent.parent)
        with contextlib.suppress(OSError):
            found.cwd = os.readlink(proc / "cwd")
        break
    return found


def project_superlink(project: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a local SuperLink of ``project``'s own: its Flower home
    (``~/.flwr-projects/<name>-<hash>``, outside the project, whose files Flower builds into
    the app bundle) and two ports drawn from the project's path (40000-41998, stable across
    runs, so that the next run, ``flwr ls`` and ``flwr log`` find the same SuperLink); what
    ``environ`` sets already is kept."""
    import zlib

    path = str(project.resolve())
    tag = zlib.crc32(path.encode())
    base = 40000 + 2 * (tag % 1000)
    own = {
        "FLWR_HOME": str(Path.home() / ".flwr-projects" / f"{project.resolve().name}-{tag:08x}"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(base),
        "FLWR_LOCAL_CONTROL_API_PORT": str(base + 1),
    }
    return {k: environ.get(k) or v for k, v in own.items()}
