"""The deployment kit: credentials, the ``flwr`` CLI's connection, a Fleet gateway, and a
federation on loopback started and stopped by process id. The commands and the security model:
``pflower.deploy.command`` (``python -m pflower.deploy --help``).
"""

from __future__ import annotations

from pflower.deploy.command import main
from pflower.deploy.credentials import connection, credentials, node_keys
from pflower.deploy.federation import HEARTBEAT_WINDOW_S, SETTLE_S, Federation, SuperNodeDied
from pflower.deploy.flower_cli import (
    flower_error,
    flower_said,
    register,
    superlink_command,
    supernode_command,
)
from pflower.deploy.gateway import FLEET_API, gateway, gateway_command
from pflower.deploy.processes import alive, cmdline, descendants, is_ours, stop_tree
from pflower.flower.texts import ACTIVATION_REFUSED, ALREADY_REGISTERED

__all__ = [
    "ACTIVATION_REFUSED",
    "ALREADY_REGISTERED",
    "FLEET_API",
    "HEARTBEAT_WINDOW_S",
    "SETTLE_S",
    "Federation",
    "SuperNodeDied",
    "alive",
    "cmdline",
    "connection",
    "credentials",
    "descendants",
    "flower_error",
    "flower_said",
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
