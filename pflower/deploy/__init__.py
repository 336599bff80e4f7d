"""The deployment kit: credentials (a self-signed CA, the SuperLink's TLS certificate, one EC
key pair per SuperNode for node authentication), the ``flwr`` CLI's connection, a Fleet
gateway, and a federation on loopback started and stopped by process id.

    python -m pflower.deploy credentials --out deploy/credentials --supernodes 2
    python -m pflower.deploy connection --credentials deploy/credentials --address 127.0.0.1:9094
    python -m pflower.deploy gateway --listen 0.0.0.0:9093 --superlink 127.0.0.1:9094 \
        --credentials deploy/credentials
    python -m pflower.deploy up --dir deploy --supernodes 2     # all of it, on loopback
    python -m pflower.deploy down --dir deploy

Security model (docs/deploy.md, "Who can do what"): the SuperLink listens on loopback only, since
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

from pflower.deploy.command import main
from pflower.deploy.credentials import connection, credentials, node_keys
from pflower.deploy.federation import (
    ACTIVATION_REFUSED,
    ALREADY_REGISTERED,
    HEARTBEAT_WINDOW_S,
    Federation,
    register,
    superlink_command,
    supernode_command,
)
from pflower.deploy.gateway import FLEET_API, gateway, gateway_command
from pflower.deploy.processes import alive, cmdline, descendants, is_ours, stop_tree

__all__ = [
    "ACTIVATION_REFUSED",
    "ALREADY_REGISTERED",
    "FLEET_API",
    "HEARTBEAT_WINDOW_S",
    "Federation",
    "alive",
    "cmdline",
    "connection",
    "credentials",
    "descendants",
    "gateway",
    "gateway_command",
    "is_ours",
    "main",
    "node_keys",
    "register",
    "stop_tree",
    "superlink_command",
    "supernode_command",
]
