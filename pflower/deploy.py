"""Credentials for a deployment: a self-signed CA, the SuperLink's TLS certificate, and one
EC key pair per SuperNode for node authentication; and the Flower configuration that lets
``flwr run`` / ``flwr supernode register`` reach that SuperLink.

    python -m pflower.deploy credentials --out deploy/credentials --supernodes 2
    python -m pflower.deploy connection --credentials deploy/credentials --address 127.0.0.1:9093
    python -m pflower.deploy up --dir deploy --supernodes 2     # all of it, on loopback
    python -m pflower.deploy down --dir deploy

Files under ``--out``: ``ca.crt`` (give it to every SuperNode and to the ``flwr`` CLI),
``server.pem`` / ``server.key`` (the SuperLink's certificate for ``--host`` names, signed by the
CA; the key never leaves the SuperLink), ``supernode-<i>`` / ``supernode-<i>.pub`` (SuperNode
i's private key, OpenSSH PEM, stays on the device; its public key is what the operator
registers with ``flwr supernode register``). For prototyping and loopback tests; production
deployments should use their organisation's PKI.
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
    Flower configuration the ``flwr`` CLI reads (``FLWR_HOME``, default ``~/.flwr``)."""
    home = Path(flwr_home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    text = path.read_text() if path.exists() else '[superlink]\ndefault = "local"\n'
    header = f"[superlink.{name}]"
    kept, skipping = [], False
    for line in text.splitlines():  # drop an older section of the same name
        if line.strip().startswith("["):
            skipping = line.strip() == header
        if not skipping:
            kept.append(line)
    section = [
        "",
        header,
        f'address = "{address}"',
        f'root-certificates = "{Path(ca).expanduser().resolve()}"',
        "insecure = false",
    ]
    _write(path, ("\n".join(kept).rstrip() + "\n" + "\n".join(section) + "\n").encode())
    return path


def _bin(name: str) -> str:
    """A Flower executable: next to this Python first (the virtual environment's bin/)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def superlink_command(creds: Path, port: int, database: Path) -> list[str]:
    """``flower-superlink`` with TLS and CLI-managed SuperNode authentication: only SuperNodes
    whose public key was registered (``flwr supernode register``) may connect."""
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


def register(creds: Path, key: str, connection_name: str, env: Mapping[str, str]) -> None:
    """Register SuperNode ``key``'s public key with the SuperLink (``flwr supernode
    register``), as the operator does once per device."""
    subprocess.run(
        [_bin("flwr"), "supernode", "register", str(creds / f"{key}.pub"), connection_name],
        env=dict(env),
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )


class Federation:
    """A SuperLink and its SuperNodes on loopback, as processes this object started and
    stops (by their process ids): what ``python -m pflower.deploy up`` runs and what the
    deployment test drives.

    Layout under ``root``: ``credentials/``, ``flwr-home/`` (the ``flwr`` CLI's
    configuration, with the connection ``name``), ``supernode-<i>/state`` (each device's
    personal state), ``logs/``, ``pids.json``.
    """

    def __init__(self, root: str | os.PathLike, supernodes: int = 2, port: int = 9093,
                 name: str = "pflower-deployment") -> None:  # fmt: skip
        self.root = Path(root).expanduser().resolve()
        self.supernodes, self.port, self.name = supernodes, port, name
        self.creds = self.root / "credentials"
        self.flwr_home = self.root / "flwr-home"
        self.logs = self.root / "logs"
        self.processes: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }

    def state_dir(self, i: int) -> Path:
        return self.root / f"supernode-{i}" / "state"

    def prepare(self) -> None:
        """Credentials (one key more than SuperNodes: an unregistered device) and the
        connection for the ``flwr`` CLI."""
        if not (self.creds / "ca.crt").exists():
            credentials(self.creds, self.supernodes + 1)
        connection(self.flwr_home, self.name, f"127.0.0.1:{self.port}", str(self.creds / "ca.crt"))
        self.logs.mkdir(parents=True, exist_ok=True)

    def _start(self, label: str, command: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{label}.log", "ab") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                start_new_session=True,
            )  # fmt: skip
        self.processes[label] = proc
        self._save_pids()
        return proc

    def start_superlink(self, wait: float = 60.0) -> None:
        self._start(
            "superlink", superlink_command(self.creds, self.port, self.root / "superlink.db")
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # ready when the CLI can list its SuperNodes
            probe = subprocess.run(
                [_bin("flwr"), "supernode", "ls", self.name], env=self.env,
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if probe.returncode == 0:
                return
            if self.processes["superlink"].poll() is not None:
                break
            time.sleep(1)
        raise RuntimeError(f"the SuperLink did not come up; see {self.logs / 'superlink.log'}")

    def register(self, i: int) -> None:
        register(self.creds, f"supernode-{i}", self.name, self.env)

    def start_supernode(self, i: int, key: int | None = None, **node_config) -> subprocess.Popen:
        """SuperNode ``i`` (partition i of ``supernodes``, state in ``state_dir(i)``),
        authenticated with key ``key`` (default: its own)."""
        config = {
            "partition-id": i,
            "num-partitions": self.supernodes,
            "state-dir": str(self.state_dir(i)),
            **node_config,
        }
        command = supernode_command(
            self.creds, f"supernode-{i if key is None else key}", f"127.0.0.1:{self.port}",
            self.port + 100 + i, config,
        )  # fmt: skip
        return self._start(f"supernode-{i}", command)

    def stop(self, label: str, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s (a SuperNode deregisters at once but its
        process can linger; its state is on disk, written atomically, so nothing is lost)."""
        proc = self.processes.pop(label, None)
        if proc is None:
            return
        _terminate(proc.pid, timeout)
        proc.wait(timeout)
        self._save_pids()

    def stop_all(self) -> None:
        for label in [k for k in self.processes if k != "superlink"] + ["superlink"]:
            self.stop(label)

    def run(self, run_config: Mapping[str, object], app: str | os.PathLike, timeout: float = 600):
        """``flwr run <app> <connection> --stream`` with ``run_config`` overrides."""
        items = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        return subprocess.run(
            [_bin("flwr"), "run", str(app), self.name, "--stream", "--run-config", items],
            env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def _save_pids(self) -> None:
        pids = {k: p.pid for k, p in self.processes.items() if p.poll() is None}
        _write(self.root / "pids.json", json.dumps(pids).encode())


def _terminate(pid: int, timeout: float) -> None:
    """SIGTERM the process group ``pid`` leads, then SIGKILL what is left after
    ``timeout`` (the SuperLink and SuperNodes start child processes of their own)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


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
    conn.add_argument("--address", default="127.0.0.1:9093", help="the SuperLink's address")
    conn.add_argument("--name", default="pflower-deployment")
    conn.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME", "~/.flwr"))
    up = sub.add_parser("up", help="credentials, SuperLink, registered SuperNodes on loopback")
    up.add_argument("--dir", default="deploy")
    up.add_argument("--supernodes", type=int, default=2)
    up.add_argument("--port", type=int, default=9093)
    down = sub.add_parser("down", help="stop what 'up' started (by the pids in <dir>/pids.json)")
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
    elif args.command == "up":
        fed = Federation(args.dir, args.supernodes, args.port)
        fed.prepare()
        fed.start_superlink()
        for i in range(args.supernodes):
            fed.register(i)
            fed.start_supernode(i)
        print(
            f"SuperLink on 127.0.0.1:{args.port} and {args.supernodes} SuperNodes running "
            f"(pids in {fed.root / 'pids.json'}, logs in {fed.logs}). Submit with:\n"
            f"  FLWR_HOME={fed.flwr_home} flwr run . {fed.name} --stream\n"
            f"Stop with: python -m pflower.deploy down --dir {args.dir}"
        )
    else:
        pids_file = Path(args.dir).expanduser() / "pids.json"
        pids = json.loads(pids_file.read_text()) if pids_file.exists() else {}
        for label in sorted(pids, key=lambda k: k == "superlink"):  # the SuperLink last
            _terminate(int(pids[label]), 5.0)
            print(f"stopped {label} (pid {pids[label]})")
        if pids_file.exists():
            pids_file.unlink()


if __name__ == "__main__":
    main()
