"""A Flower user's data as Flower's quickstarts write it: dict batches (``{"img": ...,
"label": ...}``, what ``flwr-datasets`` partitions give through a DataLoader), the user's own
``train`` and ``test`` loops reading them, served by every public strategy's client half
(``PersonalizedClient``); and the batches pflower cannot read, refused with one line."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context

# the example's model and loaders, and the public strategies, as test_personal_client has them
from test_personal_client import KEYS, PUBLIC, Net, load_data
from torch.utils.data import DataLoader, Dataset

import pflower.strategies as strategies
from pflower.personal_client import PersonalizedClient, personalized_client_app, shared_arrays
from pflower.task.data.loaders import BatchLayoutError, PairBatches
from pflower.testbed.local_grid import LocalGrid

#: the public strategies of test_personal_client.py, but AsyncFFGG (its own round loop), and
#: the papers' baselines
PUBLIC = [cls for cls in PUBLIC if cls is not strategies.AsyncFFGG] + [
    strategies.Ditto,
    strategies.FedBABU,
    strategies.FedProx,
]


class DictRows(Dataset):
    """Rows as a Hugging Face dataset with a torch transform gives them: dicts of fields."""

    def __init__(self, tensors, keys=("img", "label")):
        self.x, self.y = tensors
        self.keys = keys

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {self.keys[0]: self.x[i], self.keys[1]: self.y[i]}


def dict_loaders(partition_id, num_partitions, batch_size=32, keys=("img", "label")):
    train, test = load_data(partition_id, num_partitions, batch_size)
    return (
        DataLoader(DictRows(train.dataset.tensors, keys), batch_size=batch_size, shuffle=True),
        DataLoader(DictRows(test.dataset.tensors, keys), batch_size=64),
    )


def train(net, trainloader, epochs, lr, device):
    """Flower's quickstart ``train``: dict batches."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    running = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(batch["img"].to(device)), batch["label"].to(device))
            loss.backward()
            optimizer.step()
            running += loss.item()
    return running / (epochs * len(trainloader))


def evaluate(net, testloader, device):
    """Flower's quickstart ``test``: dict batches, ``(loss, accuracy)``."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            outputs = net(batch["img"].to(device))
            labels = batch["label"].to(device)
            loss += criterion(outputs, labels).item()
            correct += (outputs.argmax(1) == labels).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def client_fn(context: Context) -> PersonalizedClient:
    algorithm = context.run_config["algorithm"]
    trainloader, testloader = dict_loaders(
        context.node_config["partition-id"], context.node_config["num-partitions"]
    )
    return PersonalizedClient(
        Net(),
        trainloader,
        testloader,
        algorithm=algorithm,
        personal="head",
        train_fn=train,
        evaluate_fn=evaluate,
        run_config=KEYS.get(algorithm, {}),
    )


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_every_public_strategy_learns_on_dict_batches_with_the_users_loops(cls):
    algorithm = cls.serves[0]
    grid = LocalGrid(personalized_client_app(client_fn), 5, {"algorithm": algorithm})
    arrays = shared_arrays(Net(), algorithm, personal="head", run_config=KEYS.get(algorithm))
    strategy = cls(lr=0.1, sample_seed=0)
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)
    final = strategy.history[-1].evaluate
    personalized = cls not in (strategies.FedAvg, strategies.Scaffold, strategies.FedProx)
    assert final["personal-accuracy"] > (0.7 if personalized else 0.5), final
    assert sum(sum(r.dropped.values()) for r in strategy.history) == 0


def _first_pair(loader, keys=None):
    return next(iter(PairBatches(loader, keys)))


def test_pairs_dicts_and_named_fields_are_read_and_other_layouts_refused_in_one_line():
    train, _ = load_data(0, 5, 8)
    x, y = _first_pair(train)  # (x, y) pairs as they are
    assert x.shape == (8, 64) and y.shape == (8,)
    named, _ = dict_loaders(0, 5, 8, keys=("pixels", "digit"))
    with pytest.raises(BatchLayoutError, match=r"keys \['digit', 'pixels'\].*batch_keys="):
        _first_pair(named)
    x, y = _first_pair(named, ("pixels", "digit"))
    assert x.shape == (8, 64) and y.shape == (8,)
    image, _ = dict_loaders(0, 5, 8, keys=("image", "label"))  # flwr-datasets' MNIST names
    assert _first_pair(image)[0].shape == (8, 64)
    triples = DataLoader(
        torch.utils.data.TensorDataset(x, y, y), batch_size=4
    )  # (x, y, weight): which is the label?
    with pytest.raises(BatchLayoutError, match="a list of 3") as err:
        _first_pair(triples)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="batch_keys"):
        PairBatches(train, ("img",))


def test_a_batch_it_cannot_read_is_refused_at_the_first_message(caplog):
    """The ClientApp replies with an error naming the layout; the server counts the reply."""
    named, test_named = dict_loaders(0, 5, 8, keys=("pixels", "digit"))

    def fn(context):
        return PersonalizedClient(Net(), named, test_named, algorithm="fedalt", personal="head")

    grid = LocalGrid(personalized_client_app(fn), 3, {"algorithm": "fedalt"})
    strategy = strategies.FedAlt(lr=0.1, sample_seed=0, max_failed_rounds=1)
    arrays = shared_arrays(Net(), "fedalt", personal="head")
    with pytest.raises(Exception, match="applied no reply"):
        strategy.start(grid=grid, initial_arrays=arrays, num_rounds=2)
    assert any("batch_keys" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ][-5:]
