"""The deployment kit: credentials (a self-signed CA, the SuperLink's TLS certificate, one EC
key pair per SuperNode for node authentication), the ``flwr`` CLI's connection, a Fleet
gateway, and a federation on loopback started and stopped by process id.

    python -m pflower.deploy credentials --out deploy/credentials --supernodes 2
    python -m pflower.deploy connection --credentials deploy/credentials --address 127.0.0.1:9094
    python -m pflower.deploy gateway --listen 0.0.0.0:9093 --superlink 127.0.0.1:9094 \
        --credentials deploy/credentials
    python -m pflower.deploy up --dir deploy --supernodes 2     # all of it, on loopback
    python -m pflower.deploy down --dir deploy

Security model (README "Who can do what"): the SuperLink listens on loopback only, since
Flower 1.41 serves its Control API (register SuperNode keys, submit runs, whose code then runs
on every device), Runtime API and Fleet API on one port without account authentication
(Flower Enterprise's OIDC aside). Devices reach the Fleet API through the gateway, which
forwards ``/v1/fleet/*`` and refuses everything else.

Files under ``--out``: ``ca.crt`` (give it to every SuperNode and to the ``flwr`` CLI),
``server.pem`` / ``server.key`` (the certificate of the SuperLink and the gateway for
``--host`` names, signed by the CA; the key never leaves the server), ``supernode-<i>`` /
``supernode-<i>.pub`` (SuperNode i's private key, OpenSSH PEM, stays on the device; its public
key is what the operator registers with ``flwr supernode register``). For prototyping and
loopback tests; production deployments should use their organisation's PKI.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Atomic write; private keys readable by their owner only."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    if private:
        os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def credentials(
    out: str | os.PathLike,
    supernodes: int = 2,
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"),
    days: int = 365,
) -> Path:
    """Write a CA, the SuperLink's certificate for ``hosts`` and ``supernodes`` node key
    pairs under ``out``; returns the directory."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("pflower CA"))
        .issuer_name(_name("pflower CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(out / "ca.crt", ca.public_bytes(pem))
    _write(out / "server.pem", server.public_bytes(pem))
    _write(
        out / "server.key",
        server_key.private_bytes(
            pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        ),
        private=True,
    )
    for i in range(supernodes):
        node_keys(out / f"supernode-{i}")
    return out


def node_keys(path: str | os.PathLike) -> Path:
    """An EC (P-384) key pair for SuperNode authentication: ``path`` (OpenSSH private key)
    and ``path.pub`` (OpenSSH public key, to register)."""
    path = Path(path).expanduser()
    key = ec.generate_private_key(ec.SECP384R1())
    _write(
        path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(path.with_name(path.name + ".pub"), public + b"\n")
    return path


def connection(flwr_home: str | os.PathLike, name: str, address: str, ca: str) -> Path:
    """Add (or replace) the SuperLink connection ``name`` in ``flwr_home/config.toml``, the
    Flower configuration the ``flwr`` CLI reads (``FLWR_HOME``, default ``~/.flwr``), and
    make it the default; written by Flower's own configuration writer."""
    from flwr.cli import flower_config
    from flwr.cli.typing import SuperLinkConnection

    home = Path(flwr_home).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("FLWR_HOME")
    os.environ["FLWR_HOME"] = str(home)  # Flower's writer finds the file through it
    try:
        root = str(Path(ca).expanduser().resolve())
        flower_config.write_superlink_connection(
            SuperLinkConnection(name, address=address, root_certificates=root, insecure=False)
        )
        flower_config.set_default_superlink_connection(name)
    finally:
        if before is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = before
    return home / "config.toml"


def _bin(name: str) -> str:
    """A Flower executable: next to this Python first (the virtual environment's bin/)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def superlink_command(creds: Path, port: int, database: Path) -> list[str]:
    """``flower-superlink`` with TLS and CLI-managed SuperNode authentication (only SuperNodes
    whose public key was registered with ``flwr supernode register`` may connect), bound to
    loopback: Flower 1.41 serves its Control API (register keys, submit runs), Runtime API and
    Fleet API on this one port, so only the operator's machine may reach it; devices reach the
    Fleet API through the gateway (``gateway``)."""
    return [
        _bin("flower-superlink"),
        "--ssl-ca-certfile", str(creds / "ca.crt"),
        "--ssl-certfile", str(creds / "server.pem"),
        "--ssl-keyfile", str(creds / "server.key"),
        "--enable-supernode-auth",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--database", str(database),
        "--disable-runtime-dependency-installation",
    ]  # fmt: skip


def gateway_command(creds: Path, listen: str, superlink: str) -> list[str]:
    """The Fleet gateway (``gateway``) as a process: ``python -m pflower.deploy gateway``."""
    return [
        sys.executable, "-m", "pflower.deploy", "gateway",
        "--listen", listen, "--superlink", superlink, "--credentials", str(creds),
    ]  # fmt: skip


def supernode_command(
    creds: Path, key: str, superlink: str, port: int, node_config: Mapping[str, object]
) -> list[str]:
    """``flower-supernode`` over TLS (trusting ``ca.crt``), authenticated by its private key,
    with its node config (its data and its ``state-dir``)."""
    items = " ".join(
        f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in node_config.items()
    )
    return [
        _bin("flower-supernode"),
        "--root-certificates", str(creds / "ca.crt"),
        "--superlink", superlink,
        "--auth-supernode-private-key", str(creds / key),
        "--node-config", items,
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip


#: Flower's answer when a public key is registered a second time
ALREADY_REGISTERED = "already in use"
#: Flower's answer to a SuperNode whose key still has a session the SuperLink counts as
#: online (a node killed without signing off, until its heartbeat lapses)
ACTIVATION_REFUSED = "Failed to activate SuperNode"
#: how long the SuperLink keeps a silent node online: Flower's heartbeat interval (30 s)
#: times its patience (2), plus one call timeout
HEARTBEAT_WINDOW_S = 65
#: the paths the gateway forwards: Flower's Fleet API (what a SuperNode calls)
FLEET_API = "/v1/fleet/"
_HOP_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
     "trailer", "upgrade", "proxy-connection", "content-encoding"}
)  # fmt: skip


def register(creds: Path, key: str, connection_name: str, env: Mapping[str, str]) -> str:
    """Register SuperNode ``key``'s public key with the SuperLink (``flwr supernode
    register``), as the operator does once per device; returns Flower's message. A key that
    is registered already is not an error (``up`` on an existing directory); anything else
    Flower refuses is raised with Flower's own words."""
    done = subprocess.run(
        [_bin("flwr"), "supernode", "register", str(creds / f"{key}.pub"), connection_name],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = (done.stdout + done.stderr).strip()
    if done.returncode != 0 and ALREADY_REGISTERED not in said.lower():
        raise RuntimeError(f"flwr supernode register {key}.pub failed:\n{said}")
    return said


def gateway(listen: str, superlink: str, creds: Path) -> None:
    """Serve Flower's Fleet API, and nothing else, on ``listen`` ("host:port", TLS with the
    SuperLink's certificate), forwarding each call to the SuperLink at ``superlink``
    (loopback, its certificate checked against ``ca.crt``).

    Why: Flower 1.41 serves the Control API (register keys, submit runs, whose app code then
    runs on every device), the Runtime API and the Fleet API on one port, and its open-source
    Control API has no account authentication. Devices must reach the Fleet API; nobody but
    the operator may reach the rest. Everything that is not a POST under ``/v1/fleet/`` is
    answered 403 and logged with the caller's address."""
    import ssl

    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    upstream = httpx.AsyncClient(
        base_url=f"https://{superlink}",
        verify=ssl.create_default_context(cafile=str(creds / "ca.crt")),
        timeout=None,
    )

    async def forward(request):
        path, caller = request.url.path, request.client.host if request.client else "?"
        if request.method != "POST" or not path.startswith(FLEET_API):
            print(f"gateway: refused {request.method} {path} from {caller}", flush=True)
            return PlainTextResponse(
                "pflower gateway: only Flower's Fleet API is served on this address\n", 403
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            reply = await upstream.post(
                path, content=await request.body(), headers=headers, params=request.query_params
            )
        except httpx.TransportError as err:  # the SuperLink is down: the node retries
            return PlainTextResponse(f"pflower gateway: SuperLink unreachable ({err})\n", 502)
        kept = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS}
        return Response(reply.content, status_code=reply.status_code, headers=kept)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)])
    host, port = listen.rsplit(":", 1)
    print(f"gateway: Fleet API on {listen} -> SuperLink {superlink}", flush=True)
    uvicorn.run(
        app,
        host=host.strip("[]"),
        port=int(port),
        ssl_certfile=str(creds / "server.pem"),
        ssl_keyfile=str(creds / "server.key"),
        log_level="warning",
        access_log=False,
    )


# --- processes: started, recognised and stopped by pid, with their whole trees -------------
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
    """SIGTERM ``pid``, its process group and every process below it (Flower starts some
    children in process groups of their own), then SIGKILL what is left after ``timeout``;
    returns the pids that were signalled."""
    tree = [pid, *descendants(pid)]  # before the parent ends: its children are reparented
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(alive(p) for p in tree):
            time.sleep(0.1)
        if not any(alive(p) for p in tree):
            break
    return tree


class Federation:
    """A SuperLink, its Fleet gateway and its SuperNodes on loopback, as processes this
    object started and stops (by their process ids, checked against their command lines):
    what ``python -m pflower.deploy up`` runs and what the deployment tests drive.

    Addresses: the SuperLink on ``127.0.0.1:superlink_port`` (Control, Runtime and Fleet
    APIs: the operator's side), the gateway on ``fleet_host:port`` (the Fleet API only: what
    the devices reach), SuperNode i's own Runtime API on ``127.0.0.1:port + 100 + i``.

    Layout under ``root``: ``credentials/``, ``flwr-home/`` (the ``flwr`` CLI's
    configuration, with the connection ``name``), ``supernode-<i>/state`` (each device's
    personal state), ``logs/``, ``pids.json`` (label -> pid and command line).
    """

    def __init__(self, root: str | os.PathLike, supernodes: int = 2, port: int = 9093,
                 name: str = "pflower-deployment", fleet_host: str = "127.0.0.1",
                 superlink_port: int | None = None) -> None:  # fmt: skip
        self.root = Path(root).expanduser().resolve()
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
        return {
            **os.environ,
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }

    @property
    def fleet_address(self) -> str:
        return f"{self.fleet_host}:{self.port}"

    def state_dir(self, i: int) -> Path:
        return self.root / f"supernode-{i}" / "state"

    def prepare(self) -> None:
        """Credentials (one key more than SuperNodes: an unregistered device) and the
        connection for the ``flwr`` CLI (the SuperLink's loopback address)."""
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
        with open(self.logs / f"{label}.log", "ab") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
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

    def start_superlink(self, wait: float = 60.0) -> None:
        proc = self._start(
            "superlink",
            superlink_command(self.creds, self.superlink_port, self.root / "superlink.db"),
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # ready when the CLI can list its SuperNodes
            probe = subprocess.run(
                [_bin("flwr"), "supernode", "ls", self.name], env=self.env,
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

    def start_gateway(self, wait: float = 30.0) -> None:
        """The Fleet gateway on ``fleet_address``; ready when it answers (403 to a GET)."""
        import ssl
        import urllib.error
        import urllib.request

        proc = self._start(
            "gateway",
            gateway_command(self.creds, self.fleet_address, f"127.0.0.1:{self.superlink_port}"),
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

    def start_supernode(self, i: int, key: int | None = None, **node_config) -> subprocess.Popen:
        """SuperNode ``i`` (partition i of ``supernodes``, state in ``state_dir(i)``),
        authenticated with key ``key`` (default: its own), connected to the gateway."""
        config = {
            "partition-id": i,
            "num-partitions": self.supernodes,
            "state-dir": str(self.state_dir(i)),
            **node_config,
        }
        command = supernode_command(
            self.creds, f"supernode-{i if key is None else key}", self.fleet_address,
            self.port + 100 + i, config,
        )  # fmt: skip
        return self._start(f"supernode-{i}", command)

    def restart_supernode(self, i: int, timeout: float = 2 * HEARTBEAT_WINDOW_S, **node_config):
        """Start SuperNode ``i`` again after it died. A node killed without signing off (kill
        -9, power loss) keeps its session on the SuperLink until Flower's heartbeat lapses
        (``HEARTBEAT_WINDOW_S``); until then Flower refuses the key ("Failed to activate
        SuperNode", the same words as for an unregistered key). Say so, and retry."""
        label = f"supernode-{i}"
        self.stop(label)  # whatever is left of the old one (its children)
        deadline, told = time.monotonic() + timeout, False
        while True:
            mark = (
                (self.logs / f"{label}.log").stat().st_size
                if (self.logs / f"{label}.log").exists()
                else 0
            )
            proc = self.start_supernode(i, **node_config)
            settle = time.monotonic() + 8.0
            while proc.poll() is None and time.monotonic() < settle:
                time.sleep(0.2)
            if proc.poll() is None:
                return proc
            with open(self.logs / f"{label}.log", "rb") as f:
                f.seek(mark)
                said = f.read().decode(errors="replace")
            if ACTIVATION_REFUSED not in said or time.monotonic() > deadline:
                raise RuntimeError(f"{label} did not start:\n{said[-2000:]}")
            if not told:
                print(
                    f"{label}: the SuperLink still holds the session of the node that died "
                    f"(Flower: '{ACTIVATION_REFUSED}'); it lets the key in again once that "
                    f"node's heartbeat lapses (up to {HEARTBEAT_WINDOW_S} s). Retrying every "
                    "5 s...",
                    flush=True,
                )
                told = True
            self.processes.pop(label, None)
            time.sleep(5)

    def stop(self, label: str, timeout: float = 5.0) -> None:
        """Stop ``label``'s process and everything below it, if it is still the process
        this federation started (its command line); a SuperNode's state is on disk, written
        atomically, so nothing is lost."""
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

    def up(self) -> list[str]:
        """Everything ``python -m pflower.deploy up`` starts, reusing what already runs
        (a second ``up`` on the same directory changes nothing); returns what it did."""
        said = []
        self.prepare()
        for label, start in (("superlink", self.start_superlink), ("gateway", self.start_gateway)):
            if self.running(label):
                said.append(f"{label}: already running (pid {self.entries[label]['pid']})")
            else:
                start()
                said.append(f"{label}: started (pid {self.entries[label]['pid']})")
        for i in range(self.supernodes):
            label = f"supernode-{i}"
            if self.running(label):
                said.append(f"{label}: already running (pid {self.entries[label]['pid']})")
                continue
            flower = self.register(i)
            said.append(f"{label}: key registered ({flower.splitlines()[-1] if flower else 'ok'})")
            self.start_supernode(i)
            said.append(f"{label}: started (pid {self.entries[label]['pid']})")
        return said

    def run(self, run_config: Mapping[str, object], app: str | os.PathLike, timeout: float = 600):
        """``flwr run <app> <connection> --stream`` with ``run_config`` overrides."""
        items = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        return subprocess.run(
            [_bin("flwr"), "run", str(app), self.name, "--stream", "--run-config", items],
            env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def submit(self, run_config: Mapping[str, object], app: str | os.PathLike,
               label: str = "run") -> subprocess.Popen:  # fmt: skip
        """``flwr run`` as ``run`` does, in the background: its output streams to
        ``logs/<label>.log`` (``progress`` reads it)."""
        items = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        with open(self.logs / f"{label}.log", "wb") as log:
            return subprocess.Popen(
                [_bin("flwr"), "run", str(app), self.name, "--stream", "--run-config", items],
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


def _toml(value: object) -> str:
    """A run-config value as ``flwr run --run-config`` expects it (TOML)."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pflower.deploy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cred = sub.add_parser("credentials", help="CA, SuperLink certificate, SuperNode keys")
    cred.add_argument("--out", required=True)
    cred.add_argument("--supernodes", type=int, default=2)
    cred.add_argument("--hosts", nargs="*", default=["localhost", "127.0.0.1", "::1"])
    conn = sub.add_parser("connection", help="a SuperLink connection for the flwr CLI")
    conn.add_argument("--credentials", required=True, help="the directory with ca.crt")
    conn.add_argument("--address", default="127.0.0.1:9094", help="the SuperLink's address")
    conn.add_argument("--name", default="pflower-deployment")
    conn.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME", "~/.flwr"))
    gate = sub.add_parser("gateway", help="serve the SuperLink's Fleet API only, on an address")
    gate.add_argument("--listen", required=True, help="host:port the devices reach")
    gate.add_argument("--superlink", default="127.0.0.1:9094", help="the SuperLink (loopback)")
    gate.add_argument("--credentials", required=True, help="ca.crt, server.pem, server.key")
    up = sub.add_parser("up", help="credentials, SuperLink, gateway, registered SuperNodes")
    up.add_argument("--dir", default="deploy")
    up.add_argument("--supernodes", type=int, default=2)
    up.add_argument("--port", type=int, default=9093, help="the gateway's (devices') port")
    down = sub.add_parser("down", help="stop what 'up' started (<dir>/pids.json, checked)")
    down.add_argument("--dir", default="deploy")
    args = parser.parse_args(argv)
    if args.command == "credentials":
        out = credentials(args.out, args.supernodes, tuple(args.hosts))
        print(f"credentials in {out}: ca.crt, server.pem, server.key, supernode-<i>[.pub]")
    elif args.command == "connection":
        path = connection(
            args.flwr_home, args.name, args.address, str(Path(args.credentials) / "ca.crt")
        )
        print(f"SuperLink connection {args.name!r} -> {args.address} written to {path}")
    elif args.command == "gateway":
        gateway(args.listen, args.superlink, Path(args.credentials).expanduser())
    elif args.command == "up":
        fed = Federation(args.dir, args.supernodes, args.port)
        try:
            for line in fed.up():
                print(line)
        except RuntimeError as err:  # Flower's own words, then what was started is stopped
            print(f"up failed: {err}", file=sys.stderr)
            fed.stop_all()
            sys.exit(1)
        print(
            f"SuperLink on 127.0.0.1:{fed.superlink_port} (operator side: Control API), "
            f"Fleet gateway on {fed.fleet_address} (devices), {args.supernodes} SuperNodes "
            f"(pids in {fed.root / 'pids.json'}, logs in {fed.logs}). Submit with:\n"
            f"  FLWR_HOME={fed.flwr_home} flwr run . {fed.name} --stream\n"
            f"Stop with: python -m pflower.deploy down --dir {args.dir}"
        )
    else:
        fed = Federation(args.dir)
        if not fed.entries:
            print(f"nothing recorded in {fed.root / 'pids.json'}")
        for label in sorted(fed.entries, key=lambda k: (k == "superlink", k == "gateway")):
            pid = fed.entries[label]["pid"]
            if fed.running(label):
                fed.stop(label)
                print(f"stopped {label} (pid {pid}) and the processes below it")
            else:
                print(f"{label}: pid {pid} is no longer this federation's process; left alone")
                fed.entries.pop(label)
                fed._save_pids()


if __name__ == "__main__":
    main()
