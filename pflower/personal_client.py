"""Every pflower algorithm from a ClientApp of your own: your model and data loaders, your
training loop where the algorithm's local steps are plain SGD, pflower's step where the
algorithm defines one (a gradient, a delta, control variates, APFL's mixed step)::

    from pflower.personal_client import PersonalizedClient, personalized_client_app

    def client_fn(context: Context) -> PersonalizedClient:
        trainloader, testloader = load_data(context.node_config["partition-id"], ...)
        return PersonalizedClient(
            Net(), trainloader, testloader,
            algorithm="pflego",   # the server runs pflower.strategies.PFLEGO
            personal="head",      # stays on the client (or patterns: ["fc3.*"])
            train_fn=train,       # optional: your loop (FedAvg, FedAlt, FedSim, Local)
        )

    app = personalized_client_app(client_fn)

Switching algorithms is the ``algorithm`` name (and the server's strategy class): the same
``personal`` and ``train_fn`` serve each, as far as it has a use for them (below).

It runs the same path as pflower's own ClientApp (``pflower.client_app``): a ``ClientJob`` (here
of your model and loaders) handed to the algorithm's client half, personal state in the node's
store (``context.state``, or the directory of node config ``state-dir``), the handshake, the
start-up query (partition id, number of training examples). The client's settings are the
app's for the algorithm (``Config``), overridden by ``run_config``; its ``lr`` is the server's,
read from every message (the schedule's ``lr`` over its factor ``lr-scale``).

**The split is the algorithm's.** ``personal`` names the part that stays on the client, for
the algorithms that keep one out of the messages (FedAlt, FedSim, FFGG, Local FFGG, PFLEGO):
there a split without a personal part is refused, naming the fix, and PFLEGO's must be the
last linear layer; ``None`` takes the run config's ``split`` (``head``). The algorithms that
exchange every parameter pick their own split and say so once: APFL (its global copy w
crosses; its personal model v and alpha stay in the node's state), FedAvg, Scaffold, L2GD,
Local-GD (nothing personal; ``fedavg-ft`` fine-tunes ``personal`` at evaluation), Local
(everything personal). ``shared_arrays`` gives the server's initial arrays by the same rule.

**Your training loop** ``train_fn(model, loader, epochs, lr, device) -> loss`` (Flower's
quickstart ``train``) takes every local SGD phase of the client halves made only of such phases
(``ClientHalf.users_loop``: FedAvg, FedAvg + fine-tuning, FedAlt, FedSim, Local): each phase
freezes the parameters it does not train, so your optimizer moves only the others. It runs
whole epochs at one rate: ``local-steps`` / ``personal-steps`` and FedSim's ``personal-lr`` are
refused with it. The other algorithms define their own step (a gradient, a delta with control
variates, APFL's step on w, v and alpha together) and run pflower's (said once). Batches are
``(x, y)`` pairs; pflower's steps use the model's ``loss`` (cross-entropy by default), and
evaluation is pflower's protocol (personalized and global model on the client's test data).
"""

from __future__ import annotations

import glob
import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader

from pflower.config import Config
from pflower.context_store import ContextStore, open_store, scope_job
from pflower.strategies import get_algorithm, wire_split
from pflower.strategies.client import ClientJob, answer_query, measured
from pflower.task import split as splits
from pflower.task.data.loaders import as_pairs
from pflower.task.fingerprint import OWN_LOADERS
from pflower.task.run_model import split_by_rule
from pflower.task.state import DirectoryStore, Store
from pflower.wire import CONFIG, LR, LR_SCALE, METRICS, SERVER_ROUND

log = logging.getLogger("flwr.pflower")

#: how an algorithm that keeps no part out of the messages uses the model (``wire_split``)
_SHARES = {"none": "exchanges every parameter", "full": "trains every parameter alone"}
_SAID: set[str] = set()  # what ``say_once`` said (one client object per message)


def say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        log.info(line)


def personal_keys(
    model: nn.Module, personal: str | Sequence[str] | splits.Split | None
) -> dict[str, str]:
    """The run-config keys of a personal part: a ``split`` preset (``head`` too when the
    patterns or ``Split`` name exactly the last linear layer: FedRep / FedPer need it so), or
    ``split-patterns`` (glob patterns; a ``Split``'s personal names, escaped)."""
    if personal is None:
        return {}
    if isinstance(personal, str):
        return {"split": personal}
    if isinstance(personal, splits.Split):
        patterns = [glob.escape(n) for n in personal.personal]
    else:
        patterns = list(personal)
    named = splits.make_split(model, patterns=patterns).personal if patterns else ()
    if not named:
        return {"split": "none"}
    linear = any(isinstance(m, nn.Linear) for m in model.modules())
    if linear and set(named) == set(splits.make_split(model, "head").personal):
        return {"split": "head"}
    return {"split-patterns": ",".join(patterns)}


def algorithm_split(model: nn.Module, cfg: Config, named: bool) -> splits.Split:
    """The split ``cfg.algorithm`` exchanges (``wire_split``): the run config's where the
    algorithm keeps a personal part out of the messages (refused, naming the fix, when it has
    none), else the algorithm's own, said once where it differs from a personal part the user
    ``named`` (APFL keeps a whole personal model in its state; FedAvg, Scaffold have none;
    ``fedavg-ft`` fine-tunes the named part at evaluation)."""
    entry = get_algorithm(cfg.algorithm)
    wire = wire_split(model, cfg)
    if entry.wire_split == "config":
        if not wire.personal:
            raise ValueError(
                f"algorithm {cfg.algorithm!r} keeps a personal part of the model on each "
                "client, and this split has none: name it, e.g. personal='head' (the last "
                "nn.Linear) or personal=['fc3.*']"
            )
        return wire
    given = split_by_rule(model, cfg, "config")
    if named and entry.personal_split != "config" and given.personal != wire.personal:
        say_once(
            f"{cfg.algorithm}: {_SHARES[entry.wire_split]} and keeps what is personal in its "
            f"own state; personal {list(given.personal)[:4]} is not a part it splits off"
        )
    return wire


def shared_arrays(
    model: nn.Module,
    algorithm: str,
    personal: str | Sequence[str] | splits.Split | None = None,
    run_config: Mapping | None = None,
) -> ArrayRecord:
    """The server's initial arrays for ``algorithm``: the parameters its clients exchange,
    by ``PersonalizedClient``'s rule for the same ``personal`` (the whole model for APFL,
    FedAvg, Scaffold; the rest without the personal part for FedAlt, FFGG, PFLEGO...)."""
    cfg = client_settings(model, algorithm, personal, run_config)
    split = algorithm_split(model, cfg, named=personal is not None)
    return ArrayRecord(splits.get_tensors(model, split.shared))


def client_settings(
    model: nn.Module, algorithm: str, personal, run_config: Mapping | None
) -> Config:
    """The app's settings for ``algorithm`` with ``run_config`` and the personal part."""
    keys = {**dict(run_config or {}), **personal_keys(model, personal), "algorithm": algorithm}
    return Config.from_run_config(keys)


class PersonalizedClient:
    """Your model and data loaders served with pflower's client half of ``algorithm``: one
    per message, as Flower's ``client_fn`` builds a client (``personalized_client_app``).

    Parameters
    ----------
    model : nn.Module
        The client's model; each message overwrites the parameters it carries.
    train_loader, test_loader : DataLoader
        The client's data: batches of ``(x, y)`` pairs, or dicts with named fields (Flower's
        quickstarts' ``{"img": ..., "label": ...}``; ``batch_keys`` names others). A batch
        of another layout is refused at the first message, naming what was found.
    algorithm : str
        A name of the run config's ``algorithm`` (Algorithms page), the server's strategy's
        (e.g. ``"pflego"`` for ``pflower.strategies.PFLEGO``).
    personal : str, sequence of str, Split or None (default: None)
        What stays on the client: a ``split`` preset (``"head"``: the last ``nn.Linear``),
        glob patterns over parameter names, or a ``Split``; ``None``: the run config's
        ``split``. Algorithms that exchange every parameter take their own (module
        docstring); one that cannot work is refused, naming the fix.
    run_config : mapping or None (default: None)
        pflower run-config keys for the client half (``local-epochs``, ``personal-epochs``,
        ``finetune-epochs``...); the rest are the app's defaults for ``algorithm``.
    train_fn : callable or None (default: None)
        Your training loop ``train_fn(model, loader, epochs, lr, device) -> loss`` for the
        algorithms whose local steps are plain SGD (``ClientHalf.users_loop``); the others
        run their own step and leave it unused, saying so once in the log (so one ClientApp
        serves every algorithm). ``None``: pflower's SGD.
    evaluate_fn : callable or None (default: None)
        Your evaluation loop ``evaluate_fn(model, loader, device) -> (loss, accuracy)`` (the
        quickstart's ``test``), for the global and the personalized model alike; ``None``:
        the model's loss (cross-entropy by default) and accuracy.
    batch_keys : (str, str) or None (default: None)
        The input's and the label's fields of a dict batch; ``None``: the first of
        ``img``, ``image``, ``x``, ... and of ``label``, ``labels``, ``y``, ... the batch has
        (``pflower.task.data.loaders.INPUT_KEYS``, ``LABEL_KEYS``).
    state : RecordDict or None (default: None)
        Where the personal state lives; ``None``: the node's (``context.state``, or the
        directory of node config ``state-dir``).
    state_dir : str or None (default: None)
        A directory for the personal state instead (survives restarts).
    """

    def __init__(
        self,
        model: nn.Module,
        train_loader: DataLoader,
        test_loader: DataLoader,
        *,
        algorithm: str,
        personal: str | Sequence[str] | splits.Split | None = None,
        run_config: Mapping | None = None,
        train_fn: Callable | None = None,
        evaluate_fn: Callable | None = None,
        batch_keys: tuple[str, str] | None = None,
        state: RecordDict | None = None,
        state_dir: str | None = None,
    ) -> None:
        self.cfg = client_settings(model, algorithm, personal, run_config)
        self.half = get_algorithm(algorithm).client
        self.split = algorithm_split(model, self.cfg, named=personal is not None)
        if train_fn is not None and not self.half.users_loop:
            say_once(f"{algorithm}: pflower's client step (the algorithm defines it), not train_fn")
            train_fn = None
        self.half.check(self.cfg, model, self.split, train_fn)
        self.model, self.train_fn, self.evaluate_fn = model, train_fn, evaluate_fn
        # pflower's steps read (input, label) pairs; train_fn / evaluate_fn get your loaders
        self.train_loader = as_pairs(train_loader, batch_keys)
        self.test_loader = as_pairs(test_loader, batch_keys)
        self.store: Store | None = DirectoryStore(state_dir) if state_dir else None
        if self.store is None and state is not None:
            self.store = ContextStore(state)
        # where a client without personal state starts: the model's own initial values
        self.init_personal = {
            k: v.detach().clone() for k, v in splits.get_tensors(model, self.split.personal).items()
        }
        self.device = next(model.parameters()).device

    def job(
        self,
        records: Mapping[str, ArrayRecord],
        config: Mapping,
        training: bool = True,
        context: Context | None = None,
    ) -> ClientJob:
        """A message as pflower's ClientApp takes it (``ClientJob.receive``, ``scope_job``):
        its records (shared parameters, ``personal-init``, an algorithm's own such as
        Scaffold's ``control``) and config, on this client's model, data and store."""
        node = context.node_config if context is not None else {}
        partition_id = int(node.get("partition-id", 0))
        store = self.store or (open_store(context.state, node) if context else None)
        if store is None:
            raise ValueError(
                "no store for the personal state: pass state=context.state or state_dir, or "
                "serve this client through personalized_client_app"
            )
        # seeded by (seed, client, round), as pflower's ClientApp seeds its jobs
        server_round = int(config.get(SERVER_ROUND, 0))
        salt = (self.cfg.seed * 1_000_003 + partition_id * 10_007 + server_round) % 2**63
        job = ClientJob(
            cfg=self._with_server_lr(config),
            partition_id=partition_id,
            num_partitions=int(node.get("num-partitions", 1)),
            model=self.model,
            split=self.split,
            train_loader=self.train_loader,
            test_loader=self.test_loader,
            store=store,
            device=self.device,
            init_personal={k: v.clone() for k, v in self.init_personal.items()},
            rng_state=torch.Generator().manual_seed(salt).get_state(),
            handshake_settings=False,  # the algorithm is checked; model and data are yours
            train_loop=self.train_fn,
            evaluate_loop=self.evaluate_fn,
        )
        job.receive(records, config)
        scope_job(job, config, training)  # state of this configuration only (context_store)
        return job

    def _with_server_lr(self, config: Mapping) -> Config:
        """This client's settings with the server's ``lr`` (the message's over its schedule
        factor), which the personal part's rate and fine-tuning follow as in the app."""
        scale = float(config.get(LR_SCALE, 1.0))
        if LR not in config or not scale > 0:
            return self.cfg
        return self.cfg.model_copy(update={"lr": float(config[LR]) / scale})

    def train(self, msg: Message, context: Context | None = None) -> Message:
        """The reply to a training message: the algorithm's records and its metrics."""
        config = dict(msg.content[CONFIG])
        job = self.job(msg.content.array_records, config, True, context)
        records, _, metrics = self.half.reply(job, config)
        content = RecordDict({**records, METRICS: MetricRecord(measured(metrics))})
        return Message(content=content, reply_to=msg)

    def evaluate(self, msg: Message, context: Context | None = None) -> Message:
        """The reply to an evaluation message: the personalized and global models' metrics."""
        config = dict(msg.content[CONFIG])
        job = self.job(msg.content.array_records, config, False, context)
        metrics = measured(self.half.evaluate(job, config))
        return Message(content=RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)

    def query(self, msg: Message, context: Context | None = None) -> Message:
        """The strategy's start-up question: this node's partition id and number of
        partitions (node config), its data (its own loaders) and the fingerprint of its
        model's architecture and code (``task.fingerprint.model_fingerprint``), and, if
        asked, its number of training examples (PFLEGO's alpha)."""
        node = context.node_config if context is not None else {}
        return answer_query(
            msg, node, OWN_LOADERS, lambda: self.model, lambda: len(self.train_loader.dataset)
        )


def personalized_client_app(client_fn: Callable[[Context], PersonalizedClient]) -> ClientApp:
    """A message-API ClientApp that answers each message with ``client_fn(context)``'s
    ``PersonalizedClient`` (training, evaluation, the start-up query)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client_fn(context).train(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return client_fn(context).evaluate(msg, context)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return client_fn(context).query(msg, context)

    return app
