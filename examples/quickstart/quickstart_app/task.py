"""quickstart_app: your model, data and training loop, written the way Flower's PyTorch
quickstart writes them; a small MLP on scikit-learn's 8x8 digits instead of a CNN on CIFAR-10,
so that it runs offline in seconds. Each client holds two classes of its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)  # the head: with pflower, each client's own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """This client's share of two classes of the digits (classes p and p + 1 of client p, each
    class split between the two clients that hold it), 80% to train, 20% to test."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    idx = []
    for c in (partition_id % 10, (partition_id + 1) % 10):
        rows = torch.nonzero(y == c).flatten()
        half = len(rows) // 2
        idx.append(rows[:half] if c == partition_id % 10 else rows[half:])
    idx = torch.cat(idx)
    idx = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(partition_id))]
    cut = int(0.8 * len(idx))
    train = TensorDataset(x[idx[:cut]], y[idx[:cut]])
    test = TensorDataset(x[idx[cut:]], y[idx[cut:]])
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size=64)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for x, y in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for x, y in testloader:
            outputs = net(x.to(device))
            loss += criterion(outputs, y.to(device)).item()
            correct += (outputs.argmax(1) == y.to(device)).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
