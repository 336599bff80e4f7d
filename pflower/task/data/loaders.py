"""A client's data: its train / test split (fixed by the source, or stratified by label),
cached within a byte budget, and torch loaders that slice whole minibatches.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data._utils.collate import default_convert

from pflower.task import linear, node_data
from pflower.task.data.partitioning import _source

if TYPE_CHECKING:
    from pflower.settings import RunSettings


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

    def items(self) -> list[tuple]:
        """The cached ``(arguments, result)`` pairs, least recently used first."""
        with self.lock:
            return list(self.entries.items())

    def adopt(self, items) -> None:
        """Take ``(arguments, result)`` pairs computed elsewhere (``fn``'s, in a forked
        ClientApp: ``pflower.deploy.warm_exec``) as if computed here."""
        with self.lock:
            for args, value in items:
                if args not in self.entries:
                    self.entries[args] = value
                    self.nbytes += self._size(value)
            self._trim()


@_ByteBudgetCache
def client_arrays(
    cfg: RunSettings, partition_id: int, num_partitions: int, data_path: str | None = None
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
    cfg: RunSettings,
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


def one_pass(loader: DataLoader):
    """The minibatches of one pass over ``loader``. For the loaders ``batched`` makes (in
    memory, no workers) the slices themselves, with the draws the DataLoader would make
    from its generator (a base seed per pass, then the sampler's permutation): the same
    batches, bit for bit, without the DataLoader's ~0.1 ms of machinery per batch, which
    on ~80-example clients was a tenth of the training step. Any other loader
    is iterated as it is."""
    if not _is_batched(loader):
        yield from loader
        return
    # _BaseDataLoaderIter.__init__: its base seed, drawn before the sampler's first draw
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    tensors = loader.dataset.tensors
    for idx in loader.sampler:
        yield tuple(t[idx] for t in tensors)


def whole_set(loader: DataLoader, chunk: int):
    """The whole local set once, in order, in chunks of at most ``chunk`` examples: for the
    passes whose result is a mean over every example (a full gradient, PFLEGO's features),
    where the minibatch size and order of SGD have no part. For the loaders ``batched``
    makes, the chunks are slices of the tensors (views, nothing copied) and the loader's
    generator is not drawn from; any other loader is iterated as ``one_pass`` does."""
    if not _is_batched(loader):
        yield from one_pass(loader)
        return
    tensors = loader.dataset.tensors
    n = len(tensors[0])
    for start in range(0, n, chunk):
        yield tuple(t[start : start + chunk] for t in tensors)


def _is_batched(loader) -> bool:
    """Whether ``loader`` is one ``batched`` made: in memory, no workers, no collation."""
    return (
        isinstance(loader, DataLoader)
        and isinstance(loader.sampler, _IndexBatches)
        and isinstance(loader.dataset, TensorDataset)
        and loader.batch_size is None
        and loader.num_workers == 0
        and loader.collate_fn is default_convert
    )


#: the input's and the label's field names tried in a dict batch, in order (Flower's
#: quickstarts and ``flwr-datasets``' image sets first: ``img`` / ``image`` and ``label``)
INPUT_KEYS = ("img", "image", "x", "pixel_values", "input", "inputs", "features")
LABEL_KEYS = ("label", "labels", "y", "target", "targets", "fine_label")


class BatchLayoutError(ValueError):
    """A batch pflower cannot read as ``(input, label)``; the message names the layout found
    and the fix."""


def _layout(batch) -> str:
    if isinstance(batch, Mapping):
        return f"a dict with keys {sorted(map(str, batch))}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return f"a {type(batch).__name__}"


class PairBatches:
    """A loader of the user's, read as ``(input, label)`` batches: a pair (tuple or list of
    two) as it is, a dict by its fields (``keys``: the input's and the label's names; None:
    the first of ``INPUT_KEYS`` and of ``LABEL_KEYS`` the first dict batch has). Anything
    else is refused at its first batch (``BatchLayoutError``, one line: what was found, what
    to pass). Length and ``dataset`` are the loader's; ``source`` is the loader itself, which
    a training or evaluation loop of the user's gets as it is."""

    def __init__(self, loader, keys: tuple[str, str] | None = None) -> None:
        if keys is not None and (len(keys) != 2 or not all(isinstance(k, str) for k in keys)):
            raise ValueError(f"batch_keys = {keys!r}: must be (input key, label key)")
        self.source, self.keys = loader, keys

    def __len__(self) -> int:
        return len(self.source)

    @property
    def dataset(self):
        return self.source.dataset

    def __iter__(self):
        return (self.pair(batch) for batch in self.source)

    def pair(self, batch):
        if isinstance(batch, Mapping):
            x_key, y_key = self.keys or self._find(batch)
            missing = [k for k in (x_key, y_key) if k not in batch]
            if missing:
                raise BatchLayoutError(
                    f"a batch is {_layout(batch)}, without {missing}: pass batch_keys=(input "
                    "key, label key) to PersonalizedClient"
                )
            return batch[x_key], batch[y_key]
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise BatchLayoutError(
            f"a batch is {_layout(batch)}: pflower reads (input, label) pairs or dicts with "
            "named fields; make the loader yield one of them (batch_keys=(input key, label "
            "key) names a dict's)"
        )

    def _find(self, batch: Mapping) -> tuple[str, str]:
        x_key = next((k for k in INPUT_KEYS if k in batch), None)
        y_key = next((k for k in LABEL_KEYS if k in batch), None)
        if x_key is None or y_key is None:
            raise BatchLayoutError(
                f"a batch is {_layout(batch)}: pflower looks for the input in one of "
                f"{list(INPUT_KEYS)} and the label in one of {list(LABEL_KEYS)}; pass "
                "batch_keys=(input key, label key) to PersonalizedClient"
            )
        self.keys = (x_key, y_key)  # found once: every batch of a loader has one layout
        return self.keys


def source_loader(loader):
    """The user's own loader behind a ``PairBatches`` (any other loader as it is)."""
    return loader.source if isinstance(loader, PairBatches) else loader


def as_pairs(loader, keys: tuple[str, str] | None = None):
    """``loader`` as ``(input, label)`` batches: pflower's own loaders (``batched``) as they
    are (they slice pairs already), any other in a ``PairBatches``."""
    if keys is None and _is_batched(loader):
        return loader
    return PairBatches(loader, keys)
