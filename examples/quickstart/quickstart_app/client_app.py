"""quickstart_app: the ClientApp for pflower's strategies: your model, data and training
loop; pflower's client half of the server's algorithm around them (``flower_client_app.py``
is the quickstart's before pflower)."""

from flwr.app import Context

from pflower.personal_client import PersonalizedClient, personalized_client_app
from quickstart_app.task import Net, load_data
from quickstart_app.task import train as train_fn


def client_fn(context: Context) -> PersonalizedClient:
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, valloader = load_data(
        partition_id, num_partitions, context.run_config["batch-size"]
    )
    return PersonalizedClient(
        Net(),
        trainloader,
        valloader,
        algorithm=context.run_config["algorithm"],  # the server's strategy
        personal="head",  # stays on this client (APFL: a whole model of its own)
        train_fn=train_fn,  # your loop where the steps are plain SGD (FedAlt); else pflower's
        run_config={"local-epochs": context.run_config["local-epochs"]},
    )


app = personalized_client_app(client_fn)
