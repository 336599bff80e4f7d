"""The client side every client half works on: ``ClientJob`` (model, split, loaders,
personal-state store of one message) and ``ClientHalf`` (the evaluation protocol shared by
all algorithms). Imports nothing from the server side.
"""

from __future__ import annotations

import contextlib
import functools
import math
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader

from pflower.strategies import privacy
from pflower.task import split as splits
from pflower.task import train as training
from pflower.task.data.loaders import source_loader
from pflower.task.fingerprint import model_fingerprint
from pflower.task.models import GLOBAL_RNG
from pflower.task.state import Store, load_matching, magnitude
from pflower.wire import (
    ARRAYS,
    CONFIG,
    DATA_KIND,
    FINAL,
    LOCAL_PART,
    LR,
    LR_SCALE,
    METRICS,
    MODEL_FINGERPRINT,
    NODE_FACTS,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    NUM_TRAIN,
    PARTITION_ID,
    PERSONAL_INIT,
    PHASE,
    PRETRAIN,
    QUERY,
    SERVER_ROUND,
    ConfigMismatch,
    array_view,
    handshake_problem,
    to_record,
    to_torch,
)

if TYPE_CHECKING:
    from pflower.settings import RunSettings

PERSONAL = "personal"  # store key of the personal parameters


@dataclass
class ClientJob:
    """Everything a client half works on for one message.

    ``split`` is the wire split: ``split.shared`` are the parameters in the message, and
    ``split.personal`` those that stay on this client. ``init_personal`` is where a client
    without personal state starts: the pre-trained model's slice when the server sends one
    (``personal-init``), else the seeded init every client builds identically.
    """

    cfg: RunSettings
    partition_id: int
    num_partitions: int
    model: nn.Module
    split: splits.Split
    train_loader: DataLoader
    test_loader: DataLoader
    store: Store
    device: torch.device
    init_personal: dict[str, torch.Tensor]
    #: the message's other ArrayRecords (e.g. Scaffold's ``control``), by key
    received: dict[str, ArrayRecord] = field(default_factory=dict)
    #: the shared parameters as received (local DP's weight update is ``sent - returned``)
    sent: ArrayRecord | None = None
    #: the message's config record (round, phase, the schedule's ``lr`` and ``lr-scale``...)
    config: Mapping = field(default_factory=dict)
    #: this job's stream of torch's global generator (``global_rng``), seeded per message
    rng_state: torch.Tensor | None = None
    #: whether ``restore_personal`` found stored state (reported as ``personal-restored``)
    restored: bool = False
    #: whether the handshake compares the server's settings fingerprint with ``cfg``'s (not
    #: for the NumPyClient adapter: its model and data are the user's, not ``cfg``'s)
    handshake_settings: bool = True
    #: a training loop of the user's, ``train_loop(model, loader, epochs, lr, device) ->
    #: loss`` (Flower's quickstart ``train``), which then takes every ``sgd`` call: it trains
    #: the parameters of the call, the others frozen (``pflower.personal_client``)
    train_loop: Callable | None = None
    #: an evaluation loop of the user's, ``evaluate_loop(model, loader, device) -> (loss,
    #: accuracy)`` (Flower's quickstart ``test``), which then takes every ``evaluate`` call
    evaluate_loop: Callable | None = None

    @functools.cached_property
    def params(self) -> dict[str, nn.Parameter]:
        """The model's parameters by name, looked up once per message: every copy in and out
        of the model needs them (``named_parameters`` walks the modules: ~7 us a time, eight
        times a message)."""
        return dict(self.model.named_parameters())

    @property
    def num_train(self) -> int:
        return len(self.train_loader.dataset)

    @contextlib.contextmanager
    def global_rng(self):
        """Torch's global generator continuing this job's own stream inside (for code that
        cannot take a generator, e.g. a layer's ``reset_parameters``): a client draws the same
        numbers whether other clients run beside it in threads or not."""
        with GLOBAL_RNG:
            outside = torch.get_rng_state()
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state)
            try:
                yield
            finally:
                self.rng_state = torch.get_rng_state()
                torch.set_rng_state(outside)

    @property
    def lr(self) -> float:
        """The client learning rate of this message: the server's schedule sends it with
        every message (``lr``); the run's ``lr`` only for a job built outside a message."""
        return float(self.config.get(LR, self.cfg.lr))

    @property
    def personal_lr(self) -> float:
        """The personal parameters' rate: ``personal-lr`` (default: the client ``lr``) times
        the server schedule's factor ``lr-scale`` of this message."""
        return self.cfg.effective_personal_lr * float(self.config.get(LR_SCALE, 1.0))

    def set_shared(self, arrays: ArrayRecord) -> None:
        # read-only views of the message's bytes, copied once, into the parameters
        splits.set_tensors(self.model, {k: array_view(a) for k, a in arrays.items()}, self.params)

    def receive(self, records: Mapping[str, ArrayRecord], config: Mapping) -> None:
        """Take a message: the server's ``personal-init`` (if any), the shared parameters
        (``arrays``; the whole model in pre-training), the algorithm's own records
        (``received``, e.g. Scaffold's ``control``) and the config record (``config``: the
        step sizes ``lr`` / ``personal_lr`` read it). The one entry for the ClientApp and the
        NumPyClient adapter alike. A message from a server of another algorithm or other
        client settings (the handshake: ``wire.handshake_problem``) raises
        ``ConfigMismatch``, which the server counts as ``config mismatch``."""
        problem = handshake_problem(self.cfg, config, self.handshake_settings)
        if problem:
            raise ConfigMismatch(problem)
        self.config = dict(config)
        if PERSONAL_INIT in records:
            self.set_personal_init(records[PERSONAL_INIT])
        self.set_shared(records[ARRAYS])
        self.sent = records[ARRAYS]
        self.received = {k: r for k, r in records.items() if k not in (ARRAYS, PERSONAL_INIT)}

    def set_personal_init(self, record: ArrayRecord) -> None:
        """Use the server's ``personal-init`` record as this client's personal init."""
        tensors = to_torch(record)
        if list(tensors) != list(self.split.personal):
            raise ValueError(
                f"personal-init carries {sorted(tensors)[:4]}…, this client's personal part "
                f"is {list(self.split.personal)[:4]}…: server and client splits differ"
            )
        self.init_personal = tensors

    def shared_record(self) -> ArrayRecord:
        return self.record_of(self.split.shared)

    def record_of(self, names) -> ArrayRecord:
        """The named parameters' values as a reply record, copied once: straight into the
        message's bytes (``wire.to_array``), not first into tensors of their own."""
        return to_record({n: self.params[n].detach() for n in names})

    def personal_params(self) -> list[nn.Parameter]:
        return splits.parameters(self.model, self.split.personal, self.params)

    def shared_params(self) -> list[nn.Parameter]:
        return splits.parameters(self.model, self.split.shared, self.params)

    def sgd(
        self,
        params,
        *,
        lr: float,
        epochs: int | None = None,
        steps: int | None = None,
        loader: DataLoader | None = None,
        correction: Sequence[torch.Tensor] | None = None,
        prox: tuple[float, Sequence[torch.Tensor]] | None = None,
    ) -> training.TrainResult:
        """The shared training primitive with this run's optimiser settings (the user's
        ``train_loop`` when there is one). ``prox = (mu, anchor)``: the proximal term
        ``mu/2 ||p - anchor||^2`` in the local objective (``training.sgd``)."""
        cfg = self.cfg
        epochs = cfg.local_epochs if epochs is None else epochs
        steps = cfg.local_steps if steps is None else steps
        if self.train_loop is not None:
            if prox is not None and prox[0]:
                raise ValueError(
                    f"{cfg.algorithm}: a proximal term (mu = {prox[0]}) in every step, which "
                    "your train_fn cannot take; drop train_fn"
                )
            return self._users_loop(params, lr, epochs, steps, loader, correction)
        return training.sgd(
            self.model,
            params,
            loader or self.train_loader,
            lr=lr,
            epochs=epochs,
            steps=steps,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm,
            correction=correction,
            prox=prox,
            device=self.device,
        )

    def _users_loop(self, params, lr, epochs, steps, loader, correction) -> training.TrainResult:
        """``epochs`` of the user's ``train_loop`` on ``params`` only: every other parameter
        is frozen (no gradient, so no optimizer of theirs moves it) and no gradient is left
        from an earlier phase. One rate, whole epochs, no gradient correction: what a
        quickstart loop takes; client halves that need more never get a ``train_loop``
        (``ClientHalf.users_loop``)."""
        groups = list(params) if params and isinstance(params[0], dict) else [{"params": params}]
        rates = [float(g.get("lr", lr)) for g in groups]
        if correction is not None or steps or not math.isclose(min(rates), max(rates)):
            raise ValueError(
                f"{self.cfg.algorithm}: a step of {len(rates)} rates, {steps} minibatch steps or "
                "a gradient correction, which your train_fn (epochs at one lr) cannot take; set "
                "'local-steps' / 'personal-steps' to 0, 'personal-lr' to 0, or drop train_fn"
            )
        trainable = [p for g in groups for p in g["params"]]
        loader = loader or self.train_loader
        if not trainable or not epochs or len(loader) == 0:
            return training.TrainResult(loss=float("nan"), steps=0, examples=0)
        for p in self.model.parameters():
            p.grad = None
        self.model.train()
        with training.only_trainable(self.model, trainable):
            # the user's loop reads its own loader's batches, not the (input, label) pairs
            loss = self.train_loop(self.model, source_loader(loader), epochs, rates[0], self.device)
        return training.TrainResult(
            loss=float(loss), steps=epochs * len(loader), examples=epochs * len(loader.dataset)
        )

    def fine_tune(self, names) -> training.TrainResult:
        """``finetune-epochs`` of SGD on ``names`` only (everything else frozen)."""
        return self.sgd(
            splits.parameters(self.model, names),
            lr=self.cfg.effective_finetune_lr,
            epochs=self.cfg.finetune_epochs,
            steps=0,
        )

    def evaluate(self) -> dict:
        """Loss and accuracy on this client's test data: the model's loss (``training.evaluate``)
        or the user's ``evaluate_loop``, on the user's own loader, for a classifier."""
        if self.evaluate_loop is None:
            return training.evaluate(self.model, self.test_loader, self.device)
        self.model.eval()
        with torch.no_grad():
            loss, accuracy = self.evaluate_loop(
                self.model, source_loader(self.test_loader), self.device
            )
        n = len(self.test_loader.dataset)
        return {
            "loss": float(loss),
            "accuracy": float(accuracy),
            "correct": round(float(accuracy) * n),
            "num-examples": n,
        }

    def load(self, key: str, template: Mapping[str, torch.Tensor]) -> dict | None:
        """This client's stored state ``key`` if it fits ``template`` (``load_matching``),
        else ``None``; every algorithm's state is read here, so that ``personal-restored``
        says whether the client resumed state of its own. Values are bounded by the scale
        of the template and of the shared parameters just received (``load_matching``)."""

        def scale() -> float:  # asked for only by a state beyond the template's own scale
            return magnitude(p.detach() for p in self.shared_params())

        stored = load_matching(self.store, key, template, scale=scale)
        self.restored = self.restored or stored is not None
        return stored

    def restore_personal(self, key: str = PERSONAL) -> bool:
        """Load this client's stored personal part; the init if none. True if one was stored."""
        stored = self.load(key, self.init_personal)
        splits.set_tensors(
            self.model, stored if stored is not None else self.init_personal, self.params
        )
        return stored is not None

    def save_personal(self, key: str = PERSONAL) -> None:
        # the parameters themselves: a store keeps the values as they are now (``Store``)
        self.store.save(key, {n: self.params[n].detach() for n in self.split.personal})


def answer_query(
    msg: Message,
    node_config: Mapping,
    data: str,
    model: Callable[[], nn.Module | None],
    num_train: Callable[[], int],
) -> Message:
    """The reply to the strategy's start-up query (``nodes.NodeSampling.learn_partitions``),
    for every ClientApp: the node's ``partition-id`` and ``num-partitions`` (node config),
    if asked its node facts (``data``: the kind of its data, ``task.fingerprint.data_kind``;
    the fingerprint of ``model()``, none if it returns None) and its number of training
    examples (``num_train()``: PFLEGO's alpha). ``model`` and ``num_train`` are called only
    when asked: building the model or loading the data costs."""
    asked = str(msg.content[CONFIG].get(QUERY, "")).split(",") if CONFIG in msg.content else []
    metrics = {k: int(node_config[k]) for k in (PARTITION_ID, NUM_PARTITIONS) if k in node_config}
    if NUM_TRAIN in asked:
        metrics[NUM_TRAIN] = num_train()
    content = RecordDict({METRICS: MetricRecord(metrics)})
    if NODE_FACTS in asked:
        facts = {DATA_KIND: data}
        built = model()
        if built is not None:
            facts[MODEL_FINGERPRINT] = model_fingerprint(built)
        content[NODE_FACTS] = ConfigRecord(facts)
    return Message(content=content, reply_to=msg)


def local_dp(
    job: ClientJob, records: Mapping[str, ArrayRecord], config: Mapping
) -> dict[str, ArrayRecord]:
    """Local DP (``dp = "local"``, ``pflower.strategies.privacy``): the reply's records as
    one update (returned weights: ``sent - returned``; gradients, deltas, control deltas:
    themselves), clipped to ``dp-clip`` and noised with std ``dp-noise x dp-clip`` before it
    leaves this client; weights go back as ``sent - noised update``, in their dtypes."""
    arrays = {
        (key, name): array_view(a) for key, record in records.items() for name, a in record.items()
    }
    sent = {name: array_view(a) for name, a in job.sent.items()} if job.sent is not None else {}
    update = {
        kn: (sent[kn[1]].astype(np.float64) - a if kn[0] == ARRAYS else a)
        for kn, a in arrays.items()
    }
    rng = privacy.noise_rng(
        job.cfg.dp_noise_seed, job.partition_id, int(config.get(SERVER_ROUND, 0))
    )
    noised = privacy.local_release(update, privacy.DPSettings.of(job.cfg), rng)
    out: dict[str, dict[str, np.ndarray]] = {key: {} for key in records}
    for (key, name), a in arrays.items():
        value = noised[key, name]
        if key == ARRAYS:
            value = sent[name].astype(np.float64) - value
        out[key][name] = np.asarray(value, dtype=a.dtype)
    return {key: to_record(values) for key, values in out.items()}


def train_metrics(job: ClientJob, *results: training.TrainResult) -> dict[str, float]:
    """A training reply's metrics: aggregation weight, last loss, passes over the local data."""
    return {
        NUM_EXAMPLES: job.num_train,
        "train-loss": results[-1].loss,
        "data-passes": sum(r.examples for r in results) / max(1, job.num_train),
        # 1 when the client resumed from its stored personal state (a restarted device keeps
        # its layers): the round's mean is the share of clients that did
        "personal-restored": float(job.restored),
    }


class ClientHalf:
    """An algorithm's client half. Subclasses implement ``train``.

    The evaluation protocol (DESIGN.md) is the same for all algorithms: on its own test
    split each client reports the **global** model (shared parameters + what a brand-new
    client would have as its personal part, ``new_client``) and the **personalized** model
    (``personalize``: its stored personal part, or, for stateless algorithms, the result of
    ``finetune-epochs`` of personal-only fine-tuning from the algorithm's init).

    Step sizes have one road: the config record of the message (the server's schedule),
    read through ``job.lr`` and ``job.personal_lr``. Each protocol step (``train``,
    ``pretrain``, ``evaluate``) first makes the ``config`` it is called with the job's
    (``__init_subclass__`` below), so a direct call ``half.train(job, config)`` steps at
    that config's ``lr`` exactly as the ClientApp does.
    """

    _STEPS = ("train", "pretrain", "evaluate")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls._STEPS:
            if name in cls.__dict__:
                setattr(cls, name, _with_config(cls.__dict__[name]))

    #: ArrayRecord key of the training reply.
    reply_key = ARRAYS
    #: Whether a "global model" accuracy is meaningful (not for purely local training).
    has_global = True
    #: Whether the personalized model differs from the global one (not for plain FedAvg).
    personalizes = True
    #: Whether every local step this half takes is plain SGD on some of the parameters at
    #: one rate (``ClientJob.sgd``), which a training loop of the user's can take
    #: (``ClientJob.train_loop``); halves with a step of their own (a gradient, a delta with
    #: control variates, APFL's mixed step) run pflower's
    users_loop = False

    def check(self, cfg: RunSettings, model: nn.Module, split: splits.Split, train_loop) -> None:
        """Refuse, before any message, a client this half cannot serve: a model, split or
        training loop of the user's (``pflower.personal_client``); a ``ValueError`` that
        names the fix. The base refuses step counts that a loop of epochs cannot follow."""
        if train_loop is None:
            return
        counts = {"local-steps": cfg.local_steps, "personal-steps": cfg.personal_steps}
        for key, value in counts.items():
            if value:
                raise ValueError(
                    f"key {key!r} = {value} with train_fn: your loop runs whole epochs; set "
                    f"{key!r} to 0 (epochs: 'local-epochs', 'personal-epochs') or drop train_fn"
                )

    def reply(
        self, job: ClientJob, config: Mapping
    ) -> tuple[dict[str, ArrayRecord], str, dict[str, float]]:
        """A training message's answer, by phase: FedAvg pre-training (``pretrain``: the
        whole model under ``arrays``) or this algorithm's ``train``. Returns the reply's
        records, the key of its update record and the metrics."""
        if config.get(PHASE) == PRETRAIN:
            record, metrics = self.pretrain(job, config)
            records, key = {ARRAYS: record}, ARRAYS
        else:
            record, metrics = self.train(job, config)
            records = record if isinstance(record, dict) else {self.reply_key: record}
            key = self.reply_key
        if job.cfg.dp == privacy.LOCAL:
            records = local_dp(job, records, config)
        return records, key, metrics

    @abstractmethod
    def train(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        """Train on the job's data; return the reply record (sent as ``reply_key``) and
        metrics (with num-examples). A half whose reply has more records returns them all
        as a dict ``{key: ArrayRecord}`` instead of the record."""

    def new_client(self, job: ClientJob) -> None:
        """Set the personal part a brand-new client would start from (default: the init)."""
        splits.set_tensors(job.model, job.init_personal)

    def personalize(self, job: ClientJob, final: bool = False) -> None:
        """Set this client's personal part for evaluation (default: fine-tune from init).

        ``final`` is true in the run's last evaluation (stateful algorithms fine-tune then)."""
        self.new_client(job)
        job.fine_tune(job.split.personal)

    def local_part(self, job: ClientJob) -> bool:
        """Set the model to this client's personal part as its training left it (no
        evaluation-time fitting), on the received shared parameters, and return True; False
        (the default) where the algorithm keeps no personal part between rounds. The
        evaluation reports it as ``local-part``: a personalized model far below it is a
        degenerate one."""
        return False

    def pretrain(self, job: ClientJob, config: Mapping) -> tuple[ArrayRecord, dict[str, float]]:
        """A FedAvg pre-training round (phase ``pretrain``): local SGD on the whole model."""
        every = [n for n, _ in job.model.named_parameters()]
        result = job.sgd(splits.parameters(job.model, every), lr=job.lr)
        return job.record_of(every), train_metrics(job, result)

    def evaluate(self, job: ClientJob, config: Mapping) -> dict[str, float]:
        metrics: dict[str, float] = {"partition-id": job.partition_id, "num-train": job.num_train}
        if config.get(PHASE) == PRETRAIN:  # the whole received model: nothing personal yet
            out = job.evaluate()
            return {
                **metrics,
                NUM_EXAMPLES: out["num-examples"],
                **tagged_metrics("personal", out),
                **tagged_metrics("global", out),
            }
        glob: dict = {}
        if self.has_global:
            self.new_client(job)
            glob = job.evaluate()
            metrics.update(tagged_metrics("global", glob))
        # before personalize: a final fine-tuning rewrites the stored personal part
        if self.local_part(job):
            metrics.update(tagged_metrics(LOCAL_PART, job.evaluate()))
        if self.personalizes or not self.has_global:
            self.personalize(job, final=bool(config.get(FINAL, False)))
            pers = job.evaluate()
        else:
            pers = glob
        metrics.update({NUM_EXAMPLES: pers["num-examples"], **tagged_metrics("personal", pers)})
        return metrics


def _with_config(step):
    """``step(half, job, config)`` with ``job.config = config`` first (``ClientHalf``)."""

    @functools.wraps(step)
    def with_config(half, job: ClientJob, config: Mapping, *args, **kwargs):
        job.config = dict(config)
        return step(half, job, config, *args, **kwargs)

    return with_config


for _step in ("pretrain", "evaluate"):  # the base class's own steps, as its subclasses'
    setattr(ClientHalf, _step, _with_config(getattr(ClientHalf, _step)))


def measured(metrics: Mapping) -> dict[str, float]:
    """The metrics a reply may carry: the finite numbers of ``metrics``.

    Every pflower strategy drops a reply whose metrics hold anything that is not a finite
    number (``pflower.wire.metrics_problem``: a NaN or Inf may be the sign of a diverged or
    tampered client, and one would poison the round's averaged metrics). A client half may
    report NaN for "none" (e.g. ``train-loss`` after zero local steps), and a NumPyClient
    its own string metrics, so a ClientApp passes a client half's metrics through
    ``measured`` before replying: ``MetricRecord(measured(metrics))``. pflower's ClientApp
    and ``numpy_client_app`` do; a ClientApp of your own built from the public client halves
    must too, or its replies may all be dropped."""
    return {
        k: v
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def tagged_metrics(which: str, out: Mapping) -> dict[str, float]:
    """``loss`` (and ``accuracy`` for classifiers) of an evaluation, as ``<which>-...``."""
    return {f"{which}-{k}": out[k] for k in ("loss", "accuracy", "rmse") if k in out}
