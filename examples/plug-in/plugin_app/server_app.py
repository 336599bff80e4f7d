"""The ServerApp: Flower's quickstart, with pflower's FedAlt as the strategy."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from pflower.strategies import FedAlt
from pflower.task.split import get_tensors, make_split
from plugin_app.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    model = Net()
    shared = make_split(model, patterns=["head.*"]).shared  # only these cross the wire
    strategy = FedAlt(fraction_train=1.0, lr=float(context.run_config["lr"]))
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(get_tensors(model, shared)),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
    print("final personalized accuracy:", strategy.history[-1].evaluate.get("personal-accuracy"))
    context.state["final"] = result.arrays  # e.g. save it
