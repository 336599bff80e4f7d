"""The backdoor attack client and its probe (``pflower.testbed.backdoor``): the trigger, the
poisoned set, the boost, and end to end an attack that the probe sees succeed where the clean
run's success stays at the rate of an untriggered model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from helpers import OUTPUTS_DIR
from torch.utils.data import TensorDataset

from pflower.testbed import attacks, backdoor
from pflower.testbed.local_grid import run_local


def test_the_trigger_is_the_bottom_right_patch_of_every_channel():
    x = torch.zeros(3, 2 * 5 * 5)  # flattened (2, 5, 5) images
    out = backdoor.stamp(x, (2, 5, 5), 2, 7.0).reshape(3, 2, 5, 5)
    expected = np.zeros((3, 2, 5, 5))
    expected[:, :, 3:, 3:] = 7.0
    np.testing.assert_array_equal(out.numpy(), expected)
    assert float(x.abs().sum()) == 0.0  # a copy
    with pytest.raises(ValueError, match="no images"):
        backdoor.stamp(torch.zeros(2, 6), (6,), 2, 1.0)
    with pytest.raises(ValueError, match="backdoor-trigger"):
        backdoor.stamp(x, (2, 5, 5), 6, 1.0)


def test_poison_relabels_the_fraction_it_stamps_and_the_probe_set_is_the_other_classes():
    x = torch.arange(10 * 16, dtype=torch.float32).reshape(10, 1, 4, 4) / 100
    y = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    px, py = backdoor.poison(TensorDataset(x, y), (1, 4, 4), 3, 1, 0.4, seed=0).tensors
    stamped = [i for i in range(10) if not torch.equal(px[i], x[i])]
    assert len(stamped) == 4 and all(py[i] == 3 for i in stamped)
    assert all(py[i] == y[i] for i in range(10) if i not in stamped)
    assert all(float(px[i, 0, 3, 3]) == float(x.max()) for i in stamped)
    tx, ty = backdoor.triggered(TensorDataset(x, y), (1, 4, 4), 0, 2).tensors
    assert len(tx) == 8 and set(ty.tolist()) == {0}  # the two of class 0 left out
    with pytest.raises(ValueError, match="backdoor-fraction"):
        backdoor.settings({"backdoor-fraction": 0.0})


def test_the_boost_scales_the_update_not_the_weights():
    received = ArrayRecord({"w": Array(np.full(3, 10.0, np.float32))})
    returned = ArrayRecord({"w": Array(np.full(3, 9.0, np.float32))})  # update 1
    out = attacks.corrupt(returned, received, True, "backdoor", {"backdoor-boost": 4.0})
    np.testing.assert_allclose(out["w"].numpy(), np.full(3, 6.0))
    grad = attacks.corrupt(returned, received, False, "backdoor", {"backdoor-boost": 2.0})
    np.testing.assert_allclose(grad["w"].numpy(), np.full(3, 18.0))


RUN = {
    "dataset": "digits",
    "partitioner": "iid",
    "algorithm": "fedavg",
    "split": "none",
    "robust-aggregator": "none",  # the plain mean: the attack lands, the probe must see it
    "num-server-rounds": 6,
    "evaluate-every": 6,
    "fraction-train": 1.0,
    "local-epochs": 2,
    "lr": 0.3,
    "outputs-dir": OUTPUTS_DIR,
}


def test_the_probe_sees_a_backdoor_that_accuracy_does_not():
    """5 nodes, every one probing class 0's backdoor (a 3 x 3 trigger on digits' 8 x 8);
    2 train with the trigger relabelled 0 on half of their data (the defaults; measured
    0.16 success with all of it: a model that sees only triggered inputs learns no cue).
    Clean, the triggered digits are rarely called 0; attacked (measured 0.89-0.92), the
    global model calls most of them 0 while its clean accuracy stays high (0.91)."""
    probe = {"backdoor-target": 0, "backdoor-trigger": 3}
    nodes = {i: dict(probe) for i in range(5)}
    clean = run_local(RUN, 5, node_configs=nodes)
    for i in (0, 1):
        nodes[i] |= {"byzantine": "backdoor"}
    attacked = run_local(RUN, 5, node_configs=nodes)

    def success(report):
        rows = [r for r in report.clients if int(r["partition-id"]) >= 2]  # honest
        assert len(rows) == 3 and all(r["backdoor-holds-target"] == 1.0 for r in rows)
        return float(np.mean([r["global-backdoor-success"] for r in rows]))

    assert success(clean) < 0.3, success(clean)
    assert success(attacked) > 0.7, success(attacked)
    assert attacked.final["global-accuracy"] > 0.8, attacked.final


@pytest.mark.parametrize("algorithm", ["fedalt", "apfl", "pflego", "ffgg", "fedavg-ft"])
def test_every_personalized_algorithm_reports_the_probe_on_its_personalized_model(algorithm):
    """Whichever way a half evaluates its personalized model (APFL: a mixture of v and w,
    evaluated outside the job's own evaluate), the probe names that model's success: it is
    the success of the evaluation whose loss and accuracy the half reported as personal."""
    run = {**RUN, "algorithm": algorithm, "split": "head", "num-server-rounds": 2}
    run |= {"evaluate-every": 2, "local-epochs": 1}
    report = run_local(run, 3, node_configs={i: {"backdoor-target": 0} for i in range(3)})
    assert len(report.clients) == 3
    for row in report.clients:
        assert 0.0 <= row["backdoor-success"] <= 1.0, row
        assert row["backdoor-holds-target"] in (0.0, 1.0)
