"""``PersonalizedStrategy``, the round loop every pflower strategy runs (a Flower message-API
``Strategy``). It configures each round's messages (``messages``: the shared parameters, the
step sizes, the handshake) for the nodes its sampler draws (``nodes.NodeSampler``: the
start-up handshake, a sample without replacement, secret unless ``sample_seed`` >= 0), and
runs every reply through the reply pipeline (``pipeline``: admit, bound, combine, apply,
settle, each a module with its guarantee): a bad reply is dropped and counted, never raised.
Replies are taken in partition order, so that arrival order changes no bit of a result.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pflower.settings import RunSettings
from pflower.strategies import pipeline as pipelines
from pflower.strategies.aggregators import Aggregator
from pflower.strategies.bound import CLAIMS_CAPPED
from pflower.strategies.combine import AdaptiveClipping, weighted_mean
from pflower.strategies.evaluation import EvaluationPlan
from pflower.strategies.exchange import Exchange
from pflower.strategies.history import RoundLog, summarize_clients, weighted_mean_metrics
from pflower.strategies.messages import handshake, round_messages
from pflower.strategies.nodes import NodeSampler
from pflower.strategies.privacy import POISSON, DPSettings, Mechanism
from pflower.strategies.rounds import Round
from pflower.strategies.server_opt import ClientSchedule, ServerOptimizer
from pflower.wire import (
    ARRAYS,
    DELTA,
    FINAL,
    GRADIENT,
    LR,
    NUM_EXAMPLES,
    PHASE,
    PRETRAIN,
    RUN_TAG,
    SERVER_ROUND,
    TRAIN,
    UPDATE_NORM_METRICS,
    ClientUpdate,
    array_view,
    to_record,
)

__all__ = ["PersonalizedStrategy"]

# A child of Flower's logger, so our records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")

#: every run-level key at its default (docs/reference/run-config.md): the constructor defaults
#: of every strategy, so that a strategy built by hand runs what the app runs
RUN_DEFAULTS = RunSettings()

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

    **Threat model**: each stage of ``pipeline`` states its guarantee; docs/threat-model.md.

    **Defaults: the app's.** Every parameter that is a run-config key defaults to what the
    app runs this algorithm with when that key is not set (the class's ``defaults`` for keys
    at ``auto``; ``app_settings()``): ``PFLEGO(fraction_train=0.5, lr=0.1)`` runs as ``flwr
    run`` with the same keys does.

    Parameters
    ----------
    fraction_train, fraction_evaluate : float (default: ``fraction-train``, ``fraction-evaluate``)
        Fractions of the connected nodes sampled for training and evaluation (at least one).
    final_evaluate_fraction : float (default: ``final-evaluate-fraction``)
        The final round's; 0 (auto): every node up to 100 (``evaluation.EvaluationPlan``), else a
        uniform sample of max(100, 10%) of them.
    max_in_flight, pull_interval : int, float (default: ``max-in-flight``, ``pull-interval``)
        Messages outstanding at once (0, auto: 16 on Flower's simulation engine, no limit
        elsewhere) and seconds between the server's pulls (``exchange.Window``).
    evaluate_every, reply_key : int, str (default: ``evaluate-every``, "arrays")
        Evaluate every this many rounds (and always in the final); the record a training
        reply must carry: ``arrays``, ``delta`` or ``gradient``.
    lr, lr_schedule, lr_warmup_fraction, lr_halve_every (default: ``lr``, ``lr-schedule``...)
        The client learning rate and its schedule over the algorithm's rounds
        (``server_opt.ClientSchedule``).
    server_optimizer : ServerOptimizer or None (default: None)
        The apply stage; ``None``: the app's for this algorithm (``server-optimizer``,
        ``server-lr``, ...: SGD at lr 1, FedAvg, unless its ``defaults`` say otherwise).
    pretrain_rounds, pretrain_lr : int, float or None (default: ``pretrain-rounds``, None)
        FedAvg rounds on the whole model before the algorithm starts, and their client lr
        (``None`` or 0: ``lr``).
    shared_names : sequence of str or None (default: None)
        Names of the shared parameters; required when ``pretrain_rounds > 0``.
    seed : int (default: ``seed``)
        The run's seed, which every client receives: the robust rule's; never the sample's.
    sample_seed : int (default: ``sample-seed``)
        -1: a secret sample (a seed from OS entropy no message reveals); >= 0: a sample
        anyone who knows the seed can predict (``nodes.sample_stream``).
    model_fingerprint : str (default: "")
        The model every node must run, checked at the start-up handshake
        (``nodes.NodeSampler``); "": the app sets its run model's, else the nodes' plurality.
    holdout_fraction : float (default: ``holdout-fraction``)
        Share of the clients (the highest partition ids) never trained, evaluated as new.
    robust : Aggregator, None or False (default: None)
        A robust rule over the updates in place of the mean, in every phase
        (``combine.RobustRule``); ``None``: the app's (BR-FFGG's, FFGG's); ``False``: none.
    clipping : AdaptiveClipping, None or False (default: None)
        The default defence (``combine.AdaptiveClipping``); ``None``: the app's (unless a rule
        or DP replaces it; beside FFGG's rule in its small rounds); ``False``: none.
    byzantine, step_bound : int, float (default: ``robust-byzantine``, ``robust-step-bound``)
        f, the Byzantine clients per round the rule must tolerate (``combine.RobustRule``);
        the bound on each round's combined update by the history (``combine.StepBound``;
        ``None``: the app's, 2 under FFGG's default defence, else off).
    max_update_norm, update_norm_growth : float (default: ``max-update-norm``...)
        ``K`` and ``g`` of the update-norm bound (``bound.UpdateNormBound``); K = 0: off.
    max_num_examples : int (default: ``max-num-examples``)
        The absolute cap on a reply's weight; 0: 10 x the lower median of the nodes' first
        claims (``bound.ClaimBound``). A claim is capped, never a reason to drop.
    max_failed_rounds : int (default: ``max-failed-rounds``)
        Stop after this many consecutive rounds that applied no reply (``settle``); 0: never.
    algorithm, settings_fingerprint : str or None, str (default: None, "")
        The handshake (``messages.handshake``): the algorithm the clients must run (``None``:
        any the class ``serves``) and the fingerprint of their settings; the app sets both.
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before sampling.
    privacy : DPSettings or None (default: the ``dp-*`` keys)
        Differential privacy of the shared updates (``privacy``): ``central``, the clipped,
        noised mean (``combine.CentralDP``); ``local``, each client noises its update.
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
        step_bound: float | None = None,
        algorithm: str | None = None,
        settings_fingerprint: str = "",
        min_available_nodes: int = 1,
        privacy: DPSettings | None = None,
    ) -> None:
        if not 0 < fraction_train <= 1:
            raise ValueError(f"fraction_train = {fraction_train}: must be in (0, 1]")
        if reply_key not in (ARRAYS, DELTA, GRADIENT):
            raise ValueError(f"reply_key = {reply_key!r}: must be 'arrays', 'delta' or 'gradient'")
        if pretrain_rounds and shared_names is None:
            raise ValueError("pretrain_rounds > 0 needs shared_names to split the model after it")
        self.fraction_train = fraction_train
        self.evaluation = EvaluationPlan(fraction_evaluate, evaluate_every, final_evaluate_fraction)
        self.exchange = Exchange(max_in_flight, pull_interval)
        self.reply_key, self.pretrain_rounds = reply_key, pretrain_rounds
        self.steps = ClientSchedule(
            lr, lr_schedule, lr_warmup_fraction, lr_halve_every, pretrain_rounds, pretrain_lr
        )
        app = self.app_settings()
        self.server_optimizer = server_optimizer or ServerOptimizer.of(app)  # the apply stage
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
            step_bound=step_bound,
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
    #: whether the algorithm federates any parameter (``Local`` does not: its shared
    #: parameters never move, by design)
    federates = True

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, **kwargs):
        """Flower's round loop; ``num_rounds`` counts pre-training rounds too."""
        if num_rounds <= self.pretrain_rounds:
            raise ValueError(
                f"num_rounds = {num_rounds} leaves no round after {self.pretrain_rounds} "
                "pre-training rounds"
            )
        self.steps.refuse_other(kwargs.get("train_config"), type(self).__name__)
        self.num_rounds = num_rounds
        self.history = []
        self.pipeline.settle.restart()
        self._sample_checked = False
        self.run_tag = uuid.uuid4().hex[:12]
        resume = kwargs.pop("resume", None)  # a pflower.checkpoint.Checkpoint to continue
        if resume is not None:
            resume.restore(self)  # sampler, server optimizer, history, run tag... of round r
        grid, kwargs["timeout"] = self.exchange.wrap(grid, kwargs.get("timeout"))
        # as long as a round may take: a busy machine can start its nodes slowly
        self.nodes.learn_partitions(grid, timeout=kwargs.get("timeout") or 3600.0)
        if resume is not None:
            from pflower.checkpoint import continue_rounds

            return continue_rounds(
                self, grid, initial_arrays, resume.round + 1, num_rounds, **kwargs
            )
        return super().start(grid, initial_arrays, num_rounds=num_rounds, **kwargs)

    def summary(self) -> None:
        log.info("\t├──> %s", type(self).__name__)
        log.info(
            "\t│\t├── fraction train %.2f | evaluate %.2f (every %d rounds, all in the last)",
            self.fraction_train,
            self.evaluation.fraction,
            self.evaluation.every,
        )
        if self.pretrain_rounds:
            log.info(
                "\t│\t├── %d FedAvg pre-training rounds (client lr %g)",
                self.pretrain_rounds,
                self.steps.pretrain_lr,
            )
        log.info("\t│\t├── client lr %g (%s schedule)", self.steps.lr, self.steps.schedule)
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
        """The client step sizes of a round (``server_opt.ClientSchedule``)."""
        return self.steps(server_round, self.num_rounds)

    def _split_after_pretraining(self, arrays: ArrayRecord) -> ArrayRecord:
        """At the first round after pre-training: keep the shared part, set ``personal_init``."""
        if not self.pretrain_rounds or self.personal_init is not None:
            return arrays
        shared = set(self.shared_names)
        self.personal_init = ArrayRecord({k: a for k, a in arrays.items() if k not in shared})
        return ArrayRecord({k: a for k, a in arrays.items() if k in shared})

    def _messages(self, server_round, node_ids, arrays, config: dict, message_type: str):
        """The round's messages (``messages.round_messages``), kept to match the replies."""
        train, pretraining = message_type == MessageType.TRAIN, self.pretraining(server_round)
        config = {
            **config,
            **handshake(self.serves, self.settings_fingerprint),
            SERVER_ROUND: server_round,
            PHASE: PRETRAIN if pretraining else TRAIN,
            RUN_TAG: self.run_tag,
        }
        self._out = round_messages(
            node_ids,
            arrays,
            config,
            message_type,
            personal_init=self.personal_init,
            extra=self.extra_content(server_round) if train and not pretraining else {},
            # nodes whose replies keep being dropped for their values start from their init
            reset=self.pipeline.settle.reset_nodes() if train else set(),
        )
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
        return self.evaluation.due(server_round, self.num_rounds)

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        self._out = []
        if not self.should_evaluate(server_round):
            return []
        if not self.pretraining(server_round):
            arrays = self._split_after_pretraining(arrays)
        nodes = self.evaluation.sample(self.nodes, grid, server_round, self.num_rounds)
        final = server_round == self.num_rounds
        settings = {**dict(config), **self.schedule(server_round), FINAL: final}
        return self._messages(server_round, nodes, arrays, settings, MessageType.EVALUATE)

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
        """The round's update vectors (``vectors``, or ``center - vectors[i]``) through the
        combine stage in float64 (``combine``; ``kind``: their record where they are not the
        replies' updates)."""
        rnd = self._round or Round(0, reply_key=self.reply_key, kind=self.reply_key)  # alone
        return self.pipeline.combine(rnd, vectors, weights, center, kind)

    def average_weights(
        self,
        current: dict[str, np.ndarray],
        updates: list[ClientUpdate],
        weighted: bool = True,
    ) -> dict[str, np.ndarray]:
        """Mean of returned weights (data-size weighted, or uniform), applied by the server
        optimizer as the pseudo-gradient ``current - mean`` (SGD at lr 1: FedAvg): combined
        as the updates ``current - w_i``, so a robust rule sees updates, not raw weights."""
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
        back = self.pipeline.rollback(rnd, len(updates), self._current)  # the model taken?
        if back is not None:  # its replies are not applied, theta goes back
            updates, metrics["applied"] = [], 0
            metrics.update({"model-taken": 1, "rolled-back-to": rnd.taken[0]})
        # under central DP every round is a release, one without replies too
        new = self._step(rnd, updates) if updates or (self.central_dp and back is None) else None
        if new is None and back is None:
            log.warning("round %d: no usable reply; the shared parameters are unchanged",
                        server_round)  # fmt: skip
        applied = len(updates) if new is not None else 0
        if applied:
            metrics.update(self.round_metrics(updates))
            metrics.update(self.pipeline.combine.round_metrics(rnd))  # replies clipped
        if self.central_dp and new is not None:  # a release: the noised mean of the sample
            self.privacy.released(sorted(rnd.asked), new)
        if self.privacy is not None:
            metrics.update(self.privacy.metrics())
        entry.train = metrics
        settle = self.pipeline.settle
        settle(rnd, applied)  # resets, and the run stopped after failed rounds
        settle.phase(*self._phase(server_round), server_round, applied)
        arrays = None
        if new is not None:
            # np.asarray, not np.ascontiguousarray: that one turns a 0-dim array into shape
            # (1,), which the clients then refuse as a layout they do not hold
            arrays = {k: np.asarray(v, dtype=rnd.current[k].dtype) for k, v in new.items()}
        if self.federates:  # a run whose shared parameters never moved did nothing
            moved = settle.moved or (
                arrays is not None
                and any(not np.array_equal(a, rnd.current[k]) for k, a in arrays.items())
            )
            settle.moves(server_round, self.num_rounds, moved)
        if arrays is None:
            return back or self._current, MetricRecord(metrics)
        return to_record(arrays), MetricRecord(metrics)  # the .npy bytes, copied once

    def _phase(self, server_round: int) -> tuple[str, range]:
        """The phase of a training round and its rounds: pre-training, or the algorithm's."""
        if self.pretraining(server_round):
            return "pre-training", range(1, self.pretrain_rounds + 1)
        return "training", range(self.pretrain_rounds + 1, self.num_rounds + 1)

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
