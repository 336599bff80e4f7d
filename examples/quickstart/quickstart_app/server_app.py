"""quickstart_app: Flower's PyTorch quickstart ServerApp (``flower_server_app.py``) switched to
pflower: run config ``algorithm`` picks FedAlt, APFL or PFLEGO, each with the app's defaults
for it; only the shared parameters cross the wire (``shared_arrays``: APFL shares them all)."""

import torch
from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from pflower.personal_client import shared_arrays
from pflower.strategies import APFL, PFLEGO, FedAlt
from quickstart_app.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_train: float = context.run_config["fraction-train"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["lr"]
    algorithm: str = context.run_config["algorithm"]

    global_model = Net()
    arrays = shared_arrays(global_model, algorithm, personal="head")  # all but the head

    strategy = {"fedalt": FedAlt, "apfl": APFL, "pflego": PFLEGO}[algorithm](
        fraction_train=fraction_train, lr=lr
    )

    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
    )
    print("final personalized accuracy:", strategy.history[-1].evaluate["personal-accuracy"])

    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, "final_model.pt")
