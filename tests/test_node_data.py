"""``dataset = "node"``: each device reads its own NumPy file (node config ``data-path``);
nothing is partitioned, so the core install (no datasets / flwr-datasets) runs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from pflower.client_app import make_job, parse_config
from pflower.config import ConfigError

NODE = {"dataset": "node", "input-shape": "2", "num-classes": 3, "model": "mlp"}


def blobs(path, n: int, seed: int, **arrays) -> str:
    """Three well-separated Gaussian classes in 2-D, ``n`` rows, saved as ``x`` / ``y``."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centres = np.array([[0.0, 4.0], [4.0, -2.0], [-4.0, -2.0]])
    x = (centres[y] + rng.normal(size=(n, 2))).astype(np.float32)
    np.savez(path, **(arrays or {"x": x, "y": y}))
    return str(path)


def job(overrides, node_config, partition_id=0):
    cfg = parse_config(frozenset({**NODE, **overrides}.items()))
    context = Context(
        run_id=1,
        node_id=partition_id + 1,
        state=RecordDict(),
        node_config={"partition-id": partition_id, "num-partitions": 2, **node_config},
        run_config={},
    )
    return make_job(cfg, context, 1)


def test_a_device_trains_on_its_own_file_split_by_test_fraction(tmp_path):
    path = blobs(tmp_path / "mine.npz", 50, seed=1)
    j = job({"test-fraction": 0.2}, {"data-path": path})
    assert len(j.train_loader.dataset) == 40 and len(j.test_loader.dataset) == 10
    x, y = j.train_loader.dataset.tensors
    rows = {tuple(r) for r in np.load(path)["x"].tolist()}
    assert {tuple(r) for r in x.tolist()} <= rows  # its own rows, nobody else's
    assert x.dtype == next(j.model.parameters()).dtype and y.dtype.is_floating_point is False


def test_a_fixed_train_test_assignment_is_kept(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.normal(size=(7, 2)),
        "y_train": np.array([0, 1, 2, 0, 1, 2, 0]),
        "x_test": rng.normal(size=(3, 2)),
        "y_test": np.array([2, 2, 1]),
    }
    path = blobs(tmp_path / "fixed.npz", 0, 0, **arrays)
    j = job({}, {"data-path": path})
    assert j.test_loader.dataset.tensors[1].tolist() == [2, 2, 1]
    assert np.allclose(j.test_loader.dataset.tensors[0].numpy(), arrays["x_test"], atol=1e-6)
    assert len(j.train_loader.dataset) == 7


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"input-shape": ""}, "input-shape"),
        ({"input-shape": "2,x"}, "input-shape"),
        ({"input-shape": "0"}, "input-shape"),
        ({"num-classes": 0}, "num-classes"),
    ],
)
def test_the_server_needs_the_shape_and_classes_stated(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_config(frozenset({**NODE, **overrides}.items()))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"x": np.zeros((4, 3)), "y": np.zeros(4, dtype=int)}, "'input-shape' = '2'"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, 2, 3])}, "labels must be integers in 0..2"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(5, dtype=int)}, "4 feature rows"),
        ({"x": np.full((4, 2), np.nan), "y": np.zeros(4, dtype=int)}, "NaN"),
        ({"features": np.zeros((4, 2))}, "expected 'x' and 'y'"),
    ],
)
def test_a_bad_file_names_the_node_config_key_and_the_path(tmp_path, content, message):
    path = blobs(tmp_path / "bad.npz", 0, 0, **content)
    with pytest.raises(ValueError, match=message) as err:
        job({}, {"data-path": path})
    assert "'data-path'" in str(err.value) and path in str(err.value)


def test_a_missing_file_or_key_says_what_to_set(tmp_path):
    with pytest.raises(FileNotFoundError, match="'data-path'.*no such file"):
        job({}, {"data-path": str(tmp_path / "absent.npz")})
    (tmp_path / "text.npz").write_text("not numpy")
    with pytest.raises(ValueError, match="not a NumPy .npz file"):
        job({}, {"data-path": str(tmp_path / "text.npz")})
    with pytest.raises(ValueError, match="--node-config .*data-path="):
        job({}, {})


def test_the_core_install_runs_a_federation_on_node_data(tmp_path):
    """With datasets, flwr-datasets, pyarrow and pandas unimportable (the core install), a
    FedAlt run on three devices' own files learns; a partitioned source names the extra."""
    paths = {i: blobs(tmp_path / f"device-{i}.npz", 60, seed=i) for i in range(3)}
    code = textwrap.dedent(
        f"""
        import sys

        # what `pip install pflower` (no extras) lacks: importing it fails, find_spec is None
        for name in ("datasets", "flwr_datasets", "pyarrow", "pandas"):
            sys.modules[name] = None
        from pflower.testbed.local_grid import run_local

        run = {{**{NODE!r}, "algorithm": "fedalt", "pretrain-rounds": 0,
               "num-server-rounds": 3, "evaluate-every": 3, "fraction-train": 1.0,
               "lr": 0.1, "outputs-dir": {str(tmp_path / "out")!r}}}
        node_configs = {{i: {{"data-path": p}} for i, p in {paths!r}.items()}}
        report = run_local(run, 3, node_configs=node_configs)
        print("ACCURACY", report.final["personal-accuracy"])
        from pflower.client_app import parse_config
        from pflower.task.data import load_client_data

        digits = parse_config(frozenset({{"dataset": "digits", "partitioner": "iid"}}.items()))
        try:
            load_client_data(digits, 0, 2)
        except ImportError as err:
            print("MISSING", err)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(out.stdout.split("ACCURACY")[1].split()[0])
    assert accuracy > 0.8, out.stdout  # chance: 1/3
    assert "pip install 'pflower[data]'" in out.stdout.split("MISSING")[1]
