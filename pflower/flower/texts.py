"""What Flower's processes and its ``flwr`` CLI print that the deployment kit reads
(``pflower.deploy``): to explain Flower's errors in one line, to restart a node Flower
refused for a while (``Federation.start_supernodes``), and the Fleet API's paths, which the
kit's gateway forwards (``deploy.gateway``).

Flower promises none of these words; each is listed with where Flower 1.41 and 1.42 say it
(``tests/test_flower_boundary.py`` finds every one in the installed Flower's source). When an
upgrade rewords one, nothing breaks silently: the kit no longer recognises that case and
reports Flower's own error (``flower_error``: its last error record, unexplained) instead of
its explanation, a node refused while the SuperLink holds a dead node's session fails ``up``
with Flower's message instead of being retried, and a moved Fleet API is refused by the
gateway (403, logged with the path). Checked on Flower
``pflower.flower.CHECKED``.
"""

from __future__ import annotations

import re

#: the ``--database`` that gives a SuperLink Flower's in-memory state
#: (``flwr.supercore.constant.FLWR_IN_MEMORY_DB_NAME``, also its default)
FLWR_IN_MEMORY_DB_NAME = ":flwr-in-memory:"
#: Flower's answer when a public key is registered a second time (the SuperLink's link state:
#: "Public key already in use")
ALREADY_REGISTERED = "already in use"
#: Flower's answer to a SuperNode whose key still has a session the SuperLink counts as
#: online (a node killed without signing off, until its heartbeat lapses;
#: ``flwr/supercore/error/catalog.py``)
ACTIVATION_REFUSED = "Failed to activate SuperNode"
#: what Flower's SuperNode logs once the SuperLink has activated it (``SuperNode ID: <id>``,
#: ``flwr/supernode/start_client_internal.py``)
ACTIVATED = "SuperNode ID:"
#: Flower's variable for a SuperExec's task poll (``flwr/supercore/superexec/run_superexec.py``)
TASK_POLL_VARIABLE = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
#: the paths of Flower's Fleet API, what a SuperNode calls: the deployment kit's gateway
#: forwards these and nothing else (``flwr/superlink/routers/fleet/middlewares.py``)
FLEET_API = "/v1/fleet/"
#: the words above, as they are in Flower's source (checked against the installed Flower)
FLOWER_SAYS = (
    FLWR_IN_MEMORY_DB_NAME, ALREADY_REGISTERED, ACTIVATION_REFUSED, ACTIVATED, TASK_POLL_VARIABLE,
    FLEET_API,
)  # fmt: skip

#: what a process says when the port it binds is held (Python's words, as uvicorn passes
#: them on: not Flower's)
PORT_TAKEN = "address already in use"
#: the characters of the box the ``flwr`` CLI (rich) draws around its errors
BOX = "╭╮╰╯│─┌┐└┘├┤━┃"
#: a line of Flower's log that starts a new record ("ERROR :     Exit Code: 305")
LOG_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*")
