"""A federation on loopback: the SuperLink, its Fleet gateway and registered SuperNodes as
processes started and stopped by process id (``python -m pflower.deploy up``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

from pflower.deploy import flower_cli
from pflower.deploy.credentials import _write, connection, credentials
from pflower.deploy.flower_cli import (
    flower_error,
    register,
    superlink_command,
    supernode_command,
    warm_exec_command,
)
from pflower.deploy.gateway import gateway_command
from pflower.deploy.processes import descendants, is_ours, stop_tree
from pflower.flower.cli import with_own_bin
from pflower.flower.texts import (
    ACTIVATED,
    ACTIVATION_REFUSED,
    ALREADY_REGISTERED,
    PORT_TAKEN,
    TASK_POLL_VARIABLE,
)

#: how long the SuperLink keeps a silent node online: Flower's heartbeat interval (30 s)
#: times its patience (2), plus one call timeout
HEARTBEAT_WINDOW_S = 65
#: how long a SuperNode must stay up before it counts as started: one Flower refuses
#: (activation, TLS, its key) exits within a few seconds of its start
SETTLE_S = 8.0
#: at most this long (s) for a started SuperNode's Runtime API to listen
READY_S = 60.0
#: at most this many new ports for a node whose port was taken at its bind
PORT_MOVES = 3
#: the pause between two starts while the SuperLink still holds a dead node's session
RETRY_S = 5.0
#: where the SuperLink keeps its state: a SQLite file (``superlink.db``) or Flower's memory
SUPERLINK_STATES = ("sqlite", "memory")
#: the thread counts of what a ClientApp computes with: torch's OpenMP pool, numpy's BLAS
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: a SuperExec's task poll (seconds) while there are no more SuperNodes than cores
TASK_POLL_S = 0.05
#: the range of the task poll Flower's SuperExec accepts (``TASK_POLL_VARIABLE``,
#: ``flwr/supercore/superexec/run_superexec.py``; Flower's own default is 1 s)
MIN_TASK_POLL_S, MAX_TASK_POLL_S = 0.01, 60.0


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class SuperNodeDied(RuntimeError):
    """A SuperNode that exited before it counted as started (``SETTLE_S``, its Runtime API
    listening), with what Flower said in its log."""


class Federation:
    """A SuperLink, its Fleet gateway and its SuperNodes on loopback, as processes this
    object started and stops (by their process ids, checked against their command lines):
    what ``python -m pflower.deploy up`` runs and what the deployment tests drive.

    Addresses: the SuperLink on ``127.0.0.1:superlink_port`` (Control, Runtime and Fleet
    APIs: the operator's side), the gateway on ``fleet_host:port`` (the Fleet API only: what
    the devices reach), SuperNode i's own Runtime API on ``127.0.0.1:port + 100 + i``
    (another free port where that one is taken: ``runtime_port``).

    Layout under ``root``: ``credentials/``, ``flwr-home/`` (the ``flwr`` CLI's
    configuration, with the connection ``name``), ``supernode-<i>/state`` (each device's
    personal state), ``logs/``, ``pids.json`` (label -> pid and command line).
    """

    def __init__(self, root: str | os.PathLike, supernodes: int = 2, port: int = 9093,
                 name: str = "pflower-deployment", fleet_host: str = "127.0.0.1",
                 superlink_port: int | None = None, warm: bool = False,
                 poll_interval: float | None = None, superlink_state: str = "sqlite",
                 threads: int | None = None,
                 task_poll_interval: float | None = None) -> None:  # fmt: skip
        if superlink_state not in SUPERLINK_STATES:
            raise ValueError(
                f"superlink_state {superlink_state!r}: must be one of {list(SUPERLINK_STATES)}"
            )
        if threads is not None and threads < 1:
            raise ValueError(f"threads {threads}: must be >= 1")
        if task_poll_interval is not None and not (
            MIN_TASK_POLL_S <= task_poll_interval <= MAX_TASK_POLL_S
        ):
            raise ValueError(
                f"task_poll_interval {task_poll_interval}: must be in "
                f"[{MIN_TASK_POLL_S}, {MAX_TASK_POLL_S:g}] seconds"
            )
        self.root = Path(root).expanduser().resolve()
        #: ``sqlite``: the SuperLink's runs, registered keys and messages in ``superlink.db``
        #: (a restarted SuperLink resumes from it); ``memory``: Flower's in-memory state,
        #: forgotten when the SuperLink stops, about half its CPU per round
        self.superlink_state = superlink_state
        #: each SuperNode's ClientApps compute with this many threads (``THREAD_VARIABLES``);
        #: ``None``: the machine's cores shared out among its SuperNodes
        self.threads = threads
        #: each SuperNode with ``--isolation process`` and a warm SuperExec beside it
        #: (``pflower.deploy.warm_exec``: every message in a fork of a process that imported
        #: torch and the app once) instead of a fresh flwr-clientapp process per message
        self.warm = warm
        #: each SuperNode's loop waits at most this many seconds between its checks for a
        #: message (``pflower.deploy.supernode``); ``None``: Flower's own 3 s
        self.poll_interval = poll_interval
        #: how often each SuperNode's SuperExec asks it for a task; ``None``: ``task_poll_s``
        self.task_poll_interval = task_poll_interval
        #: SuperNode index -> its Runtime API port (``runtime_port``); ports found taken
        self.runtime_ports: dict[int, int] = {}
        self._taken: set[int] = set()
        self.supernodes, self.port, self.name = supernodes, port, name
        self.fleet_host = fleet_host
        self.superlink_port = superlink_port or port + 1
        self.creds = self.root / "credentials"
        self.flwr_home = self.root / "flwr-home"
        self.logs = self.root / "logs"
        self.processes: dict[str, subprocess.Popen] = {}  # started by this object
        #: label -> {"pid", "command"}: every process of this federation, also those an
        #: earlier ``up`` started (read back from pids.json)
        self.entries: dict[str, dict] = {}
        pids = self.root / "pids.json"
        if pids.exists():
            recorded = json.loads(pids.read_text())
            self.entries = {k: v for k, v in recorded.items() if isinstance(v, dict)}

    @property
    def env(self) -> dict[str, str]:
        # this environment's bin/ first: the SuperNodes start flower-superexec from PATH
        return {
            **with_own_bin(os.environ),
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }

    @property
    def threads_per_node(self) -> int:
        """The threads each SuperNode's ClientApps compute with: ``threads``, else this
        machine's cores shared out among the SuperNodes (at least one)."""
        return self.threads or max(1, cores() // self.supernodes)

    @property
    def task_poll_s(self) -> float:
        """How often each SuperNode's SuperExec asks its SuperNode for a task (Flower's
        ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``; Flower's default is a second, a second's wait
        for every message): ``task_poll_interval``, else ``TASK_POLL_S`` while there are no
        more SuperNodes than cores, and beyond that ``TASK_POLL_S`` x SuperNodes / cores.

        Every ask costs CPU on both sides even when there is nothing to do: at 0.05 s an
        idle SuperNode and its warm SuperExec spent ~10 CPU-s a minute between them, so 20
        of them on a 2-core machine took more than its cores before any message (rounds of
        11-12 s for 0.03 s of work). Stretched with the nodes per core, the idle
        federation's asks cost a core what one node's cost."""
        if self.task_poll_interval is not None:
            return self.task_poll_interval
        per_core = self.supernodes / cores()
        return round(min(MAX_TASK_POLL_S, TASK_POLL_S * max(1.0, per_core)), 3)

    @property
    def node_env(self) -> dict[str, str]:
        """A SuperNode's and its SuperExec's: the SuperExec's task poll (``task_poll_s``).
        The SuperLink's SuperExec keeps Flower's second: it waits once per run, and at
        0.05 s its polls cost the idle SuperLink ~10 CPU-s a minute (measured).

        The SuperNodes share this machine's cores (``threads_per_node``, unless ``threads``
        is not set and the environment sets a variable itself): torch would give every
        ClientApp a thread per core, and OpenMP threads that spin on cores other ClientApps
        hold made a 2-core loopback message's training ~40x slower."""
        env = {**self.env, TASK_POLL_VARIABLE: f"{self.task_poll_s:g}"}
        share = str(self.threads_per_node)
        for name in THREAD_VARIABLES:
            if self.threads is not None or name not in os.environ:
                env[name] = share
        return env

    @property
    def fleet_address(self) -> str:
        return f"{self.fleet_host}:{self.port}"

    def state_dir(self, i: int) -> Path:
        return self.root / f"supernode-{i}" / "state"

    def prepare(self) -> None:
        """Credentials (one key more than SuperNodes: an unregistered device) and the
        connection for the ``flwr`` CLI (the SuperLink's loopback address); a Flower older
        than the kit was checked on is refused first (``require_checked_flower``)."""
        flower_cli.require_checked_flower()
        if not (self.creds / "ca.crt").exists():
            hosts = ("localhost", "127.0.0.1", "::1")
            credentials(
                self.creds, self.supernodes + 1, tuple(dict.fromkeys((*hosts, self.fleet_host)))
            )
        connection(
            self.flwr_home,
            self.name,
            f"127.0.0.1:{self.superlink_port}",
            str(self.creds / "ca.crt"),
        )
        self.logs.mkdir(parents=True, exist_ok=True)

    def running(self, label: str) -> bool:
        entry = self.entries.get(label)
        return entry is not None and is_ours(int(entry["pid"]), list(entry["command"]))

    def _start(self, label: str, command: list[str]) -> subprocess.Popen:
        env = self.env if label in ("superlink", "gateway") else self.node_env
        with open(self.logs / f"{label}.log", "ab") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                start_new_session=True,
            )  # fmt: skip
        self.processes[label] = proc
        self.entries[label] = {"pid": proc.pid, "command": command}
        self._save_pids()
        return proc

    def _log_tail(self, label: str, lines: int = 15) -> str:
        path = self.logs / f"{label}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def start_superlink(self, wait: float = 60.0, command: list[str] | None = None) -> None:
        """The SuperLink (``command``: the one it was started with before, ``up``); ready
        when the ``flwr`` CLI can list its SuperNodes."""
        proc = self._start(
            "superlink",
            command
            or superlink_command(
                self.creds,
                self.superlink_port,
                self.root / "superlink.db" if self.superlink_state == "sqlite" else None,
            ),
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # ready when the CLI can list its SuperNodes
            probe = subprocess.run(
                [flower_cli.executable("flwr"), "supernode", "ls", self.name], env=self.env,
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if probe.returncode == 0:
                return
            if proc.poll() is not None:
                break
            time.sleep(1)
        raise RuntimeError(
            f"the SuperLink did not come up; {self.logs / 'superlink.log'} ends with:\n"
            + self._log_tail("superlink")
        )

    def start_gateway(self, wait: float = 30.0, command: list[str] | None = None) -> None:
        """The Fleet gateway on ``fleet_address`` (``command``: the one it was started with
        before, ``up``); ready when it answers (403 to a GET)."""
        import ssl
        import urllib.error
        import urllib.request

        proc = self._start(
            "gateway",
            command
            or gateway_command(self.creds, self.fleet_address, f"127.0.0.1:{self.superlink_port}"),
        )
        context = ssl.create_default_context(cafile=str(self.creds / "ca.crt"))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"https://127.0.0.1:{self.port}/", context=context)
            except urllib.error.HTTPError:  # it answered
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("the Fleet gateway did not come up:\n" + self._log_tail("gateway"))

    def register(self, i: int) -> str:
        return register(self.creds, f"supernode-{i}", self.name, self.env)

    def start_supernode(self, i: int, key: int | None = None, recorded: Recorded | None = None,
                        **node_config) -> subprocess.Popen:  # fmt: skip
        """SuperNode ``i`` (partition i of ``supernodes``, state in ``state_dir(i)``),
        authenticated with key ``key`` (default: its own), connected to the gateway; with
        ``recorded`` (``up``, for a node that died), the command lines it and its warm
        SuperExec were started with, on the Runtime API port ``runtime_port`` finds free now
        (a dead node's may be held) and, for the SuperExec, beside the new node's pid: a node
        comes back as it was (warm or not, its node config, its poll), whatever this ``up``
        was given."""
        runtime_port = self.runtime_ports[i] = self.runtime_port(i)
        if recorded is not None:
            command = _with(recorded.supernode, "--port", str(runtime_port))
            warm = _value(command, "--isolation") == "process"
        else:
            config = {
                "partition-id": i,
                "num-partitions": self.supernodes,
                "state-dir": str(self.state_dir(i)),
                **node_config,
            }
            command = supernode_command(
                self.creds, f"supernode-{i if key is None else key}", self.fleet_address,
                runtime_port, config, self.poll_interval,
            )  # fmt: skip
            command += ["--isolation", "process"] if self.warm else []
            warm = self.warm
        proc = self._start(f"supernode-{i}", command)
        if warm:
            beside = warm_exec_command(runtime_port, proc.pid, self.poll_interval)
            if recorded is not None and recorded.warm_exec is not None:
                beside = _with(recorded.warm_exec, "--parent-pid", str(proc.pid))
                beside = _with(beside, "--runtime-api-address", f"127.0.0.1:{runtime_port}")
            self._start(f"warm-exec-{i}", beside)
        return proc

    def runtime_port(self, i: int) -> int:
        """SuperNode ``i``'s own Runtime API port (its SuperExec's, on loopback):
        ``port + 100 + i`` where that is free, else one the system hands out. A port in
        the ephemeral range may be held by an outgoing connection, the federation's own
        among them (20 SuperNodes polling open many): a node that joined mid-run found its
        port taken and exited ("address already in use"). ``start_supernodes``
        starts such a node again on another port (``_taken``)."""
        wanted = self.port + 100 + i
        if wanted not in self._taken:
            with socket.socket() as s:
                # as the SuperNode's server binds (asyncio sets it): a connection of an
                # earlier node left in TIME_WAIT does not keep the port from it
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", wanted))
                    return wanted
                except OSError:
                    pass
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def listening(self, i: int) -> bool:
        """Whether SuperNode ``i``'s Runtime API port accepts connections (the first thing a
        SuperNode starts). Another process listening there would pass too; ``runtime_port``
        found the port free just before the node started, which makes that unlikely."""
        port = self.runtime_ports.get(i)
        if port is None:
            return False
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
        return True

    def restart_supernode(self, i: int, timeout: float = 2 * HEARTBEAT_WINDOW_S, **node_config):
        """Start SuperNode ``i`` again after it died (``start_supernodes``: once it is alive
        after ``SETTLE_S``, waiting out the dead node's session on the SuperLink)."""
        self.stop(f"supernode-{i}")  # whatever is left of the old one (its children)
        return self.start_supernodes([i], timeout, **node_config)[i]

    def start_supernodes(
        self, indices, timeout: float = 2 * HEARTBEAT_WINDOW_S,
        recorded: Mapping[int, Recorded] | None = None, **node_config,
    ) -> dict[int, subprocess.Popen]:  # fmt: skip
        """Start SuperNodes ``indices`` and return once each is still alive ``SETTLE_S``
        after its start and its Runtime API listens (within ``READY_S``): a node Flower
        refuses exits within seconds, one whose port was taken exits when it binds it (20
        SuperNodes starting on 2 cores took longer than ``SETTLE_S`` to get there), and
        ``up`` must not call either started.

        A node killed without signing off (kill -9, power loss) keeps its session on the
        SuperLink until Flower's heartbeat lapses (``HEARTBEAT_WINDOW_S``); until then Flower
        refuses the key ("Failed to activate SuperNode", the same words as for an
        unregistered key) and the new node exits. Say so, and start it again every
        ``RETRY_S`` until ``timeout``. A node whose Runtime API port was taken between
        ``runtime_port``'s look and its bind starts again at once on another port (at most
        ``PORT_MOVES`` times). A node that dies for any other reason, or still after
        ``timeout``, raises ``SuperNodeDied`` with Flower's message from its log
        (``flower_error``). A node in ``recorded`` starts with its own command line
        (``start_supernode``)."""
        began = time.monotonic()
        deadline = began + timeout
        recorded = recorded or {}
        configs = {i: {**node_config, "recorded": recorded.get(i)} for i in indices}
        started = {i: self._launch(i, **configs[i]) for i in indices}
        self._until_ready(started)
        alive = {}
        for i, (mark, proc) in started.items():
            label, told, moves = f"supernode-{i}", False, 0
            while proc.poll() is not None:
                said = self._log_since(label, mark)
                late = time.monotonic() > deadline
                if PORT_TAKEN in said and moves < PORT_MOVES and not late:
                    self._taken.add(self.runtime_ports[i])
                    moves += 1
                    mark, proc = self._launch(i, **configs[i])
                    self._until_ready({i: (mark, proc)})
                    continue
                if ACTIVATION_REFUSED not in said or late:
                    self.processes.pop(label, None)
                    self.entries.pop(label, None)
                    self._save_pids()
                    raise SuperNodeDied(
                        f"{label} exited (code {proc.returncode}) before it listened and "
                        f"stayed up {SETTLE_S:g} s ({time.monotonic() - began:.0f} s after its "
                        f"first start); Flower said ({self.logs / f'{label}.log'}):\n"
                        + flower_error(said)
                    )
                if not told:
                    print(
                        f"{label}: the SuperLink still holds the session of the node that "
                        f"died (Flower: '{ACTIVATION_REFUSED}'); it lets the key in again once "
                        f"that node's heartbeat lapses (up to {HEARTBEAT_WINDOW_S} s). "
                        f"Retrying every {RETRY_S:g} s...",
                        flush=True,
                    )
                    told = True
                time.sleep(RETRY_S)
                mark, proc = self._launch(i, **configs[i])
                self._until_ready({i: (mark, proc)})
            alive[i] = proc
        return alive

    def _until_ready(self, started: Mapping[int, tuple[int, subprocess.Popen]]) -> None:
        """Wait ``SETTLE_S``, then until every node of ``started`` has exited, or listens
        and is activated (Flower logged ``ACTIVATED`` since its start), at most ``READY_S``
        in all. Listening alone is not enough: a node the SuperLink refuses (a dead node's
        session not yet lapsed) listens first and exits after its activation is refused,
        which took more than ``SETTLE_S`` on a loaded 2-core box (the node then counted as
        started and the federation ran on without it). A node still alive at ``READY_S``
        without that line counts as started, as before the line was read (a Flower whose
        log says it otherwise)."""
        _settle([proc for _, proc in started.values()])
        deadline = time.monotonic() + READY_S - SETTLE_S
        waiting = dict(started)
        while waiting and time.monotonic() < deadline:
            waiting = {
                i: (mark, proc)
                for i, (mark, proc) in waiting.items()
                if proc.poll() is None
                and not (self.listening(i) and ACTIVATED in self._log_since(f"supernode-{i}", mark))
            }
            if waiting:
                time.sleep(0.2)

    def _launch(self, i: int, **node_config) -> tuple[int, subprocess.Popen]:
        """SuperNode ``i`` started, with where its log stood before (what it says after)."""
        path = self.logs / f"supernode-{i}.log"
        mark = path.stat().st_size if path.exists() else 0
        return mark, self.start_supernode(i, **node_config)

    def _log_since(self, label: str, mark: int) -> str:
        with open(self.logs / f"{label}.log", "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def stop(self, label: str, timeout: float = 5.0) -> None:
        """Stop ``label``'s process and everything below it, if it is still the process
        this federation started (its command line); a SuperNode's state is on disk, written
        atomically, so nothing is lost."""
        warm_exec = f"warm-exec-{label.removeprefix('supernode-')}"
        if label.startswith("supernode-") and warm_exec in self.entries:
            self.stop(warm_exec, timeout)  # its SuperExec, if warm
        entry = self.entries.pop(label, None)
        proc = self.processes.pop(label, None)
        if entry is not None and is_ours(int(entry["pid"]), list(entry["command"])):
            stop_tree(int(entry["pid"]), timeout)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        self._save_pids()

    def stop_all(self) -> None:
        order = [k for k in self.entries if k.startswith("supernode")] + ["gateway", "superlink"]
        for label in dict.fromkeys([*order, *self.entries]):
            self.stop(label)

    def up(self, say: Callable[[str], None] | None = None) -> list[str]:
        """Everything ``python -m pflower.deploy up`` starts, reusing what already runs
        (a second ``up`` on the same directory changes nothing); returns what it did, and
        passes each line to ``say`` as it happens (the command prints them: a failure later
        on does not hide what was done before it).

        It checks every process this federation owns (``pids.json``: the SuperLink, the
        gateway, each SuperNode, each warm SuperExec) and starts one that has died again with
        the command line it was started with, one line each ("had died (pid N); started
        again"): a SuperLink or a gateway killed mid-run, a SuperNode (with its warm SuperExec,
        as it was), a warm SuperExec beside a living SuperNode (``restart_warm_exec``)."""
        said = _Said(say)
        self.prepare()
        for label, start in (("superlink", self.start_superlink), ("gateway", self.start_gateway)):
            entry = self.entries.get(label)
            if self.running(label):
                said.append(f"{label}: already running (pid {entry['pid']})")
            elif entry is not None:
                start(command=list(entry["command"]))
                said.append(
                    f"{label}: had died (pid {entry['pid']}); started again "
                    f"(pid {self.entries[label]['pid']})"
                )
            else:
                start()
                said.append(f"{label}: started (pid {self.entries[label]['pid']})")
        starting, recorded = [], {}
        owned = {int(k.removeprefix("supernode-")) for k in self.entries if _SUPERNODE.match(k)}
        for i in sorted(owned | set(range(self.supernodes))):
            label = f"supernode-{i}"
            if self.running(label):
                said.append(f"{label}: already running (pid {self.entries[label]['pid']})")
                warm_exec = self.restart_warm_exec(i)
                if warm_exec is not None:
                    said.append(warm_exec)
                continue
            if label in self.entries:  # it died: as it was, once what is left of it stops
                recorded[i] = Recorded.of(self.entries, i)
                self.stop(label)  # its warm SuperExec (serving a dead node), its children
            flower = self.register(i)
            again = ALREADY_REGISTERED in flower.lower()
            done = "key already registered" if again else "key registered"
            said.append(f"{label}: {done} (Flower: {' '.join(flower.splitlines()) or 'ok'})")
            starting.append(i)
        # started only once alive after SETTLE_S (and listening, within READY_S);
        # SuperNodeDied (Flower's words) otherwise
        for i, proc in self.start_supernodes(starting, recorded=recorded).items():
            where = (
                f", Runtime API on 127.0.0.1:{self.runtime_ports[i]}" if self.listening(i) else ""
            )
            how = "started" if i not in recorded else (
                f"had died (pid {recorded[i].pid}); started again"
            )  # fmt: skip
            said.append(f"supernode-{i}: {how} (pid {proc.pid}, alive after {SETTLE_S:g} s{where})")
        return said

    def restart_warm_exec(self, i: int) -> str | None:
        """Start SuperNode ``i``'s warm SuperExec again, with the command it was started
        with, if it has died while its SuperNode lives; what was done, or None where the
        node has no warm SuperExec. Its zygote dying takes the warm SuperExec with it
        (``warm_exec``: a broken pipe ends it), and a SuperNode whose SuperExec is gone is
        listed online but runs nothing: every round dropped its reply at the round timeout
        until ``down`` + ``up``. ``up`` calls this for every running node."""
        label = f"warm-exec-{i}"
        entry = self.entries.get(label)
        if entry is None:
            return None
        if self.running(label):
            return f"{label}: already running (pid {entry['pid']})"
        dead = entry["pid"]
        proc = self._start(label, list(entry["command"]))
        return f"{label}: had died (pid {dead}); started again (pid {proc.pid})"

    def run(self, run_config: Mapping[str, object], app: str | os.PathLike, timeout: float = 600):
        """``flwr run <app> <connection> --stream`` with ``run_config`` overrides."""
        items = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        flwr = flower_cli.executable("flwr")
        return subprocess.run(
            [flwr, "run", str(app), self.name, "--stream", "--run-config", items],
            env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def submit(self, run_config: Mapping[str, object], app: str | os.PathLike,
               label: str = "run") -> subprocess.Popen:  # fmt: skip
        """``flwr run`` as ``run`` does, in the background: its output streams to
        ``logs/<label>.log`` (``progress`` reads it)."""
        items = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        flwr = flower_cli.executable("flwr")
        with open(self.logs / f"{label}.log", "wb") as log:
            return subprocess.Popen(
                [flwr, "run", str(app), self.name, "--stream", "--run-config", items],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            )  # fmt: skip

    def crash(self, label: str) -> list[int]:
        """SIGKILL ``label``'s process, its process group and everything below it at once
        (a power cut: nothing signs off, nothing is flushed); returns the pids killed."""
        entry = self.entries.get(label)
        if entry is None or not is_ours(int(entry["pid"]), list(entry["command"])):
            return []
        pid = int(entry["pid"])
        tree = [pid, *descendants(pid)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        for target in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, signal.SIGKILL)
        proc = self.processes.get(label)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        return tree

    def _save_pids(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _write(self.root / "pids.json", json.dumps(self.entries, indent=1).encode())


class Recorded(NamedTuple):
    """A dead SuperNode as ``pids.json`` recorded it: its pid, its command line and its warm
    SuperExec's (None where it had none)."""

    pid: int
    supernode: list[str]
    warm_exec: list[str] | None

    @classmethod
    def of(cls, entries: Mapping[str, dict], i: int) -> Recorded:
        node, beside = entries[f"supernode-{i}"], entries.get(f"warm-exec-{i}")
        return cls(
            int(node["pid"]),
            list(node["command"]),
            None if beside is None else list(beside["command"]),
        )


#: a SuperNode's label in ``pids.json``
_SUPERNODE = re.compile(r"^supernode-\d+$")


def _value(command: list[str], flag: str) -> str | None:
    """The value after ``flag`` in ``command``, None where it has none."""
    at = command.index(flag) if flag in command else len(command)
    return command[at + 1] if at + 1 < len(command) else None


def _with(command: list[str], flag: str, value: str) -> list[str]:
    """``command`` with ``flag``'s value set to ``value`` (as it is where it has no ``flag``)."""
    at = command.index(flag) if flag in command else len(command)
    return [*command[: at + 1], value, *command[at + 2 :]] if at + 1 < len(command) else command


class _Said(list):
    """The lines ``up`` returns, each passed on to ``say`` when it is added."""

    def __init__(self, say: Callable[[str], None] | None) -> None:
        super().__init__()
        self.say = say

    def append(self, line: str) -> None:
        super().append(line)
        if self.say is not None:
            self.say(line)


def _settle(procs: list[subprocess.Popen]) -> None:
    """Wait ``SETTLE_S``, or until every one of ``procs`` has exited."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)


def _toml(value: object) -> str:
    """A run-config value as ``flwr run --run-config`` expects it (TOML)."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)
