"""Every pflower strategy keeps every array's shape and dtype, a 0-dim (scalar) shared
parameter included: in every message it sends and in the final shared parameters (issue 31,
item 6; RobustFedAvg in tests/test_robust_fedavg.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pflower.client_app import build_client_app
from pflower.strategies import ALGORITHMS
from pflower.strategies.fedalt import HEAD_ALIASES
from pflower.testbed.local_grid import run_local


class ScaledClassifier(nn.Module):
    """``temperature * (tanh(x W + b) V + c)``: ``temperature`` is a 0-dim shared parameter,
    ``readout.*`` the personal part (``split-patterns``)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        flat = 1
        for s in input_shape:
            flat *= s
        self.encoder = nn.Linear(flat, 16)
        self.temperature = nn.Parameter(torch.tensor(1.0))
        self.readout = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.temperature * self.readout(torch.tanh(self.encoder(x.flatten(1))))


#: what some algorithms need besides the common keys (as in tests/test_wire.py)
EXTRA = {
    "l2gd": {"local-steps": 3},
    "pflego": {"local-steps": 2},
    "async-ffgg": {"pretrain-rounds": 0},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_scalar_shared_parameter_stays_0_dim(algorithm, tmp_path):
    overrides = {
        "algorithm": algorithm,
        "dataset": "digits",
        "partitioner": "iid",
        "model": f"{__name__}:ScaledClassifier",
        # FedRep / FedPer: the head split, i.e. `readout`
        **({} if algorithm in HEAD_ALIASES else {"split-patterns": "readout.*"}),
        "pretrain-rounds": 1 if ALGORITHMS[algorithm].wire_split == "config" else 0,
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "evaluate-every": 2,
        "finetune-epochs": 1,
        "outputs-dir": str(tmp_path),
        **EXTRA.get(algorithm, {}),
    }
    app = build_client_app(overrides)
    received: dict[str, set[tuple]] = {}

    def recording(msg, context):
        # every array of a record that carries model parameters (weights, gradients,
        # controls): one layout per name over the whole run
        for record in msg.content.array_records.values():
            if "temperature" in record:
                for name, array in record.items():
                    received.setdefault(name, set()).add((tuple(array.shape), array.dtype))
        return app(msg, context)

    report = run_local(overrides, 3, client_app=recording)
    shared = report.shared or {}
    if algorithm != "local":  # nothing is shared
        assert received, "no message carried the shared scalar"
        assert received["temperature"] == {((), "float32")}, received["temperature"]
        for name, layouts in received.items():
            assert len(layouts) == 1, (name, layouts)
            assert {dtype for _, dtype in layouts} == {"float32"}, (name, layouts)
        assert shared["temperature"].shape == torch.Size([]), shared["temperature"].shape
        assert all(t.dtype == torch.float32 for t in shared.values())
