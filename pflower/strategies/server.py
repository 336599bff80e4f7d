"""``PersonalizedStrategy``, the round loop every pflower strategy runs (a Flower
message-API ``Strategy``). It holds three components and calls them in turn:

- ``nodes`` (``nodes.NodeSampler``): the start-up handshake, which refuses nodes running
  another model or data or claiming another's partition id, and the sample, uniform
  **without replacement**, secret unless ``sample_seed`` >= 0;
- the messages: only the shared parameters (``arrays``), a ``config`` record with the round's
  step sizes and the handshake (``algorithm``, ``settings-fingerprint``);
- ``pipeline`` (``pipeline.ReplyPipeline``): every reply through admit, bound, combine,
  apply and settle, each a module with its guarantee. A bad reply is dropped and counted,
  never raised (Flower's own ``FedAvg`` raises on inconsistent replies: one bad client would
  stop the run).

Evaluation is aggregated per DESIGN.md: pooled accuracy, mean over clients, p10/p50/p90,
worst client, and the number of clients whose personalized accuracy is below the global
model's, every ``evaluate_every`` rounds; the final round evaluates every client up to 100
clients, a uniform sample of max(100, 10%) past that (``final_evaluate_fraction``). At most
``max_in_flight`` messages are outstanding (16 on the simulation engine: ``exchange``), and
replies are taken in partition order, so that arrival order changes no bit of a result.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pflower.settings import RunSettings
from pflower.strategies import pipeline as pipelines
from pflower.strategies.aggregators import Aggregator
from pflower.strategies.bound import CLAIMS_CAPPED
from pflower.strategies.combine import AdaptiveClipping, RoundSkipped, weighted_mean
from pflower.strategies.exchange import exchange
from pflower.strategies.history import RoundLog, summarize_clients, weighted_mean_metrics
from pflower.strategies.nodes import NodeSampler
from pflower.strategies.privacy import POISSON, DPSettings, Mechanism
from pflower.strategies.rounds import Round
from pflower.strategies.server_opt import ServerOptimizer, client_lr
from pflower.wire import (
    ALGORITHM,
    ARRAYS,
    CONFIG,
    DELTA,
    FINAL,
    GRADIENT,
    LR,
    LR_SCALE,
    NUM_EXAMPLES,
    PERSONAL_INIT,
    PERSONAL_RESET,
    PHASE,
    PRETRAIN,
    RUN_TAG,
    SERVER_ROUND,
    SETTINGS_FINGERPRINT,
    TRAIN,
    UPDATE_NORM_METRICS,
    ClientUpdate,
    array_view,
    to_record,
)

if TYPE_CHECKING:
    from pflower.strategies.client import ClientHalf  # noqa: F401

__all__ = ["PersonalizedStrategy", "RoundSkipped"]

# A child of Flower's logger, so our records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")

#: every run-level key at its default (docs/reference/run-config.md): the constructor defaults
#: of every strategy, so that a strategy built by hand runs what the app runs
RUN_DEFAULTS = RunSettings()
#: ``final_evaluate_fraction`` = 0: up to this many nodes the final round evaluates them all
FINAL_EVALUATE_ALL = 100
#: each constructor setting's range, checked in ``__init__``: name -> (allowed?, the rule)
RANGES = {
    "fraction_train": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "fraction_evaluate": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "evaluate_every": (lambda v: v >= 1, "must be >= 1"),
    "final_evaluate_fraction": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0: every node up "
                                "to 100, else max(100, 10%) of them)"),  # fmt: skip
    "max_in_flight": (lambda v: v >= 0, "must be >= 0 (0: auto)"),
    "pull_interval": (lambda v: 0.01 <= v <= 60, "must be in [0.01, 60] seconds"),
    "reply_key": (lambda v: v in (ARRAYS, DELTA, GRADIENT), "must be 'arrays', 'delta' or "
                  "'gradient'"),  # fmt: skip
    "lr": (lambda v: v > 0, "must be > 0"),
    "pretrain_rounds": (lambda v: v >= 0, "must be >= 0"),
    "byzantine": (lambda v: v >= 0, "must be >= 0"),
}


def check_ranges(values: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first setting outside its range (``RANGES``)."""
    for name, (allowed, rule) in RANGES.items():
        if name in values and not allowed(values[name]):
            value = values[name]
            raise ValueError(f"{name} = {repr(value) if isinstance(value, str) else value}: {rule}")


class PersonalizedStrategy(Strategy):
    """Base strategy: sampling, messages, the reply pipeline, per-client evaluation metrics.

    Subclasses implement ``aggregate`` (checked updates -> new shared arrays, through
    ``combine`` and the server optimizer) and may add settings to each round's config with
    ``train_config``.

    **Pre-training.** With ``pretrain_rounds = P > 0`` the first P rounds are FedAvg on the
    whole model (config ``phase = "pretrain"``, reply key ``arrays``); then the model is
    split: the shared part ``shared_names`` goes on as the algorithm's ``arrays``, and the
    rest, the pre-trained personal slice, is sent as ``personal-init`` with every later
    message so that a client without personal state starts from it (Pillutla et al. 2022,
    step (a) -> (b)). It is the global model's slice, not any client's personal state.

    **Threat model** (each stage of ``pflower.strategies.pipeline`` states its guarantee;
    docs/threat-model.md the whole). Broken clients -- errors, missing or extra records,
    wrong names, shapes or dtypes, NaN/Inf, malformed metrics, any ``num-examples`` (a
    bounded weight), finite outliers beyond the update-norm bound -- are dropped and counted
    at every round size. By default every aggregating algorithm clips each update to the
    honest replies' spread around a robust centre (``combine.AdaptiveClipping``), FFGG takes
    the geometric median; a robust rule (``robust``) replaces the mean, and a round with too
    few replies for it is skipped and counted, never crashes the run.

    **Defaults: the app's.** Every parameter that is a run-config key defaults to what the
    app runs this algorithm with when that key is not set (docs/reference/run-config.md; the
    key is named below): ``RunSettings``' defaults, with the algorithm's own values for the
    keys left at ``auto`` (the class's ``defaults``, e.g. PFLEGO's server Adam). So a strategy
    built with only what you must give (``PFLEGO(fraction_train=0.5, lr=0.1)``) runs as
    ``flwr run`` with the same keys does; ``app_settings()`` shows them.

    Parameters
    ----------
    fraction_train : float (default: ``fraction-train``)
        Fraction of connected nodes sampled for training each round (at least one).
    fraction_evaluate : float (default: ``fraction-evaluate``)
        Fraction of nodes sampled for evaluation (the final round: ``final_evaluate_fraction``).
    final_evaluate_fraction : float (default: ``final-evaluate-fraction``)
        Fraction of nodes the final round evaluates; 0 (auto): every node when there are at
        most ``FINAL_EVALUATE_ALL`` (100), else a uniform sample of
        ``max(100, 10%)`` of them (the per-client statistics are then over that sample).
    max_in_flight : int (default: ``max-in-flight``)
        At most this many messages outstanding at once (``exchange.Window``); 0 (auto): 16 on
        Flower's simulation engine, no limit elsewhere.
    pull_interval : float (default: ``pull-interval``)
        Seconds between the server's pulls for replies while it waits (``exchange.Window``).
    evaluate_every : int (default: ``evaluate-every``)
        Evaluate every this many rounds (and always in the final round).
    reply_key : str (default: "arrays")
        The ArrayRecord key a training reply must carry: ``arrays`` (new weights),
        ``delta`` or ``gradient``; no other is accepted.
    lr : float (default: ``lr``)
        Client learning rate, scheduled across the algorithm's rounds by ``lr_schedule``.
    lr_schedule : str (default: ``lr-schedule``)
        ``constant``, ``linear`` (warm-up over ``lr_warmup_fraction`` of the rounds, then
        linear decay to 0) or ``exponential`` (halve every ``lr_halve_every`` rounds).
    lr_warmup_fraction : float (default: ``lr-warmup-fraction``)
        Share of the algorithm's rounds the ``linear`` schedule warms up over.
    lr_halve_every : int (default: ``lr-halve-every``)
        Rounds between halvings of the ``exponential`` schedule.
    server_optimizer : ServerOptimizer or None (default: None)
        Applied to the pseudo-gradient (or gradient) by subclasses that use one;
        ``None``: the app's for this algorithm (``server-optimizer``, ``server-lr``,
        ``server-beta1``, ``server-beta2``, ``server-eps``): SGD with server lr 1 (FedAvg)
        unless the algorithm's ``defaults`` say otherwise (PFLEGO: Adam at its rho).
    pretrain_rounds : int (default: ``pretrain-rounds``)
        FedAvg rounds on the whole model before the algorithm starts.
    pretrain_lr : float or None (default: None)
        Client lr of the pre-training rounds (``None`` or 0: ``lr``).
    shared_names : sequence of str or None (default: None)
        Names of the shared parameters; required when ``pretrain_rounds > 0``.
    seed : int (default: ``seed``)
        The run's seed, which every client receives: the robust rule's (BR-FFGG's buckets);
        never the sample's.
    sample_seed : int (default: ``sample-seed``)
        -1: a secret sample, from a seed drawn from OS entropy that nothing sent to a client
        reveals; >= 0: ``random.Random(sample_seed)``, which anyone who knows the seed can
        predict (``nodes.sample_stream``).
    model_fingerprint : str (default: "")
        The fingerprint (``task.fingerprint.model_fingerprint``) of the model every node must
        run, checked at the start-up handshake (``nodes.NodeSampler``); "": the app sets its
        run model's, a strategy built by hand compares the nodes with their plurality.
    holdout_fraction : float (default: ``holdout-fraction``)
        Share of the clients (the highest partition ids) never sampled for training: they
        are evaluated as new clients (their personal part from the algorithm's new-client
        rule) next to the trained ones.
    robust : Aggregator, None or False (default: None)
        A robust rule (``aggregators``) over the clients' updates, unweighted, in place of
        the mean, in every phase (``combine.RobustRule``). ``None``: the app's for this
        algorithm: none, unless its ``defaults`` or ``defence`` name one (BR-FFGG, FFGG).
        ``False``: no rule.
    byzantine : int (default: ``robust-byzantine``)
        f, the Byzantine clients per round the rule must tolerate: checked against the first
        sample and every round's kept replies (``combine.RobustRule``).
    clipping : AdaptiveClipping, None or False (default: None)
        The default defence (``combine.AdaptiveClipping``): each update clipped into a ball
        around a robust centre before the algorithm's mean. ``None``: the app's, adaptive
        clipping unless a robust rule or differential privacy replaces it (beside the app's
        own rule in the rounds too small for it, where its ``defence`` says so: FFGG).
        ``False``: none.
    max_update_norm : float (default: ``max-update-norm``)
        ``K``: drop a training reply whose update is longer than ``K`` times the reference of
        its kind, which starts at the model's scale and grows at most ``update_norm_growth``
        per round (``bound.UpdateNormBound``); 0: off. Off under central DP, whose clip
        replaces it.
    update_norm_growth : float (default: ``update-norm-growth``)
        ``g``: the reference grows by at most this factor per round.
    max_num_examples : int (default: ``max-num-examples``)
        A reply's weight (its ``num-examples`` claim) is at most this; 0: at most 10 times the
        lower median of the nodes' first claims (``bound.ClaimBound``). A claim is capped,
        never a reason to drop; set it above every honest size to weigh each reply by its
        claim (the papers' weights).
    max_failed_rounds : int (default: ``max-failed-rounds``)
        Stop the run (``settle.RunFailed``, with the drop reasons) after this many
        consecutive training rounds that applied no reply; 0: never.
    algorithm : str or None (default: None)
        The algorithm the clients must run, sent in the handshake (``algorithm`` in every
        message's config); ``None``: any the class serves (``serves``). The app sets the run
        config's.
    settings_fingerprint : str (default: "")
        A fingerprint of the client settings (``pflower.wire.settings_fingerprint``) sent in
        the handshake; the app sends the run config's, a strategy built by hand none.
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before sampling.
    privacy : DPSettings or None (default: the ``dp-*`` keys: ``dp``, ``dp-clip``...)
        User-level differential privacy of the shared updates (``privacy``): ``central``,
        the clipped, noised mean over the sampled clients in every phase
        (``combine.CentralDP``; a robust rule is refused with it); ``local``, the clients
        clip and noise their updates. The accountant's epsilon is the metric ``dp-epsilon``.
    """

    #: the algorithms whose client halves a strategy built by hand serves (the handshake's
    #: names; built by the app, the run config's ``algorithm``; none: no algorithm checked)
    serves: ClassVar[tuple[str, ...]] = ()
    #: this algorithm's values for the run-config keys left at ``auto`` (``settings.AUTO``):
    #: a strategy built by hand uses them as the app does (``app_settings``)
    defaults: ClassVar[Mapping[str, Any]] = {}
    #: its default defence where it is not adaptive clipping (runs without DP that leave
    #: ``robust-aggregator`` at ``auto``: ``settings.RunSettings.resolved``)
    defence: ClassVar[Mapping[str, Any]] = {}
    #: what a checkpoint keeps of the algorithm's own state besides ``STATE``
    checkpoint_attributes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        fraction_train: float = RUN_DEFAULTS.fraction_train,
        fraction_evaluate: float = RUN_DEFAULTS.fraction_evaluate,
        evaluate_every: int = RUN_DEFAULTS.evaluate_every,
        final_evaluate_fraction: float = RUN_DEFAULTS.final_evaluate_fraction,
        max_in_flight: int = RUN_DEFAULTS.max_in_flight,
        pull_interval: float = RUN_DEFAULTS.pull_interval,
        reply_key: str = ARRAYS,
        lr: float = RUN_DEFAULTS.lr,
        lr_schedule: str = RUN_DEFAULTS.lr_schedule,
        lr_warmup_fraction: float = RUN_DEFAULTS.lr_warmup_fraction,
        lr_halve_every: int = RUN_DEFAULTS.lr_halve_every,
        server_optimizer: ServerOptimizer | None = None,
        pretrain_rounds: int = RUN_DEFAULTS.pretrain_rounds,
        pretrain_lr: float | None = None,
        shared_names: Sequence[str] | None = None,
        seed: int = RUN_DEFAULTS.seed,
        sample_seed: int = RUN_DEFAULTS.sample_seed,
        model_fingerprint: str = "",
        holdout_fraction: float = RUN_DEFAULTS.holdout_fraction,
        robust: Aggregator | None | Literal[False] = None,
        clipping: AdaptiveClipping | None | Literal[False] = None,
        byzantine: int = RUN_DEFAULTS.robust_byzantine,
        max_update_norm: float = RUN_DEFAULTS.max_update_norm,
        update_norm_growth: float = RUN_DEFAULTS.update_norm_growth,
        max_num_examples: int = RUN_DEFAULTS.max_num_examples,
        max_failed_rounds: int = RUN_DEFAULTS.max_failed_rounds,
        algorithm: str | None = None,
        settings_fingerprint: str = "",
        min_available_nodes: int = 1,
        privacy: DPSettings | None = None,
    ) -> None:
        check_ranges(locals())
        if pretrain_rounds and shared_names is None:
            raise ValueError("pretrain_rounds > 0 needs shared_names to split the model after it")
        client_lr(lr, 1, 1, lr_schedule)  # validates the schedule name
        self.fraction_train, self.fraction_evaluate = fraction_train, fraction_evaluate
        self.evaluate_every, self.final_evaluate_fraction = evaluate_every, final_evaluate_fraction
        self.max_in_flight, self.pull_interval = max_in_flight, pull_interval
        self.reply_key, self.lr, self.lr_schedule = reply_key, lr, lr_schedule
        self.lr_warmup_fraction, self.lr_halve_every = lr_warmup_fraction, lr_halve_every
        app = self.app_settings()
        self.server_optimizer = server_optimizer or ServerOptimizer.of(app)  # the apply stage
        self.pretrain_rounds, self.pretrain_lr = pretrain_rounds, pretrain_lr or lr
        self.shared_names = list(shared_names) if shared_names is not None else None
        self.byzantine = byzantine
        self.pipeline = pipelines.build(
            app,
            self.defaults,
            seed=seed,
            robust=robust,
            clipping=clipping,
            privacy=privacy,
            byzantine=byzantine,
            max_update_norm=max_update_norm,
            update_norm_growth=update_norm_growth,
            max_num_examples=max_num_examples,
            max_failed_rounds=max_failed_rounds,
        )
        self.serves = (algorithm,) if algorithm is not None else type(self).serves
        self.settings_fingerprint = settings_fingerprint
        self.nodes = NodeSampler(
            sample_seed,
            model_fingerprint,
            min_available_nodes=min_available_nodes,
            holdout_fraction=holdout_fraction,
            poisson=self.central_dp and self.privacy.sampling == POISSON,
            private=self.privacy is not None,
        )
        self.num_rounds = 0
        self.history: list[RoundLog] = []
        self.final_clients: list[dict[str, float]] = []
        self.personal_init: ArrayRecord | None = None
        self.extra_reply_keys: tuple[str, ...] = ()  # records a reply carries besides reply_key
        #: sent with every message: devices version their state by (run tag, round)
        #: (``context_store.ScopedStore``); a run resumed from a checkpoint keeps its tag
        self.run_tag = ""
        self._current: ArrayRecord = ArrayRecord()  # the parameters of the round's messages
        self._out: list[Message] = []  # the round's messages (their ids once pushed)
        self._round: Round | None = None  # the training round being aggregated
        self._round_start = 0.0
        self._sample_checked = False  # the combine mode checked against the first sample

    # --- what the strategy is ---------------------------------------------------------------
    @property
    def algorithm(self) -> str:
        """The algorithm's name (the run config's, or the first the class serves)."""
        return self.serves[0] if self.serves else ""

    @property
    def robust(self) -> Aggregator | None:
        """The robust rule the combine stage runs (None: the mean)."""
        return self.pipeline.combine.rule

    @property
    def clipping(self) -> AdaptiveClipping | None:
        """The default defence's clip (None: none)."""
        return self.pipeline.combine.clip

    @property
    def privacy(self) -> Mechanism | None:
        """The differential-privacy mechanism (None: no DP)."""
        return self.pipeline.privacy

    @property
    def central_dp(self) -> bool:
        """Whether the server clips and noises the mean (``dp = "central"``)."""
        return self.privacy is not None and not self.privacy.local

    @classmethod
    def app_settings(cls) -> RunSettings:
        """The run-level settings the app runs this algorithm with when no key is set (the
        run-config reference's defaults, the algorithm's ``defaults`` for keys at ``auto``):
        where this class's constructor defaults come from."""
        return RUN_DEFAULTS.resolved(cls.defaults, cls.defence)

    @classmethod
    def from_config(cls, cfg: RunSettings, **settings) -> PersonalizedStrategy:
        """The strategy of a run config: ``settings`` the base strategy's
        (``strategy_kwargs``), and whatever the algorithm's own keys set (its subclass's)."""
        return cls(**settings)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the components' state (``nodes``, ``pipeline``), the
        server optimizer's, the history, and the algorithm's ``checkpoint_attributes``."""
        own = ("server_optimizer", "history", "personal_init", "final_clients", "run_tag")
        return {
            **self.nodes.state_dict(),
            **self.pipeline.state_dict(),
            **{name: getattr(self, name) for name in (*own, *self.checkpoint_attributes)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put a checkpoint's state back (``state_dict``; a checkpoint of an older pflower may
        lack some of it)."""
        state = self.pipeline.load_state_dict(self.nodes.load_state_dict(state))
        for name, value in state.items():
            setattr(self, name, value)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, **kwargs):
        """Flower's round loop; ``num_rounds`` counts pre-training rounds too."""
        if num_rounds <= self.pretrain_rounds:
            raise ValueError(
                f"num_rounds = {num_rounds} leaves no round after {self.pretrain_rounds} "
                "pre-training rounds"
            )
        self.refuse_other_lr(kwargs.get("train_config"))
        self.num_rounds = num_rounds
        self.history = []
        self.pipeline.settle.restart()
        self._sample_checked = False
        self.run_tag = uuid.uuid4().hex[:12]
        resume = kwargs.pop("resume", None)  # a pflower.checkpoint.Checkpoint to continue
        if resume is not None:
            resume.restore(self)  # sampler, server optimizer, history, run tag... of round r
        grid, kwargs["timeout"] = exchange(
            grid, kwargs.get("timeout"), self.max_in_flight, self.pull_interval
        )
        # as long as a round may take: a busy machine can start its nodes slowly
        self.nodes.learn_partitions(grid, timeout=kwargs.get("timeout") or 3600.0)
        if resume is not None:
            from pflower.checkpoint import continue_rounds

            return continue_rounds(
                self, grid, initial_arrays, resume.round + 1, num_rounds, **kwargs
            )
        return super().start(grid, initial_arrays, num_rounds=num_rounds, **kwargs)

    def refuse_other_lr(self, train_config: Mapping | None) -> None:
        """A ``train_config`` whose ``lr`` (Flower's quickstart sends one) is not this
        strategy's ``lr``, which its schedule sends with every message in its place."""
        sent = dict(train_config or {})
        if LR in sent and float(sent[LR]) != self.lr:
            raise ValueError(
                f"train_config 'lr' = {sent[LR]}: {type(self).__name__} sends its own client "
                f"lr (lr = {self.lr}, scheduled) with every message; pass lr={sent[LR]} to "
                f"{type(self).__name__}(...)"
            )

    def summary(self) -> None:
        log.info("\t├──> %s", type(self).__name__)
        log.info(
            "\t│\t├── fraction train %.2f | evaluate %.2f (every %d rounds, all in the last)",
            self.fraction_train,
            self.fraction_evaluate,
            self.evaluate_every,
        )
        if self.pretrain_rounds:
            log.info(
                "\t│\t├── %d FedAvg pre-training rounds (client lr %g)",
                self.pretrain_rounds,
                self.pretrain_lr,
            )
        log.info("\t│\t├── client lr %g (%s schedule)", self.lr, self.lr_schedule)
        log.info("\t│\t├── client sample %s", self.nodes.sample_line())
        log.info("\t│\t├── replies combined by %s", self.pipeline.combine.describe())
        log.info("\t│\t├── server optimizer %s", self.server_optimizer.describe())
        log.info("\t│\t└── reply key %r", self.reply_key)

    def _log(self, server_round: int) -> RoundLog:
        if not self.history or self.history[-1].round != server_round:
            self.history.append(RoundLog(round=server_round))
        return self.history[-1]

    def pretraining(self, server_round: int) -> bool:
        return server_round <= self.pretrain_rounds

    def record_server_metrics(self, server_round: int, metrics: Mapping[str, float]) -> None:
        """Keep server-side evaluation metrics (Flower's ``evaluate_fn``) in the history."""
        self._log(server_round).server.update(metrics)

    # --- sampling and messages --------------------------------------------------------------
    def train_config(self, server_round: int) -> dict:
        """Settings sent to clients with each training round (subclasses add theirs)."""
        return self.schedule(server_round)

    def schedule(self, server_round: int) -> dict:
        """The client step sizes of a round, sent with every message (train and evaluate):
        the one road by which a client learns its learning rate."""
        if self.pretraining(server_round):
            return {LR: self.pretrain_lr}
        t = server_round - self.pretrain_rounds
        rounds = self.num_rounds - self.pretrain_rounds
        lr = client_lr(
            self.lr, t, rounds, self.lr_schedule, self.lr_warmup_fraction, self.lr_halve_every
        )
        # lr-scale: the schedule's factor, for clients with more than one learning rate
        return {LR: lr, LR_SCALE: lr / self.lr}

    def _split_after_pretraining(self, arrays: ArrayRecord) -> ArrayRecord:
        """At the first round after pre-training: keep the shared part, set ``personal_init``."""
        if not self.pretrain_rounds or self.personal_init is not None:
            return arrays
        shared = set(self.shared_names)
        self.personal_init = ArrayRecord({k: a for k, a in arrays.items() if k not in shared})
        return ArrayRecord({k: a for k, a in arrays.items() if k in shared})

    def handshake(self) -> dict:
        """What every message says about the server's run: the algorithms whose clients it
        serves and, when built from a run config, the fingerprint of the settings its clients
        must share."""
        shake: dict = {ALGORITHM: list(self.serves)} if self.serves else {}
        if self.settings_fingerprint:
            shake[SETTINGS_FINGERPRINT] = self.settings_fingerprint
        return shake

    def _messages(self, server_round, node_ids, arrays, config: dict, message_type: str):
        phase = PRETRAIN if self.pretraining(server_round) else TRAIN
        config = {
            **config,
            **self.handshake(),
            SERVER_ROUND: server_round,
            PHASE: phase,
            RUN_TAG: self.run_tag,
        }

        def content_with(config: dict) -> RecordDict:
            content = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord(config)})
            if self.personal_init is not None:
                content[PERSONAL_INIT] = self.personal_init
            if message_type == MessageType.TRAIN and not self.pretraining(server_round):
                for key, record in self.extra_content(server_round).items():
                    content[key] = record
            return content

        content = content_with(config)
        # nodes whose replies keep being dropped for their values start from their init
        train = message_type == MessageType.TRAIN
        reset = self.pipeline.settle.reset_nodes() if train else set()
        reset_content = content_with({**config, PERSONAL_RESET: True}) if reset else None
        self._out = [
            Message(
                content=reset_content if n in reset else content,
                message_type=message_type,
                dst_node_id=n,
            )
            for n in node_ids
        ]
        return self._out

    def extra_content(self, server_round: int) -> dict[str, ArrayRecord]:
        """Further ArrayRecords sent with each training message (e.g. Scaffold's control
        variate); none by default."""
        return {}

    def configure_train(self, server_round, arrays, config, grid) -> Iterable[Message]:
        self._round_start = time.perf_counter()
        if not self.pretraining(server_round):
            arrays = self._split_after_pretraining(arrays)
        self._current = arrays
        nodes = self.nodes.sample(grid, self.fraction_train, train=True)
        if not self._sample_checked:  # the mode runs from the first round, pre-training too
            self.pipeline.combine.check_sample(len(nodes))
            self._sample_checked = True
        if self.privacy is not None:  # the accountant opened (the first round) and told
            self.privacy.sampled(
                nodes,
                self.nodes.sampled_from,
                self.num_rounds,
                secret=self.nodes.sampling["secret"],
                rate=self.fraction_train,
                shared={k: array_view(a) for k, a in arrays.items()},
            )
        log.info("round %d: training on %d nodes", server_round, len(nodes))
        settings = {**dict(config), **self.train_config(server_round)}
        return self._messages(server_round, nodes, arrays, settings, MessageType.TRAIN)

    def should_evaluate(self, server_round: int) -> bool:
        return server_round == self.num_rounds or server_round % self.evaluate_every == 0

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        self._out = []
        if not self.should_evaluate(server_round):
            return []
        if not self.pretraining(server_round):
            arrays = self._split_after_pretraining(arrays)
        final = server_round == self.num_rounds
        if final:
            fraction = self.final_fraction(len(list(grid.get_node_ids())))
            nodes = self.nodes.sample(grid, fraction, everyone=fraction == 1.0)
        else:
            nodes = self.nodes.sample(grid, self.fraction_evaluate)
        settings = {**dict(config), **self.schedule(server_round), FINAL: final}
        return self._messages(server_round, nodes, arrays, settings, MessageType.EVALUATE)

    def final_fraction(self, num_nodes: int) -> float:
        """The share of nodes the final round evaluates (``final_evaluate_fraction``)."""
        if self.final_evaluate_fraction:
            return self.final_evaluate_fraction
        if num_nodes <= FINAL_EVALUATE_ALL:
            return 1.0
        return max(FINAL_EVALUATE_ALL, round(0.1 * num_nodes)) / num_nodes

    # --- aggregation ------------------------------------------------------------------------
    def open_round(self, server_round: int, sent: Mapping[str, int] | None = None) -> Round:
        """The round whose replies are coming back (``rounds.Round``): its messages (``sent``:
        message id -> node; None: this round's), the parameters they carried, the phase."""
        if sent is None:
            sent = {m.metadata.message_id: m.metadata.dst_node_id for m in self._out}
            asked = {m.metadata.dst_node_id for m in self._out}
        else:
            asked = set(sent.values())
        pretraining = self.pretraining(server_round)
        reply_key = ARRAYS if pretraining else self.reply_key
        return Round(
            server_round,
            asked,
            sent,
            self._log(server_round).dropped,
            names_nodes=self.privacy is None,
            reply_key=reply_key,
            weights=reply_key == ARRAYS,
            kind=PRETRAIN if pretraining else reply_key,
            extra_keys=() if pretraining else self.extra_reply_keys,
            layout={k: (tuple(a.shape), a.dtype) for k, a in self._current.items()},
            # read-only views of the sent parameters' bytes (Array.numpy() copies)
            current={k: array_view(a) for k, a in self._current.items()},
            population=self.nodes.sampled_from,
            step_factor=self.step_factor(server_round),
            lr=float(self.schedule(server_round)[LR]),
            known_claims=self.nodes.num_train_of,
        )

    def step_factor(self, server_round: int) -> float:
        """What multiplies an update when the server applies it: 1 in pre-training (a plain
        mean), else the server optimizer's ``update_scale``."""
        if self.pretraining(server_round):
            return 1.0
        lr = float(self.schedule(server_round)[LR])
        return self.server_optimizer.update_scale(self.reply_key == GRADIENT, lr)

    @abstractmethod
    def aggregate(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        """New shared parameters from the current ones and the checked updates (non-empty)."""

    def combine(
        self,
        vectors: list[Mapping[str, np.ndarray]],
        weights: Sequence[float],
        center: Mapping[str, np.ndarray] | None = None,
        kind: str | None = None,
    ) -> dict[str, np.ndarray]:
        """The round's update vectors (``vectors``, or ``center - vectors[i]`` for returned
        weights) through the combine stage (``combine``: the mean, the clipped mean, the
        robust rule with its f, or central DP's noised mean), in float64; ``kind``: the
        vectors' record where they are not the replies' updates (Scaffold's control
        deltas). Raises ``RoundSkipped`` where the rule cannot tolerate the round's f."""
        # outside a round (an algorithm's step tried alone): a round of this phase, nobody asked
        rnd = self._round or Round(0, reply_key=self.reply_key, kind=self.reply_key)
        return self.pipeline.combine(rnd, vectors, weights, center, kind)

    def average_weights(
        self,
        current: dict[str, np.ndarray],
        updates: list[ClientUpdate],
        weighted: bool = True,
    ) -> dict[str, np.ndarray]:
        """Mean of returned weights (data-size weighted, or uniform with ``weighted`` False),
        applied through the server optimizer as the pseudo-gradient ``current - mean`` (SGD
        with lr 1 gives the mean: FedAvg). The mean is taken over the updates
        ``current - w_i`` (the same thing), so a robust rule sees updates, not raw weights."""
        weights = [u.num_examples if weighted else 1.0 for u in updates]
        tensors = [u.tensors for u in updates]
        return self.server_optimizer.step(current, self.combine(tensors, weights, current))

    def pretrain_aggregate(
        self, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        """A pre-training round (FedAvg on the whole model, no server optimizer): the
        data-size weighted mean of the returned weights or, through any other mode,
        ``current`` minus the combined updates ``current - w_i``: every phase meets it."""
        tensors, sizes = [u.tensors for u in updates], [u.num_examples for u in updates]
        if self.pipeline.combine.exact_mean:
            return weighted_mean(tensors, sizes)
        step = self.combine(tensors, sizes, current)
        return {k: current[k].astype(np.float64) - step[k] for k in current}

    def round_metrics(self, updates: list[ClientUpdate]) -> dict[str, float]:
        """The round's training metrics: the replies' metrics weighted by their bounded
        num-examples, losses clipped (``history.weighted_mean_metrics``); under central DP
        without the norms of the shared updates (``UPDATE_NORM_METRICS``), which the clip is
        there to hide."""
        rows = [u.metrics for u in updates]
        if self.central_dp:
            rows = [{k: v for k, v in r.items() if k not in UPDATE_NORM_METRICS} for r in rows]
        return weighted_mean_metrics(rows)

    def aggregate_train(
        self, server_round, replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rnd = self._round = self.open_round(server_round)
        # in partition order, not arrival order: float sums then do not depend on timing
        updates = self.pipeline.updates(rnd, self.nodes.in_order(replies))
        entry = self._log(server_round)
        entry.seconds = time.perf_counter() - self._round_start
        metrics = {"replies": rnd.answered, "applied": len(updates)}
        metrics["dropped"] = rnd.answered - len(updates)
        if rnd.claims_capped:  # kept, weighed at the cap (``bound.ClaimBound``)
            metrics[CLAIMS_CAPPED] = rnd.claims_capped
        new = None
        try:  # under central DP every round is a release, one without replies too
            new = self._step(rnd, updates) if updates or self.central_dp else None
            if new is None:
                log.warning("round %d: no usable reply; the shared parameters are unchanged",
                            server_round)  # fmt: skip
        except RoundSkipped as skipped:  # too few replies left for the robust rule
            log.warning("round %d: skipped, the shared parameters are unchanged: %s",
                        server_round, skipped)  # fmt: skip
            metrics.update(applied=0, skipped=1)
        applied = len(updates) if new is not None else 0
        if applied:
            self.pipeline.settle(rnd, applied)
            metrics.update(self.round_metrics(updates))
            metrics.update(self.pipeline.combine.round_metrics(rnd))  # replies clipped
        if self.central_dp and new is not None:  # a release: the noised mean of the sample
            self.privacy.released(sorted(rnd.asked), new)
        if self.privacy is not None:
            metrics.update(self.privacy.metrics())
        entry.train = metrics
        if not applied:
            self.pipeline.settle(rnd, 0)
        if new is None:
            return self._current, MetricRecord(metrics)
        # np.asarray, not np.ascontiguousarray: that one turns a 0-dim array into shape (1,),
        # which the clients then refuse as a layout they do not hold; to_array: the .npy
        # bytes of Array(ndarray), the values copied once
        dtypes = {k: a.dtype for k, a in rnd.current.items()}
        return to_record({k: np.asarray(v, dtype=dtypes[k]) for k, v in new.items()}), MetricRecord(
            metrics
        )

    def _step(self, rnd: Round, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        """The algorithm's step on the round's updates; under central DP, a round that kept
        no reply (every one dropped, or none came) is released all the same, the step on the
        noised mean of no contribution: unchanged parameters would tell that every reply was
        dropped, which depends on the clients' data, and would spend nothing on it."""
        if not updates:
            log.warning("round %d: no usable reply; released with noise alone (dp)", rnd.number)
            updates = [rnd.zero_update()]
        if self.pretraining(rnd.number):
            return self.pretrain_aggregate(dict(rnd.current), updates)
        return self.aggregate(rnd.number, dict(rnd.current), updates)

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        rnd = self.open_round(server_round)
        # each row weighs by its bounded claim; losses are clipped in the summary
        rows = self.pipeline.evaluation(
            rnd, self.nodes.in_order(replies), [NUM_EXAMPLES, "personal-loss"]
        )
        if not rows:
            return None
        summary = summarize_clients(rows)
        if rnd.claims_capped:
            summary[CLAIMS_CAPPED] = rnd.claims_capped
        self._log(server_round).evaluate = summary
        if server_round == self.num_rounds:
            self.final_clients = rows
        return MetricRecord(summary)
