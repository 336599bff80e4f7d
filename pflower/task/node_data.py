"""A device's own data: ``dataset = "node"``.

Each SuperNode reads one NumPy file from its own disk, named by its node config key
``data-path``. Nothing is partitioned — the file *is* the client's data — so this source needs
neither ``datasets`` nor ``flwr-datasets``: the core install (``pip install pflower``) runs
it. The other sources simulate devices by partitioning one data set; this one is what a real
device has.

The file, written with ``numpy.savez``:

- ``x``, ``y``: every row; the client splits them into train and test by ``test-fraction``
  (stratified by label, as every source does), or
- ``x_train``, ``y_train``, ``x_test``, ``y_test``: a fixed assignment, kept as it is.

Features have the shape ``(rows, *input-shape)`` and any real dtype (cast to the model's);
labels are integers in ``0..num-classes-1`` for classification, real numbers for regression.
The server has no data to inspect, so the run config states what the model needs:
``input-shape`` (e.g. ``"1,28,28"``) and ``num-classes``.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pflower.settings import RunSettings

#: the node config key naming the device's data file
DATA_PATH = "data-path"


def _where(path: str) -> str:
    return f"node config {DATA_PATH!r} = {path!r}"


def read(cfg: RunSettings, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The device's features, labels and fixed test mask (None: split by ``test-fraction``),
    checked against the run's ``input-shape``, ``num-classes`` and task."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{_where(path)}: no such file")
    try:
        with np.load(p, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ValueError(f"{_where(path)}: not a NumPy .npz file ({err})") from err
    if {"x", "y"} <= arrays.keys():
        x, y, fixed = arrays["x"], arrays["y"], None
    elif {"x_train", "y_train", "x_test", "y_test"} <= arrays.keys():
        x = np.concatenate([arrays["x_train"], arrays["x_test"]])
        y = np.concatenate([arrays["y_train"], arrays["y_test"]])
        fixed = np.arange(len(y)) >= len(arrays["y_train"])
    else:
        raise ValueError(
            f"{_where(path)}: holds {sorted(arrays)}; expected 'x' and 'y', or 'x_train', "
            "'y_train', 'x_test' and 'y_test'"
        )
    _check(cfg, path, x, y)
    regression = cfg.effective_task == "regression"
    x = x.astype(np.float32, copy=False)
    y = y.astype(np.float32 if regression else np.int64, copy=False)
    return x, y, fixed


def _check(cfg: RunSettings, path: str, x: np.ndarray, y: np.ndarray) -> None:
    shape = cfg.node_input_shape
    if x.ndim < 1 or tuple(x.shape[1:]) != shape:
        raise ValueError(
            f"{_where(path)}: features of shape {tuple(x.shape)}; key 'input-shape' = "
            f"{cfg.input_shape!r} expects (rows, {', '.join(map(str, shape))})"
        )
    if len(y) != len(x) or y.ndim != 1:
        raise ValueError(
            f"{_where(path)}: {len(x)} feature rows but labels of shape {tuple(y.shape)}"
        )
    if len(y) == 0:
        raise ValueError(f"{_where(path)}: no rows")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{_where(path)}: features of dtype {x.dtype}; must be real numbers")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise ValueError(f"{_where(path)}: features hold NaN or infinite values")
    if cfg.effective_task == "regression":
        if not np.issubdtype(y.dtype, np.number) or not np.isfinite(y).all():
            raise ValueError(f"{_where(path)}: regression targets must be finite numbers")
        return
    whole = np.issubdtype(y.dtype, np.integer) or (
        np.issubdtype(y.dtype, np.floating) and np.isfinite(y).all() and (y == np.round(y)).all()
    )
    if not whole or y.min() < 0 or y.max() >= cfg.num_classes:
        raise ValueError(
            f"{_where(path)}: labels must be integers in 0..{cfg.num_classes - 1} "
            f"(key 'num-classes' = {cfg.num_classes}); found {y.dtype} in "
            f"{y.min()}..{y.max()}"
        )
