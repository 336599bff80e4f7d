"""Partitioners of pflower's own, on top of flwr-datasets'."""

from __future__ import annotations

import numpy as np
from flwr_datasets.partitioner import PathologicalPartitioner


class RoundRobinPartitioner(PathologicalPartitioner):
    """PFLEGO's round-robin dealing (Nikoloutsopoulos et al., App. A.2).

    Classes are assigned to clients as by ``PathologicalPartitioner`` (K per client); then,
    for each class, its samples are shuffled and dealt one at a time to the clients that own
    the class, in turn, until none is left. Every owner of a class gets the same number of
    its samples, plus or minus one.
    """

    def _determine_partition_id_to_indices_if_needed(self) -> None:
        if self._partition_id_to_indices_determined:
            return
        self._determine_partition_id_to_unique_labels()
        self._count_partitions_having_each_unique_label()
        labels = np.asarray(self.dataset[self._partition_by])
        self._check_correctness_of_unique_label_to_times_used_counter(labels)
        self._partition_id_to_indices = {pid: [] for pid in range(self._num_partitions)}
        for label in self._unique_labels:
            owners = [
                pid
                for pid in range(self._num_partitions)
                if label in self._partition_id_to_unique_labels[pid]
            ]
            if not owners:
                continue
            indices = np.where(labels == label)[0]
            self._rng.shuffle(indices)  # (a) shuffle the class
            for i, index in enumerate(indices):  # (c) deal one to each owner in turn
                self._partition_id_to_indices[owners[i % len(owners)]].append(int(index))
        if self._shuffle:
            for indices in self._partition_id_to_indices.values():
                self._rng.shuffle(indices)
        self._partition_id_to_indices_determined = True
