"""Credentials: a self-signed CA, the SuperLink's TLS certificate, one EC key pair per
SuperNode for node authentication, and the ``flwr`` CLI's connection that trusts the CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
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
    make it the default; written by Flower's own configuration writer
    (``pflower.flower.cli.write_connection``)."""
    from pflower.flower.cli import write_connection

    home = Path(flwr_home).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("FLWR_HOME")
    os.environ["FLWR_HOME"] = str(home)  # Flower's writer finds the file through it
    try:
        root = str(Path(ca).expanduser().resolve())
        write_connection(name, address, root)
    finally:
        if before is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = before
    return home / "config.toml"
