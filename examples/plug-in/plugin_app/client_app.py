"""The ClientApp: your NumPyClient-style client_fn, with pflower's client half inside.

The only pflower lines: ``PersonalizedNumPyClient`` (shares ``body.*``, keeps ``head.*`` in the
node's state) and ``numpy_client_app`` (speaks the message API pflower's strategies use).
"""

from __future__ import annotations

from flwr.app import Context

from pflower.numpy_client import PersonalizedNumPyClient, numpy_client_app
from pflower.task.split import make_split
from plugin_app.task import Net, load_data


def client_fn(context: Context) -> PersonalizedNumPyClient:
    model = Net()
    train, test = load_data(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    return PersonalizedNumPyClient(
        model,
        make_split(model, patterns=["head.*"]),  # personal: the head
        train,
        test,
        algorithm="fedalt",
        run_config={"lr": float(context.run_config["lr"]), "personal-epochs": 1},
        # on a device: state_dir=context.node_config["state-dir"] keeps it on disk
        state=context.state,
    )


app = numpy_client_app(client_fn)
