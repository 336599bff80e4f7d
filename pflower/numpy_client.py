"""pflower's client halves behind Flower's older ``NumPyClient`` interface.

Many Flower projects still write their client as a ``NumPyClient`` (``get_parameters`` /
``fit`` / ``evaluate`` on lists of NumPy arrays). ``PersonalizedNumPyClient`` is one, built
around *your* model and data loaders: the arrays it exchanges are the **shared** parameters
only (in ``split.shared`` order); the personal ones stay in its store — a directory on the
device with ``state_dir`` (atomic writes, survives restarts), or the node's ``context.state`` — and
training runs pflower's client half of the algorithm (FedAlt, FedSim, APFL, ...) unchanged, on
the same path as ``pflower.personal_client.PersonalizedClient`` (which serves every algorithm
from a message-API ClientApp: those replying with gradients or deltas too, which the NumPyClient
interface cannot carry)::

    from pflower.numpy_client import PersonalizedNumPyClient, numpy_client_app
    from pflower.task.split import make_split

    def client_fn(context):
        model = Net()
        return PersonalizedNumPyClient(
            model, make_split(model, "head"), trainloader, testloader,
            algorithm="fedalt", run_config={"lr": 0.05}, state=context.state,
        )  # or state_dir="/var/lib/pflower": personal layers on the device's disk

    app = numpy_client_app(client_fn)   # a ClientApp for pflower's (message-API) strategies

``numpy_client_app`` turns any ``client_fn`` returning a ``NumPyClient`` into a message-API
``ClientApp``: a training message's ``arrays`` become ``fit``'s parameters (in the record's
order) and ``fit``'s result becomes the reply's ``arrays`` under the same names, with
``num-examples`` and the metrics; ``evaluate`` likewise. Flower's own legacy ``ClientApp(
client_fn=...)`` speaks the older record layout that message-API strategies do not send.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader

from pflower.personal_client import PersonalizedClient
from pflower.strategies import ALGORITHMS
from pflower.strategies.client import ClientJob, answer_query, measured
from pflower.task import split as splits
from pflower.task.fingerprint import OWN_LOADERS
from pflower.wire import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, PERSONAL_INIT, PHASE, PRETRAIN

#: algorithms whose client half replies with weights under ``arrays`` (what NumPyClient.fit
#: returns), as each declares (``numpy_client``); gradient-replying ones (FFGG, PFLEGO) need
#: their own reply key: ``pflower.personal_client.PersonalizedClient`` serves them
SUPPORTED = tuple(name for name, entry in ALGORITHMS.items() if entry.numpy_client)


class PersonalizedNumPyClient(NumPyClient):
    """A ``NumPyClient`` whose parameters are ``split.shared``; ``split.personal`` stays here.

    Parameters
    ----------
    model : nn.Module
        The client's model (its parameters are overwritten by each message's shared ones).
    split : pflower.task.split.Split
        Which parameters are shared (exchanged) and personal (kept); refused, naming the
        fix, where the algorithm cannot use it (APFL exchanges every parameter and keeps its
        personal model in its state: ``make_split(model, "none")``).
    train_loader, test_loader : DataLoader
        The client's data.
    algorithm : str (default: "fedalt")
        One of ``SUPPORTED``; must match the server's strategy.
    run_config : mapping (default: empty)
        pflower run-config keys for the client half (``lr``, ``personal-epochs``, ...).
    state_dir : str or None (default: None)
        Keep the personal state in this directory (survives restarts).
    state : RecordDict or None (default: None)
        Without ``state_dir``: keep it here — pass ``context.state``, which lives as long as
        the node (a ``client_fn`` builds a new client for every message).
    """

    def __init__(
        self,
        model: nn.Module,
        split: splits.Split,
        train_loader: DataLoader,
        test_loader: DataLoader,
        algorithm: str = "fedalt",
        run_config: Mapping | None = None,
        state_dir: str | None = None,
        state: RecordDict | None = None,
    ) -> None:
        if algorithm not in SUPPORTED:
            raise ValueError(
                f"algorithm = {algorithm!r}: must be one of {SUPPORTED} (their replies are "
                "weights, what fit returns); pflower.personal_client.PersonalizedClient serves "
                "every algorithm from a ClientApp"
            )
        if not state_dir and state is None:
            raise ValueError(
                "pass state_dir (a directory on the device) or state=context.state: the "
                "personal parameters must outlive this client object"
            )
        self.client = PersonalizedClient(
            model,
            train_loader,
            test_loader,
            algorithm=algorithm,
            personal=split,
            run_config=run_config,
            state=state,
            state_dir=state_dir,
        )
        self.cfg, self.half = self.client.cfg, self.client.half
        self.model, self.split = model, self.client.split
        self.personal_init: ArrayRecord | None = None  # the server's, once it sends one

    def get_parameters(self, config) -> list[np.ndarray]:
        tensors = splits.get_tensors(self.model, self.split.shared)
        return [tensors[k].detach().cpu().numpy() for k in self.split.shared]

    def set_personal_init(self, record: ArrayRecord) -> None:
        """Where a client without personal state starts: the server's ``personal-init`` (the
        pre-trained model's personal slice) instead of the model's own initial values;
        checked against this client's split by ``ClientJob.set_personal_init``."""
        self.personal_init = record

    def exchanged(self, config: Mapping) -> tuple[str, ...]:
        """The parameters in a message: all of them during FedAvg pre-training (phase
        ``pretrain``), the shared ones otherwise."""
        if config.get(PHASE) == PRETRAIN:
            return tuple(n for n, _ in self.model.named_parameters())
        return self.split.shared

    def _job(
        self, parameters: list[np.ndarray], config: Mapping, training: bool = True
    ) -> ClientJob:
        """The message as pflower's ClientApp sees it (``ClientJob.receive``): the arrays
        under their names, the server's ``personal-init`` if it sent one."""
        names = self.exchanged(config)
        if len(parameters) != len(names):
            raise ValueError(
                f"received {len(parameters)} arrays; this client exchanges {len(names)} "
                f"tensors in this phase ({', '.join(names[:3])}, ...)"
            )
        records = {
            ARRAYS: ArrayRecord({k: Array(np.asarray(p)) for k, p in zip(names, parameters)})
        }
        if self.personal_init is not None:
            records[PERSONAL_INIT] = self.personal_init
        return self.client.job(records, config, training)

    def fit(self, parameters, config):
        config = dict(config)
        records, key, metrics = self.half.reply(self._job(parameters, config), config)
        if key != ARRAYS or len(records) != 1:
            raise ValueError(f"{self.cfg.algorithm}: replies with {sorted(records)}, not arrays")
        arrays = [records[ARRAYS][k].numpy() for k in self.exchanged(config)]
        return arrays, int(metrics[NUM_EXAMPLES]), dict(metrics)

    def evaluate(self, parameters, config):
        config = dict(config)
        metrics = self.half.evaluate(self._job(parameters, config, training=False), config)
        return float(metrics["personal-loss"]), int(metrics[NUM_EXAMPLES]), dict(metrics)


def numpy_client_app(client_fn: Callable[[Context], NumPyClient]) -> ClientApp:
    """A message-API ClientApp that runs ``client_fn(context)``'s ``NumPyClient``."""
    app = ClientApp()

    def parameters(msg: Message, made: NumPyClient) -> tuple[list[str], list[np.ndarray], dict]:
        """The message's arrays as ``fit`` takes them: in the client's own order of names
        when it declares one (``PersonalizedNumPyClient``: matched by name, a different set
        of names refused), else in the record's order."""
        record = msg.content[ARRAYS]
        config = dict(msg.content[CONFIG]) if CONFIG in msg.content else {}
        names = list(record.keys())
        if isinstance(made, PersonalizedNumPyClient):
            expected = list(made.exchanged(config))
            if set(names) != set(expected):
                raise ValueError(
                    f"the message carries {sorted(set(names) ^ set(expected))[:4]} where this "
                    "client's split differs: server and client must split the same model"
                )
            names = expected
        return names, [record[k].numpy() for k in names], config

    def client(msg: Message, context: Context) -> NumPyClient:
        made = client_fn(context)
        if PERSONAL_INIT in msg.content and hasattr(made, "set_personal_init"):
            made.set_personal_init(msg.content[PERSONAL_INIT])
        return made

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        made = client(msg, context)
        names, arrays, config = parameters(msg, made)
        new, num_examples, metrics = made.fit(arrays, config)
        if len(new) != len(names):
            raise ValueError(f"fit returned {len(new)} arrays for {len(names)} received")
        # np.asarray: keeps a 0-dim array 0-dim (np.ascontiguousarray makes it (1,)) and turns
        # a NumPy scalar, which Array refuses, into one
        reply = ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(names, new)})
        content = RecordDict(
            {
                ARRAYS: reply,
                METRICS: MetricRecord({**measured(metrics), NUM_EXAMPLES: num_examples}),
            }
        )
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        made = client(msg, context)
        _, arrays, config = parameters(msg, made)
        loss, num_examples, metrics = made.evaluate(arrays, config)
        out = {**measured(metrics), "loss": float(loss), NUM_EXAMPLES: num_examples}
        return Message(content=RecordDict({METRICS: MetricRecord(out)}), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """The start-up question: partition id and count (node config), the fingerprint of
        the client's model where it has one (``PersonalizedNumPyClient``: its ``model``)."""
        made = client_fn(context)
        model = getattr(made, "model", None)
        model = model if isinstance(model, nn.Module) else None
        return answer_query(msg, context.node_config, OWN_LOADERS, lambda: model, lambda: 0)

    return app
