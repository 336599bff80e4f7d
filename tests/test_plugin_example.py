"""examples/plug-in: a plain Flower app using pflower's FedAlt and NumPyClient adapter."""

from __future__ import annotations

import sys
from pathlib import Path

from flwr.app import Context, RecordDict

from pflower.testbed.local_grid import LocalGrid

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plug-in"


def test_plugin_example_trains_and_keeps_heads_on_clients(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m.startswith("plugin_app")]:
        monkeypatch.delitem(sys.modules, name)
    from plugin_app.client_app import app as client_app
    from plugin_app.server_app import main

    config = {"num-server-rounds": 4, "lr": 0.1}  # the app's [tool.flwr.app.config]
    grid = LocalGrid(client_app, 5, run_config=config)
    main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    accuracy = float(capsys.readouterr().out.split("final personalized accuracy:")[-1])
    assert accuracy > 0.8  # two classes per client
    for context in grid.contexts.values():  # each head stayed in its node's state
        assert "pflower.personal" in context.state
