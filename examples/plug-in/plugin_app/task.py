"""Your model and data, as in Flower's quickstart: a small MLP on scikit-learn's 8x8 digits,
each client a slice of the data with its own two classes."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)  # personal: stays on each client

    def forward(self, x):
        return self.head(self.body(x))


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    mine = [c for c in range(10) if c % num_partitions == partition_id % num_partitions][:2]
    idx = torch.nonzero(torch.isin(y, torch.tensor(mine))).flatten()
    cut = int(0.8 * len(idx))
    train = TensorDataset(x[idx[:cut]], y[idx[:cut]])
    test = TensorDataset(x[idx[cut:]], y[idx[cut:]])
    return DataLoader(train, batch_size=16, shuffle=True), DataLoader(test, batch_size=64)
