"""``PersonalizedStrategy``, the server loop every pflower strategy runs (a Flower
message-API ``Strategy``):

- samples clients uniformly **without replacement** from its own generator, secret unless
  ``sample_seed`` >= 0, after a start-up handshake that refuses nodes running another model
  or data, or claiming another's partition id (``nodes.NodeSampling``);
- sends only the shared parameters (``arrays``) and a ``config`` record;
- checks every reply before aggregation (``checks.ReplyChecks``): a reply that is an error,
  lacks the algorithm's reply key (``arrays``, ``delta`` or ``gradient``), carries other
  records, other names, shapes or dtypes than the shared parameters, non-finite values, or
  metrics out of range is **dropped and counted** (logged with its node id); a
  ``num-examples`` claim is a weight, capped (``checks.ClaimBound``), never a reason to drop;
  the update-norm and claim bounds hold at every round size; the round goes on. (Flower's own
  ``FedAvg`` raises on inconsistent replies: one bad client would stop the run.)
- sends the handshake (``algorithm``, ``settings-fingerprint``) with every message;
- aggregates evaluation per DESIGN.md: pooled accuracy, mean over clients, p10/p50/p90,
  worst client, and the number of clients whose personalized accuracy is below the global
  model's. Evaluation runs every ``evaluate_every`` rounds; the final round evaluates
  every client up to 100 clients, a uniform sample of max(100, 10%) past that
  (``final_evaluate_fraction``);
- keeps at most ``max_in_flight`` messages outstanding (16 on the simulation engine) and
  combines replies in partition order, so that arrival order changes no bit of a result.

Its pieces live in small modules: ``pflower.wire`` (keys, reply layout check), ``checks``
(reply checks, bounds, handshake counting, failed rounds), ``history`` (round log, client
summaries), ``combine`` (means, robust rules); the client
side is ``client`` (``ClientJob``, ``ClientHalf``), which imports nothing from here.

Why this module is over 400 lines: it is one class, the round loop whose methods Flower's
``Strategy.start`` calls (configure / aggregate for training and evaluation, pre-training,
the lifecycle); about 110 of its lines are the docstring of every constructor parameter
(STYLE.md) and 100 their validation. Everything with a job of its own has left it (checks,
combine, nodes, history, server_opt).
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pflower.flower import grids
from pflower.settings import RunSettings
from pflower.strategies.aggregators import Aggregator
from pflower.strategies.checks import CLAIMS_CAPPED, ReplyChecks
from pflower.strategies.combine import (
    MIN_RULE_INPUTS,
    AdaptiveClipping,
    adaptive_clipping,
    linear_update,
    robust_aggregator,
    robust_combine,
    weighted_mean,
    weighted_mean_of_updates,
)
from pflower.strategies.history import RoundLog, summarize_clients, weighted_mean_metrics
from pflower.strategies.nodes import (
    NodeSampling,
    RoundDeadline,
    Window,
    index_dispatch,
    shorten_pull_backoff,
)
from pflower.strategies.privacy import POISSON, DPSettings, Mechanism, noise_rng
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
    OMNISCIENT_TAG,
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
    settings_fingerprint,
    to_record,
)

if TYPE_CHECKING:
    from pflower.settings import RunSettings

# A child of Flower's logger, so our records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


#: every run-level key at its default (docs/reference/run-config.md): the constructor defaults
#: of every strategy, so that a strategy built by hand runs what the app runs
RUN_DEFAULTS = RunSettings()
#: ``final_evaluate_fraction`` = 0: up to this many nodes the final round evaluates them all
FINAL_EVALUATE_ALL = 100
#: ``max_in_flight`` = 0 on Flower's simulation engine: messages outstanding at once
SIMULATION_WINDOW = 16


class RoundSkipped(Exception):
    """This round's replies cannot be combined (too few for the robust rule's breakdown
    point and ``byzantine``): the round leaves the shared parameters unchanged."""


class PersonalizedStrategy(ReplyChecks, NodeSampling, Strategy):
    """Base strategy: sampling, messages, reply checks, per-client evaluation metrics.

    Subclasses implement ``aggregate`` (checked updates -> new shared arrays) and may add
    settings to each round's config with ``train_config``.

    **Pipeline.** With ``pretrain_rounds = P > 0`` the first P rounds are FedAvg on the whole
    model (config ``phase = "pretrain"``, reply key ``arrays``); then the model is split: the
    shared part ``shared_names`` goes on as the algorithm's ``arrays``, and the rest, the
    pre-trained personal slice, is sent as ``personal-init`` with every later message so that
    a client without personal state starts from it (Pillutla et al. 2022, step (a) -> (b)).
    It is the global model's slice, not any client's personal state.

    **Threat model** (``pflower.strategies.checks`` states each bound's guarantee). Without a
    robust rule pflower tolerates *broken* clients: errors, missing or extra records, wrong
    names, shapes or dtypes, NaN/Inf, malformed metrics, any ``num-examples`` (a bounded
    weight), and finite outliers beyond the update-norm bound, at every round size; a Byzantine
    minority can move a mean by at most its weight times the bound per round. Colluding
    clients whose updates stay within the honest spread (ALIE, IPM, label flipping) need a
    robust rule (``robust``) and enough replies for its breakdown point; a round with too
    few replies for the rule is skipped, counted, never crashes the run.

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
        At most this many messages outstanding at once (``nodes.Window``); 0 (auto): 16 on
        Flower's simulation engine, whose dispatcher costs nodes x outstanding messages per
        tick, no limit elsewhere.
    pull_interval : float (default: ``pull-interval``)
        Seconds between the server's pulls for replies while it waits, on Flower's simulation
        engine and in deployment (``nodes.Window``; Flower 1.41's deployment grid sleeps 3 s
        between pulls).
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
        -1: clients are sampled from a secret seed drawn from OS entropy now
        (``nodes.SecretRandom``), which nothing sent to a client reveals (``sampling`` holds
        it; checkpoints record it, and ``results.json`` unless ``privacy`` is on); >= 0:
        ``random.Random(sample_seed)``, a reproducible sample anyone who knows the seed can
        predict (under ``privacy``: accounted without amplification).
    model_fingerprint : str (default: "")
        The fingerprint (``pflower.task.fingerprint.model_fingerprint``) of the model every
        node must run, checked at the start-up handshake; "": the app sets its run model's,
        a strategy built by hand compares the nodes with the value most of them report.
    holdout_fraction : float (default: ``holdout-fraction``)
        Share of the clients (the highest partition ids) never sampled for training: they
        are evaluated as new clients (their personal part from the algorithm's new-client
        rule) next to the trained ones.
    robust : Aggregator, None or False (default: None)
        A robust rule (``pflower.strategies.aggregators``) applied to the clients' *updates*
        (gradients, deltas, or ``current - returned weights``), unweighted, in place of the
        (weighted) mean, in every phase: pre-training rounds too. ``None``: the app's for
        this algorithm at its defaults: none (the algorithm's own mean, under adaptive
        clipping), unless its ``defaults`` or its default ``defence`` name one (BR-FFGG;
        FFGG: bucketing and the median). ``False``: no rule.
    byzantine : int (default: ``robust-byzantine``)
        Number f of Byzantine clients per round the robust rule must tolerate; checked
        against the rule's breakdown point at the first round (the sample size) and in every
        round against the replies kept: a round that cannot tolerate f is skipped and
        counted (``skipped``), never combined with a smaller f.
    attack_simulation : callable or None (default: None)
        **Attack simulation, for robustness experiments only**:
        ``pflower.experiments.attacks.simulate_omniscient``, which replaces the replies tagged
        by ALIE / IPM nodes by the omniscient adversary's vector, computed from the round's
        honest replies. The app passes it with ``attack-simulation = true``; the strategies
        never import experiment code. None: tagged replies are dropped.
    max_update_norm : float (default: ``max-update-norm``)
        ``K``: drop a training reply whose update (gradient, delta, or ``current - returned
        weights``) is longer than ``K`` times the reference ``R`` of its kind, at every round
        size. ``R`` starts at ``S / K`` (``S`` the shared parameters' norm, over the client lr
        for gradients: the first rounds accept updates up to the model's own size) and moves
        only by a round's lower median of update norms, by at most ``update_norm_growth`` per
        round, never down (``checks.UpdateNormBound``). 1000 leaves room for honest PFLEGO
        gradients (a client sampled again after many rounds reached 103 x the run's largest
        median) while a broken client's 1e30 is far beyond it. 0 turns the bound off. Off
        under central DP: its clip to ``dp-clip`` replaces it (a reply is clipped, never
        dropped for its size, and no reference drawn from the others decides about it).
    update_norm_growth : float (default: ``update-norm-growth``)
        ``g``: the reference grows by at most this factor per round, so no sequence of
        replies can walk it up faster (after r rounds ``R <= g^r S / K``).
    max_num_examples : int (default: ``max-num-examples``)
        A reply's weight (its ``num-examples`` claim) is at most this; 0: at most
        ``checks.CLAIM_FACTOR`` (10) times the lower median of the nodes' first claims, every
        node counted once (``checks.ClaimBound``). Either way a claim above it is capped,
        never dropped, and a node weighs at most what it reported at start-up (when the
        strategy asked) or in its first weighed reply. Set it above every honest size to
        weigh each reply by its claim (the papers' weights). Under central DP a claim weighs
        nothing in the mean, and only this and its node's first claim bound it (no median
        of the others' claims).
    max_failed_rounds : int (default: ``max-failed-rounds``)
        Stop the run (``checks.RunFailed``, with the drop reasons) after this many
        consecutive training rounds that applied no reply; 0: never.
    algorithm : str or None (default: None)
        The name sent in the handshake (``algorithm`` in every message's config); ``None``:
        the class's ``algorithm``. The app sets the run config's.
    settings_fingerprint : str (default: "")
        A fingerprint of the client settings (``pflower.wire.settings_fingerprint``) sent in
        the handshake; the app sends the run config's, a strategy built by hand none.
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before sampling.
    privacy : DPSettings or None (default: the ``dp-*`` keys: ``dp``, ``dp-clip``...)
        User-level differential privacy of the shared updates (``pflower.strategies.privacy``):
        ``central`` replaces ``combine``'s mean by the clipped, noised mean over the sampled
        clients in every phase and for every algorithm (a robust rule is refused with it);
        ``local`` has the clients clip and noise their updates (the client halves read the
        run config) and lets honest noised updates through the update-norm bound. Either
        way the accountant's epsilon is reported as the round metric ``dp-epsilon``.
    """

    #: the handshake's algorithm names of a strategy built by hand: the registry's names of
    #: the client halves it serves, "|"-separated (each algorithm's class sets its own; the
    #: app sends the run config's ``algorithm``)
    algorithm = "fedavg|fedavg-ft"

    #: this algorithm's values for the run-config keys left at ``auto`` (``settings.AUTO``),
    #: the same mapping its registration declares (``registry.Algorithm.defaults``): a
    #: strategy built by hand uses them as the app does (``app_settings``)
    defaults: ClassVar[Mapping[str, Any]] = {}
    #: its default defence where it is not adaptive clipping (``registry.Algorithm.defence``)
    defence: ClassVar[Mapping[str, Any]] = {}

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
        clipping: AdaptiveClipping | bool | None = None,
        byzantine: int = RUN_DEFAULTS.robust_byzantine,
        attack_simulation: Callable | None = None,
        max_update_norm: float = RUN_DEFAULTS.max_update_norm,
        update_norm_growth: float = RUN_DEFAULTS.update_norm_growth,
        max_num_examples: int = RUN_DEFAULTS.max_num_examples,
        max_failed_rounds: int = RUN_DEFAULTS.max_failed_rounds,
        algorithm: str | None = None,
        settings_fingerprint: str = "",
        min_available_nodes: int = 1,
        privacy: DPSettings | None = None,
    ) -> None:
        if not 0 < fraction_train <= 1:
            raise ValueError(f"fraction_train = {fraction_train}: must be in (0, 1]")
        if not 0 < fraction_evaluate <= 1:
            raise ValueError(f"fraction_evaluate = {fraction_evaluate}: must be in (0, 1]")
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every = {evaluate_every}: must be >= 1")
        if not 0 <= final_evaluate_fraction <= 1:
            raise ValueError(
                f"final_evaluate_fraction = {final_evaluate_fraction}: must be in [0, 1] "
                "(0: every node up to 100, else max(100, 10%) of them)"
            )
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight = {max_in_flight}: must be >= 0 (0: auto)")
        if not 0.01 <= pull_interval <= 60:
            raise ValueError(f"pull_interval = {pull_interval}: must be in [0.01, 60] seconds")
        if reply_key not in (ARRAYS, DELTA, GRADIENT):
            raise ValueError(
                f"reply_key = {reply_key!r}: must be {ARRAYS!r}, {DELTA!r} or {GRADIENT!r}"
            )
        if not lr > 0:
            raise ValueError(f"lr = {lr}: must be > 0")
        if pretrain_rounds < 0:
            raise ValueError(f"pretrain_rounds = {pretrain_rounds}: must be >= 0")
        if pretrain_rounds and shared_names is None:
            raise ValueError("pretrain_rounds > 0 needs shared_names to split the model after it")
        client_lr(lr, 1, 1, lr_schedule)  # validates the schedule name
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.evaluate_every = evaluate_every
        self.final_evaluate_fraction = final_evaluate_fraction
        self.max_in_flight = max_in_flight
        self.pull_interval = pull_interval
        self.reply_key = reply_key
        self.lr = lr
        self.lr_schedule = lr_schedule
        self.lr_warmup_fraction = lr_warmup_fraction
        self.lr_halve_every = lr_halve_every
        app = self.app_settings()
        self.server_optimizer = server_optimizer or ServerOptimizer.of(app)
        self.pretrain_rounds = pretrain_rounds
        self.pretrain_lr = pretrain_lr or lr
        self.shared_names = list(shared_names) if shared_names is not None else None
        if not 0 <= holdout_fraction < 1:
            raise ValueError(f"holdout_fraction = {holdout_fraction}: must be in [0, 1)")
        self.holdout_fraction = holdout_fraction
        if byzantine < 0:
            raise ValueError(f"byzantine = {byzantine}: must be >= 0")
        privacy = privacy or DPSettings.of(app)
        given_robust = robust
        if robust is None:  # the algorithm's rule (BR-FFGG's, FFGG's), drawing from this seed
            # under DP its clip is the defence: the default defence's rule is not taken
            rules = RUN_DEFAULTS.resolved(self.defaults) if privacy.on else app
            robust = robust_aggregator(rules.model_copy(update={"seed": seed}))
        self.robust = None if robust is False else robust
        self.byzantine = byzantine
        self.privacy = Mechanism(privacy) if privacy.on else None
        #: dp-sampling = "poisson": each eligible node trains on its own coin (NodeSampling)
        self.poisson_train = self.central_dp and privacy.sampling == POISSON
        if clipping is None:  # the app's: adaptive clipping unless a rule or DP replaces it;
            # beside the app's own rule, in the rounds too small for it (robust-small-rounds)
            small = given_robust is None and app.robust_small_rounds == "clip"
            ours = self.robust is None or small
            clipping = adaptive_clipping(app) if ours and not privacy.on else False
        #: with ``robust`` too: the bound of the rounds whose rule combines < 5 values
        self.clipping = clipping or None
        if self.central_dp and (self.robust is not None or self.clipping is not None):
            raise ValueError(
                "privacy mode 'central' with a robust rule or the default defence's clipping: "
                "the noise is calibrated to the mean's sensitivity, and their statistics across "
                "replies would decide one reply by the others; use local DP with a robust rule, "
                "or no rule"
            )
        self.attack_simulation = attack_simulation
        self.init_checks(max_update_norm, update_norm_growth, max_num_examples, max_failed_rounds)
        self.max_update_norm, self.max_num_examples = max_update_norm, max_num_examples
        if algorithm is not None:
            self.algorithm = algorithm
        self.settings_fingerprint = settings_fingerprint
        self.min_available_nodes = min_available_nodes
        self.init_sampling(sample_seed, model_fingerprint)  # rng, sampling, the handshake
        self.num_rounds = 0
        self.history: list[RoundLog] = []
        self.final_clients: list[dict[str, float]] = []
        self.personal_init: ArrayRecord | None = None
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        self.num_train_of: dict[int, int] = {}  # node id -> training examples (if queried)
        self.query_num_train = False  # ask every node for its num-train at start-up too
        self.extra_reply_keys: tuple[str, ...] = ()  # records a reply carries besides reply_key
        self._current: ArrayRecord = ArrayRecord()
        self._asked: set[int] = set()  # the nodes of the round's messages
        self.sampled_from = 0  # how many nodes the last training sample was drawn from
        self._sent: list[Message] = []  # the round's messages (``sender``)
        #: sent with every message: devices version their state by (run tag, round)
        #: (``context_store.ScopedStore``); a run resumed from a checkpoint keeps its tag
        self.run_tag = ""
        self._round_start = 0.0
        self._train_round = 0  # the round whose noise ``combine`` draws (dp-noise-seed)
        self._clipped: dict[str, int] = {}  # this round's clipped replies by kind of update
        self._round_nodes: list[int] = []  # the node of each update the round combines
        self._robust_checked = False  # check_robust at the run's first training round

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

    # --- lifecycle -------------------------------------------------------------------------
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
        self.failed_rounds, self.value_drops = 0, {}
        self._robust_checked = False
        self.run_tag = uuid.uuid4().hex[:12]
        resume = kwargs.pop("resume", None)  # a pflower.checkpoint.Checkpoint to continue
        if resume is not None:
            resume.restore(self)  # sampler, server optimizer, history, run tag... of round r
        engine = grids.engine_of(grid)
        simulated = engine == grids.SIMULATION  # Flower's simulation engine, in this process
        if simulated:
            index_dispatch()
        window = self.max_in_flight or (SIMULATION_WINDOW if simulated else 0)
        if engine == grids.DEPLOYMENT:  # Flower's deployment grid: 3 s pulls, 1 s backoff
            shorten_pull_backoff(min(self.pull_interval, 1.0))
        # a grid not recognised (``other``) takes the safe path: pulled through the window
        if window or engine in (grids.DEPLOYMENT, grids.OTHER):
            grid = Window(grid, window or None, self.pull_interval)
        if not kwargs.get("timeout"):  # 0 / None: each round waits as long as the work needs
            grid, kwargs["timeout"] = RoundDeadline(grid), None
        # as long as a round may take: a busy machine can start its nodes slowly
        self.learn_partitions(grid, timeout=kwargs.get("timeout") or 3600.0)
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
        log.info("\t│\t├── client sample %s", self.sample_line())
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

    # --- sampling and messages -------------------------------------------------------------
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
        """What every message says about the server's run: its algorithm and, when built
        from a run config, the fingerprint of the settings its clients must share."""
        shake = {ALGORITHM: self.algorithm}
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
        reset = self.personal_reset_nodes() if message_type == MessageType.TRAIN else set()
        reset_content = content_with({**config, PERSONAL_RESET: True}) if reset else None
        self._sent = [
            Message(
                content=reset_content if n in reset else content,
                message_type=message_type,
                dst_node_id=n,
            )
            for n in node_ids
        ]
        return self._sent

    def extra_content(self, server_round: int) -> dict[str, ArrayRecord]:
        """Further ArrayRecords sent with each training message (e.g. Scaffold's control
        variate); none by default."""
        return {}

    def check_robust(self, num_replies: int) -> None:
        """Refuse, before training starts, a robust rule that cannot combine a round's
        ``num_replies`` with ``byzantine`` of them Byzantine."""
        if self.robust is None:
            if self.byzantine:
                raise ValueError(
                    f"key 'robust-byzantine' = {self.byzantine}: needs a robust aggregator "
                    "('robust-aggregator'); the mean tolerates none"
                )
            return
        problem = self.robust.problem(num_replies, self.byzantine)
        if problem:
            raise ValueError(
                f"keys 'robust-aggregator' / 'robust-byzantine' = {self.byzantine} / "
                f"'robust-krum-m' / 'fraction-train': {problem}; each round samples "
                f"{num_replies} nodes"
            )

    def configure_train(self, server_round, arrays, config, grid) -> Iterable[Message]:
        self._round_start = time.perf_counter()
        if not self.pretraining(server_round):
            arrays = self._split_after_pretraining(arrays)
        self._current = arrays
        nodes = self.sample(grid, self.fraction_train, train=True)
        if not self._robust_checked:  # the rule runs from the first round, pre-training too
            self.check_robust(len(nodes))
            self._robust_checked = True
        if self.privacy is not None:
            # issue 46: q from the nodes eligible when this round sampled (they join and leave)
            eligible = self.sampled_from
            if not self.privacy.started:  # the first training round: the population known
                # issue 46: a sample others can reproduce (sample-seed >= 0) amplifies nothing
                self.privacy.start(
                    eligible,
                    len(nodes),
                    self.num_rounds,
                    amplified=self.sampling["secret"],
                    rate=self.fraction_train,
                )
                problem = self.privacy.signal_problem(
                    sum(int(np.prod(a.shape)) for a in arrays.values())
                )
                if problem:
                    log.warning("dp: %s", problem)
            self.privacy.check(nodes, eligible)
            self.privacy.observe({k: array_view(a) for k, a in arrays.items()})  # canaries
        log.info("round %d: training on %d nodes", server_round, len(nodes))
        self._asked = set(nodes)
        self._train_round = server_round
        settings = {**dict(config), **self.train_config(server_round)}
        return self._messages(server_round, nodes, arrays, settings, MessageType.TRAIN)

    def should_evaluate(self, server_round: int) -> bool:
        return server_round == self.num_rounds or server_round % self.evaluate_every == 0

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        self._asked = set()
        if not self.should_evaluate(server_round):
            return []
        if not self.pretraining(server_round):
            arrays = self._split_after_pretraining(arrays)
        final = server_round == self.num_rounds
        if final:
            fraction = self.final_fraction(len(list(grid.get_node_ids())))
            nodes = self.sample(grid, fraction, everyone=fraction == 1.0)
        else:
            nodes = self.sample(grid, self.fraction_evaluate)
        self._asked = set(nodes)
        settings = {**dict(config), **self.schedule(server_round), FINAL: final}
        return self._messages(server_round, nodes, arrays, settings, MessageType.EVALUATE)

    def final_fraction(self, num_nodes: int) -> float:
        """The share of nodes the final round evaluates (``final_evaluate_fraction``)."""
        if self.final_evaluate_fraction:
            return self.final_evaluate_fraction
        if num_nodes <= FINAL_EVALUATE_ALL:
            return 1.0
        return max(FINAL_EVALUATE_ALL, round(0.1 * num_nodes)) / num_nodes

    # --- aggregation -----------------------------------------------------------------------
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
        """The clients' update vectors (``vectors``, or ``center - vectors[i]`` for returned
        weights) combined: their weighted mean in float64 or, with ``robust``, the robust
        rule over them (unweighted; f = ``byzantine``, checked against the replies kept in
        every round: a round that cannot meet the rule's preconditions raises
        ``RoundSkipped``). Both read the replies in place and never hold all N updates
        (``combine.weighted_mean_of_updates``, ``robust_combine``)."""
        if self.central_dp:  # the clipped, noised mean over the sampled clients
            rng = noise_rng(self.privacy.dp.seed, self._train_round)
            return self.privacy.mean(vectors, len(self._asked), rng, center)
        if self.clipping is not None:  # the default defence: the mean of clipped updates
            kind = kind or (PRETRAIN if self.pretraining(self._train_round) else self.reply_key)
            # beside a rule (robust-small-rounds = "clip") every round keeps the clip's state
            # (rho: what a round of >= 3 replies applied), and the clip replaces the rule where
            # it combines fewer than MIN_RULE_INPUTS values (bucket means): a median of 1 or 2
            # is their mean, which one reply moves by its whole share at any size the
            # update-norm bound lets through, and with 4 replies a round one Byzantine in ten
            # cost FFGG's geometric median 7.53 points, the clip 3.08 (3 seeds each)
            beta, clipped = self.clipping.coefficients(
                kind, vectors, weights, center, self._round_nodes or None, self.sampled_from
            )
            if self.robust is None or self.robust.inputs(len(vectors)) < MIN_RULE_INPUTS:
                self._clipped[kind] = clipped
                if beta is not None:
                    return linear_update(vectors, beta, center)
                return self.combine_mean(vectors, weights, center)
        if self.robust is None:
            return self.combine_mean(vectors, weights, center)
        # f counts the round's faulty nodes: every sampled node without a kept reply (dropped
        # for its reply, an error, or silent) is one of them, so the kept replies hold at
        # most f_kept; a rule that cannot run with them is skipped, never weakened, and where
        # f_kept = 0 every kept reply is honest and the mean (the algorithm's own) serves
        f_kept = self.byzantine_kept(len(vectors))
        problem = self.robust.problem(len(vectors), f_kept)
        if problem and f_kept == 0:
            return self.combine_mean(vectors, weights, center)
        if problem:
            raise RoundSkipped(problem)
        return robust_combine(self.robust, vectors, f_kept, center)

    def byzantine_kept(self, kept: int) -> int:
        """How many of ``kept`` replies may be Byzantine: ``byzantine`` less the round's
        sampled nodes that left no kept reply (each of them one of the faulty nodes f
        bounds)."""
        return max(0, self.byzantine - max(0, len(self._asked) - kept))

    @staticmethod
    def combine_mean(vectors, weights, center=None) -> dict[str, np.ndarray]:
        """The weighted mean of the update vectors (of ``center - vectors[i]``)."""
        if center is not None:
            return weighted_mean_of_updates(center, vectors, weights)
        return weighted_mean(vectors, weights)

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

    def simulate_omniscient(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> list[ClientUpdate]:
        """Robustness experiments only: ALIE / IPM replies replaced by the omniscient
        adversary's vector (``attack_simulation``, passed in by the app: the strategies, which
        the device path imports, import no experiment code); without it a tagged reply is
        dropped."""
        if self.attack_simulation is not None:
            return self.attack_simulation(
                server_round,
                current,
                updates,
                enabled=True,
                weights=self.pretraining(server_round) or self.reply_key == ARRAYS,
                drop=self._drop,
            )
        for u in updates:
            if OMNISCIENT_TAG in u.metrics:
                self._drop(
                    server_round, u.node_id, "omniscient-attack tag without attack-simulation"
                )
        return [u for u in updates if OMNISCIENT_TAG not in u.metrics]

    def pretrain_aggregate(
        self, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        """A pre-training round (FedAvg on the whole model, no server optimizer): the
        data-size weighted mean of the returned weights or, with ``robust``, ``current`` minus
        the robust rule over the updates ``current - w_i``: every phase meets the rule."""
        tensors, sizes = [u.tensors for u in updates], [u.num_examples for u in updates]
        if self.robust is None and not self.central_dp and self.clipping is None:
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
        # in partition order, not arrival order: float sums then do not depend on timing
        replies = self._answers(server_round, self._in_order(replies))
        self._count_silent(server_round, replies)
        if self.privacy is not None and self.privacy.local:  # every report left its client
            self.privacy.released([self.sender(m) for m in replies if not m.has_error()])
        updates = self.check_train_replies(server_round, replies)
        # read-only views of the sent parameters' bytes (Array.numpy() copies and re-parses)
        current = {k: array_view(a) for k, a in self._current.items()}
        updates = self.simulate_omniscient(server_round, current, updates)
        updates = self.bound_updates(server_round, current, updates)
        self._clipped = {}  # by kind of update: the replies the default defence clipped
        self._round_nodes = [u.node_id for u in updates]  # the node of each combined vector
        entry = self._log(server_round)
        entry.seconds = time.perf_counter() - self._round_start
        metrics = {
            "replies": len(replies),
            "applied": len(updates),
            "dropped": len(replies) - len(updates),
        }
        if self.train_claims_capped:  # kept, weighed at the cap (``checks.ClaimBound``)
            metrics[CLAIMS_CAPPED] = self.train_claims_capped
        if not updates and self.central_dp:  # issue 46: still a release, noised and counted
            return self._release_nothing(server_round, current, metrics, entry)
        if not updates:
            log.warning(
                "round %d: no usable reply; the shared parameters are unchanged", server_round
            )
            if self.privacy is not None:
                metrics.update(self.privacy.metrics())
            entry.train = metrics
            self.settle_round(server_round, applied=0)
            return self._current, MetricRecord(metrics)
        try:
            if self.pretraining(server_round):
                new = self.pretrain_aggregate(current, updates)
            else:
                new = self.aggregate(server_round, current, updates)
        except RoundSkipped as skipped:  # too few replies left for the robust rule
            log.warning(
                "round %d: skipped, the shared parameters are unchanged: %s", server_round, skipped
            )
            metrics.update(applied=0, skipped=1)
            if self.privacy is not None:
                metrics.update(self.privacy.metrics())
            entry.train = metrics
            self.settle_round(server_round, applied=0)
            return self._current, MetricRecord(metrics)
        self.settle_round(server_round, applied=len(updates))
        metrics.update(self.round_metrics(updates))
        if self.clipping is not None:  # replies clipped, of the reply key and each record
            main = PRETRAIN if self.pretraining(server_round) else self.reply_key
            metrics["clipped"] = self._clipped.get(main, 0)
            metrics.update(
                {f"clipped-{k}": n for k, n in sorted(self._clipped.items()) if k != main}
            )
        if self.privacy is not None:
            if self.central_dp:  # a release: the noised mean of the sampled clients
                self.privacy.released(sorted(self._asked), new)
            metrics.update(self.privacy.metrics())
        entry.train = metrics
        # np.asarray, not np.ascontiguousarray: that one turns a 0-dim array into shape (1,),
        # which the clients then refuse as a layout they do not hold; to_array: the .npy
        # bytes of Array(ndarray), the values copied once
        arrays = to_record({k: np.asarray(v, dtype=current[k].dtype) for k, v in new.items()})
        return arrays, MetricRecord(metrics)

    # --- issue 46: central DP releases every training round ---------------------------------
    def _release_nothing(
        self, server_round: int, current: dict[str, np.ndarray], metrics: dict, entry: RoundLog
    ) -> tuple[ArrayRecord, MetricRecord]:
        """Central DP, a training round that kept no reply (every one dropped, or none came):
        released all the same, the algorithm's step on the noised mean of no contribution,
        and accounted. Unchanged parameters would tell that every reply was dropped, which
        depends on the clients' data, and would spend nothing on it."""
        log.warning("round %d: no usable reply; released with noise alone (dp)", server_round)
        nothing = [self.zero_update(server_round, current)]
        if self.pretraining(server_round):
            new = self.pretrain_aggregate(current, nothing)
        else:
            new = self.aggregate(server_round, current, nothing)
        self.privacy.released(sorted(self._asked), new)
        metrics.update(self.privacy.metrics())
        entry.train = metrics
        self.settle_round(server_round, applied=0)
        arrays = to_record({k: np.asarray(v, dtype=current[k].dtype) for k, v in new.items()})
        return arrays, MetricRecord(metrics)

    def zero_update(self, server_round: int, current: Mapping[str, np.ndarray]) -> ClientUpdate:
        """A reply that contributes nothing (the mechanism adds a zero update to neither the
        sum nor the adaptive clip's count): the sent weights back, or a zero gradient or delta
        (and zero further records, shaped like the shared parameters as theirs are)."""
        weights = self.pretraining(server_round) or self.reply_key == ARRAYS
        tensors = {
            k: np.array(a) if weights else np.zeros(a.shape, a.dtype) for k, a in current.items()
        }
        extra = {
            key: {k: np.zeros(a.shape, a.dtype) for k, a in current.items()}
            for key in (() if self.pretraining(server_round) else self.extra_reply_keys)
        }
        return ClientUpdate(-1, tensors, {NUM_EXAMPLES: 1.0}, extra, norm=0.0)

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        replies = self._answers(server_round, self._in_order(replies))
        self._count_silent(server_round, replies)
        rows = []
        for msg in replies:
            metrics = self._metrics(server_round, msg, [NUM_EXAMPLES, "personal-loss"])
            if metrics is not None:
                rows.append((self.sender(msg), metrics))
        # the metrics most clients report (accuracies for a classifier...) every row must
        # have: one reply without them is dropped, not a KeyError in the summary
        counts: dict[str, int] = {}
        for _, metrics in rows:
            for key in metrics:
                counts[key] = counts.get(key, 0) + 1
        expected = {k for k, c in counts.items() if 2 * c > len(rows)}
        kept = []
        for node, metrics in rows:
            missing = sorted(expected - set(metrics))
            if missing:
                self._drop(server_round, node, f"metric {missing[0]!r} missing")
            else:
                kept.append((node, metrics))
        # each row weighs by its bounded claim (its metrics carry it); losses are clipped in
        # the summary (``history.summarize_clients``)
        rows = [metrics for _, metrics in self.check_evaluate_claims(server_round, kept)]
        if not rows:
            return None
        summary = summarize_clients(rows)
        if self.eval_claims_capped:
            summary[CLAIMS_CAPPED] = self.eval_claims_capped
        self._log(server_round).evaluate = summary
        if server_round == self.num_rounds:
            self.final_clients = rows
        return MetricRecord(summary)


def strategy_kwargs(cfg: RunSettings, shared_names: Sequence[str] | None = None) -> dict:
    """The base-strategy settings of a run config."""
    return {
        "fraction_train": cfg.fraction_train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "evaluate_every": cfg.evaluate_every,
        "final_evaluate_fraction": cfg.final_evaluate_fraction,
        "max_in_flight": cfg.max_in_flight,
        "pull_interval": cfg.pull_interval,
        "lr": cfg.lr,
        "lr_schedule": cfg.lr_schedule,
        "lr_warmup_fraction": cfg.lr_warmup_fraction,
        "lr_halve_every": cfg.lr_halve_every,
        "server_optimizer": ServerOptimizer.of(cfg),
        "pretrain_rounds": cfg.pretrain_rounds,
        "pretrain_lr": cfg.effective_pretrain_lr,
        "shared_names": shared_names,
        "seed": cfg.seed,
        "sample_seed": cfg.sample_seed,
        "holdout_fraction": cfg.holdout_fraction,
        "robust": robust_aggregator(cfg) or False,  # False: the run config names none
        "clipping": adaptive_clipping(cfg) or False,
        "byzantine": cfg.robust_byzantine,
        "max_update_norm": cfg.max_update_norm,
        "update_norm_growth": cfg.update_norm_growth,
        "max_num_examples": cfg.max_num_examples,
        "max_failed_rounds": cfg.max_failed_rounds,
        "algorithm": cfg.algorithm,
        "settings_fingerprint": settings_fingerprint(cfg),
        "privacy": DPSettings.of(cfg),
    }
