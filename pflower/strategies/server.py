"""``PersonalizedStrategy``, the server loop every pflower strategy runs (a Flower
message-API ``Strategy``):

- samples clients uniformly **without replacement** from its own seeded generator;
- sends only the shared parameters (``arrays``) and a ``config`` record;
- checks every reply before aggregation: a reply that is an error, lacks the algorithm's
  reply key (``arrays``, ``delta`` or ``gradient``), carries other records, other names,
  shapes or dtypes than the shared parameters, non-finite values, or no ``num-examples``
  is **dropped and counted** (logged with its node id); the round goes on. (Flower's own
  ``FedAvg`` raises on inconsistent replies: one bad client would stop the run.)
- aggregates evaluation per DESIGN.md: pooled accuracy, mean over clients, p10/p50/p90,
  worst client, and the number of clients whose personalized accuracy is below the global
  model's. Evaluation runs every ``evaluate_every`` rounds; the final round evaluates
  every client up to 100 clients, a seeded sample of max(100, 10%) past that
  (``final_evaluate_fraction``);
- keeps at most ``max_in_flight`` messages outstanding (16 on the simulation engine) and
  combines replies in partition order, so that arrival order changes no bit of a result.

Its pieces live in small modules: ``pflower.wire`` (keys, reply layout check),
``history`` (round log, client summaries), ``combine`` (means, robust rules); the client
side is ``client`` (``ClientJob``, ``ClientHalf``), which imports nothing from here.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pflower.experiments import attacks
from pflower.strategies.aggregators import Aggregator
from pflower.strategies.combine import (
    robust_aggregator,
    robust_combine,
    weighted_mean,
    weighted_mean_of_updates,
)
from pflower.strategies.history import RoundLog, summarize_clients, weighted_mean_metrics
from pflower.strategies.nodes import NodeSampling, RoundDeadline, Window, in_memory_grid
from pflower.strategies.server_opt import ServerOptimizer, client_lr
from pflower.wire import (
    ARRAYS,
    CONFIG,
    DELTA,
    FINAL,
    GRADIENT,
    LR,
    LR_SCALE,
    NUM_EXAMPLES,
    PERSONAL_INIT,
    PHASE,
    PRETRAIN,
    RUN_TAG,
    SERVER_ROUND,
    TRAIN,
    ClientUpdate,
    array_view,
    layout_problem,
    metrics_problem,
)

if TYPE_CHECKING:
    from pflower.config import Config

# A child of Flower's logger, so our records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


#: without ``max_num_examples``: a claim above this many times the round's median is a lie
NUM_EXAMPLES_FACTOR = 100
#: ``final_evaluate_fraction`` = 0: up to this many nodes the final round evaluates them all
FINAL_EVALUATE_ALL = 100
#: ``max_in_flight`` = 0 on Flower's simulation engine: messages outstanding at once
SIMULATION_WINDOW = 16


class RoundSkipped(Exception):
    """This round's replies cannot be combined (too few for the robust rule's breakdown
    point): the round leaves the shared parameters unchanged."""


class PersonalizedStrategy(NodeSampling, Strategy):
    """Base strategy: sampling, messages, reply checks, per-client evaluation metrics.

    Subclasses implement ``aggregate`` (checked updates -> new shared arrays) and may add
    settings to each round's config with ``train_config``.

    **Pipeline.** With ``pretrain_rounds = P > 0`` the first P rounds are FedAvg on the whole
    model (config ``phase = "pretrain"``, reply key ``arrays``); then the model is split: the
    shared part ``shared_names`` goes on as the algorithm's ``arrays``, and the rest, the
    pre-trained personal slice, is sent as ``personal-init`` with every later message so that
    a client without personal state starts from it (Pillutla et al. 2022, step (a) -> (b)).
    It is the global model's slice, not any client's personal state.

    Parameters
    ----------
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled for training each round (at least one).
    fraction_evaluate : float (default: 1.0)
        Fraction of nodes sampled for evaluation (the final round: ``final_evaluate_fraction``).
    final_evaluate_fraction : float (default: 0.0)
        Fraction of nodes the final round evaluates; 0 (auto): every node when there are at
        most ``FINAL_EVALUATE_ALL`` (100), else a seeded uniform sample of
        ``max(100, 10%)`` of them (the per-client statistics are then over that sample).
    max_in_flight : int (default: 0)
        At most this many messages outstanding at once (``nodes.Window``); 0 (auto): 16 on
        Flower's simulation engine, whose dispatcher costs nodes x outstanding messages per
        tick, no limit elsewhere.
    evaluate_every : int (default: 1)
        Evaluate every this many rounds (and always in the final round).
    reply_key : str (default: "arrays")
        The ArrayRecord key a training reply must carry: ``arrays`` (new weights),
        ``delta`` or ``gradient``; no other is accepted.
    lr : float (default: 0.05)
        Client learning rate, scheduled across the algorithm's rounds by ``lr_schedule``.
    lr_schedule : str (default: "constant")
        ``constant``, ``linear`` (warm-up over ``lr_warmup_fraction`` of the rounds, then
        linear decay to 0) or ``exponential`` (halve every ``lr_halve_every`` rounds).
    lr_warmup_fraction : float (default: 0.1)
        Share of the algorithm's rounds the ``linear`` schedule warms up over.
    lr_halve_every : int (default: 500)
        Rounds between halvings of the ``exponential`` schedule.
    server_optimizer : ServerOptimizer or None (default: None)
        Applied to the pseudo-gradient (or gradient) by subclasses that use one;
        ``None`` means SGD with server lr 1 (FedAvg).
    pretrain_rounds : int (default: 0)
        FedAvg rounds on the whole model before the algorithm starts.
    pretrain_lr : float or None (default: None)
        Client lr of the pre-training rounds (``None``: ``lr``).
    shared_names : sequence of str or None (default: None)
        Names of the shared parameters; required when ``pretrain_rounds > 0``.
    seed : int (default: 0)
        Seed of the client-sampling generator.
    holdout_fraction : float (default: 0.0)
        Share of the clients (the highest partition ids) never sampled for training: they
        are evaluated as new clients (their personal part from the algorithm's new-client
        rule) next to the trained ones.
    robust : Aggregator or None (default: None)
        A robust rule (``pflower.strategies.aggregators``) applied to the clients' *updates*
        (gradients, deltas, or ``current - returned weights``), unweighted, in place of the
        (weighted) mean. ``None``: the algorithm's own mean.
    byzantine : int (default: 0)
        Number f of Byzantine clients per round the robust rule must tolerate; checked
        against the rule's breakdown point at the first round.
    attack_simulation : bool (default: False)
        **Attack simulation, for robustness experiments only**: replies tagged by ALIE / IPM
        nodes (``pflower.experiments.attacks``) are replaced by the omniscient adversary's vector,
        computed from the round's honest replies. Off: tagged replies are dropped.
    max_update_norm : float (default: 1000.0)
        Drop a training reply whose update (gradient, delta, or ``current - returned
        weights``) is longer than this many times the *reference norm*: the largest round
        median of update norms seen so far in the run, this round included (rounds of at
        least 3 replies). A round's median is an honest client's as long as most are honest,
        so a minority can neither raise the reference nor escalate it round by round; taking
        the largest median of the run, not this round's, keeps honest clients whose updates
        are large only next to a converged majority (PFLEGO's gradients: a client sampled
        again after many rounds sends 15 where the round's median is 0.08 and the run's
        largest 1.8; one reached 191 = 103 x the run's largest median). 1000 leaves a margin
        of 10 over the largest honest ratio seen in the benchmarks; a broken client's 1e30 is
        far beyond it. 0 turns the bound off. One finite but huge reply can then neither set
        the mean nor a server Adam's moments. Replies inside the bound but outside the honest
        spread are the robust rules' job (``robust``).
    max_num_examples : int (default: 0)
        Drop a reply claiming more training examples than this; 0: more than 100 times the
        round's median claim (rounds of 3 replies or more). Independently, a node's claim
        must equal what it reported at start-up (when the strategy asked) or in its first
        accepted reply: a node's training set does not change during a run.
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before sampling.

    **Threat model.** Without a robust rule pflower tolerates *broken* clients: errors,
    missing or extra records, wrong names, shapes or dtypes, NaN/Inf, bad or inconsistent
    ``num-examples``, malformed metrics, and single finite outliers (``max_update_norm``).
    Colluding clients whose updates stay within the honest spread (ALIE, IPM, label
    flipping) need a robust rule (``robust``) and enough replies for its breakdown point; a
    round with too few replies for the rule is skipped, counted, never crashes the run.
    """

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        evaluate_every: int = 1,
        final_evaluate_fraction: float = 0.0,
        max_in_flight: int = 0,
        reply_key: str = ARRAYS,
        lr: float = 0.05,
        lr_schedule: str = "constant",
        lr_warmup_fraction: float = 0.1,
        lr_halve_every: int = 500,
        server_optimizer: ServerOptimizer | None = None,
        pretrain_rounds: int = 0,
        pretrain_lr: float | None = None,
        shared_names: Sequence[str] | None = None,
        seed: int = 0,
        holdout_fraction: float = 0.0,
        robust: Aggregator | None = None,
        byzantine: int = 0,
        attack_simulation: bool = False,
        max_update_norm: float = 1000.0,
        max_num_examples: int = 0,
        min_available_nodes: int = 1,
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
        self.reply_key = reply_key
        self.lr = lr
        self.lr_schedule = lr_schedule
        self.lr_warmup_fraction = lr_warmup_fraction
        self.lr_halve_every = lr_halve_every
        self.server_optimizer = server_optimizer or ServerOptimizer("sgd", 1.0)
        self.pretrain_rounds = pretrain_rounds
        self.pretrain_lr = pretrain_lr or lr
        self.shared_names = list(shared_names) if shared_names is not None else None
        if not 0 <= holdout_fraction < 1:
            raise ValueError(f"holdout_fraction = {holdout_fraction}: must be in [0, 1)")
        self.holdout_fraction = holdout_fraction
        if byzantine < 0:
            raise ValueError(f"byzantine = {byzantine}: must be >= 0")
        self.robust, self.byzantine = robust, byzantine
        self.attack_simulation = attack_simulation
        if not (max_update_norm == 0 or max_update_norm >= 1):
            raise ValueError(f"max_update_norm = {max_update_norm}: must be 0 (off) or >= 1")
        if max_num_examples < 0:
            raise ValueError(f"max_num_examples = {max_num_examples}: must be >= 0")
        self.max_update_norm, self.max_num_examples = max_update_norm, max_num_examples
        self.claimed_num_examples: dict[int, float] = {}  # node id -> first accepted claim
        # max_update_norm's reference: the largest round median of update norms so far, per
        # reply kind (returned weights and gradients / deltas have different scales)
        self.update_norm_reference: dict[bool, float] = {}
        self.min_available_nodes = min_available_nodes
        self.rng = random.Random(seed)
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
        self._sent: list[Message] = []  # the round's messages (``sender``)
        #: sent with every message: devices version their state by (run tag, round)
        #: (``context_store.ScopedStore``); a run resumed from a checkpoint keeps its tag
        self.run_tag = ""
        self._round_start = 0.0

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, **kwargs):
        """Flower's round loop; ``num_rounds`` counts pre-training rounds too."""
        if num_rounds <= self.pretrain_rounds:
            raise ValueError(
                f"num_rounds = {num_rounds} leaves no round after {self.pretrain_rounds} "
                "pre-training rounds"
            )
        self.num_rounds = num_rounds
        self.history = []
        self.run_tag = uuid.uuid4().hex[:12]
        resume = kwargs.pop("resume", None)  # a pflower.checkpoint.Checkpoint to continue
        if resume is not None:
            resume.restore(self)  # sampler, server optimizer, history, run tag... of round r
        window = self.max_in_flight or (SIMULATION_WINDOW if in_memory_grid(grid) else 0)
        if window:
            grid = Window(grid, window)
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

    def _messages(self, server_round, node_ids, arrays, config: dict, message_type: str):
        phase = PRETRAIN if self.pretraining(server_round) else TRAIN
        content = RecordDict(
            {
                ARRAYS: arrays,
                CONFIG: ConfigRecord(
                    {**config, SERVER_ROUND: server_round, PHASE: phase, RUN_TAG: self.run_tag}
                ),
            }
        )
        if self.personal_init is not None:
            content[PERSONAL_INIT] = self.personal_init
        if message_type == MessageType.TRAIN and not self.pretraining(server_round):
            for key, record in self.extra_content(server_round).items():
                content[key] = record
        self._sent = [
            Message(content=content, message_type=message_type, dst_node_id=n) for n in node_ids
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
        if server_round == self.pretrain_rounds + 1:
            self.check_robust(len(nodes))
        log.info("round %d: training on %d nodes", server_round, len(nodes))
        self._asked = set(nodes)
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

    # --- reply checks ----------------------------------------------------------------------
    def _count_silent(self, server_round: int, replies: list[Message]) -> None:
        """Count as dropped the nodes asked this round that sent nothing back (Flower's
        grid returns only the replies that arrived within ``timeout``)."""
        answered = {self.sender(msg) for msg in replies}
        for node in sorted(self._asked - answered):
            self._drop(server_round, node, "no reply within the round timeout")

    def sender(self, msg: Message) -> int:
        """The node a reply comes from. For a node that died Flower's SuperLink answers
        itself (an error reply whose source is the SuperLink, node id 1); the reply names the
        message it answers, and that message's destination is the node."""
        node = msg.metadata.src_node_id
        if node in self._asked:
            return node
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent}
        return sent.get(msg.metadata.reply_to_message_id, node)

    def _drop(self, server_round: int, node_id: int, reason: str) -> None:
        dropped = self._log(server_round).dropped
        dropped[reason] = dropped.get(reason, 0) + 1
        log.warning("round %d: dropped the reply of node %d: %s", server_round, node_id, reason)

    def _metrics(self, server_round: int, msg: Message, required: Iterable[str]) -> dict | None:
        """The reply's single MetricRecord as a dict, or None (and a drop) if malformed."""
        node = self.sender(msg)
        if msg.has_error():
            self._drop(server_round, node, f"client error: {msg.error.reason}")
            return None
        records = msg.content.metric_records
        if len(records) != 1:
            self._drop(server_round, node, f"expected one MetricRecord, got {len(records)}")
            return None
        metrics = dict(next(iter(records.values())))
        problem = metrics_problem(metrics, tuple(required))
        if problem:
            self._drop(server_round, node, problem)
            return None
        return metrics

    def check_train_replies(
        self, server_round: int, replies: Iterable[Message]
    ) -> list[ClientUpdate]:
        """Keep well-formed replies; drop and count the others."""
        pretraining = self.pretraining(server_round)
        reply_key = ARRAYS if pretraining else self.reply_key
        keys = {reply_key, *(() if pretraining else self.extra_reply_keys)}
        expected = {k: (tuple(a.shape), a.dtype) for k, a in self._current.items()}
        updates = []
        for msg in replies:
            metrics = self._metrics(server_round, msg, [NUM_EXAMPLES])
            if metrics is None:
                continue
            node = self.sender(msg)
            problem = self._num_examples_problem(node, metrics[NUM_EXAMPLES])
            if problem:
                self._drop(server_round, node, problem)
                continue
            records = msg.content.array_records
            if set(records) != keys:
                self._drop(
                    server_round, node, f"expected records {sorted(keys)}, got {sorted(records)}"
                )
                continue
            checked: dict[str, dict[str, np.ndarray]] = {}
            for key in sorted(keys):  # the first bad record drops the reply, counted once
                tensors = self._check_record(server_round, node, records[key], expected)
                if tensors is None:
                    break
                checked[key] = tensors
            if len(checked) != len(keys):
                continue
            tensors = checked.pop(reply_key)
            self.claimed_num_examples.setdefault(node, metrics[NUM_EXAMPLES])
            updates.append(ClientUpdate(node, tensors, metrics, checked))
        return updates

    def _num_examples_problem(self, node: int, claimed: float) -> str:
        """Why a reply's ``num-examples`` is not believed ('' if it is): above the cap, or
        not what this node reported at start-up / in its first accepted reply."""
        if self.max_num_examples and claimed > self.max_num_examples:
            return f"num-examples {claimed:g} above max-num-examples {self.max_num_examples}"
        known = self.num_train_of.get(node, self.claimed_num_examples.get(node))
        if known is not None and claimed != known:
            return f"num-examples {claimed:g} differs from the {known:g} this node reported"
        return ""

    def bound_updates(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> list[ClientUpdate]:
        """Drop (and count) the replies whose ``num-examples`` (without ``max_num_examples``)
        exceed a multiple of the round's median, or whose update norm exceeds
        ``max_update_norm`` x the largest round median of the run (rounds of 3 replies or
        more)."""
        if len(updates) >= 3 and not self.max_num_examples:  # claims far above the median
            cap = NUM_EXAMPLES_FACTOR * float(np.median([u.num_examples for u in updates]))
            for u in [u for u in updates if u.num_examples > cap]:
                self._drop(
                    server_round,
                    u.node_id,
                    f"num-examples {u.num_examples:g} > {NUM_EXAMPLES_FACTOR} x round median",
                )
            updates = [u for u in updates if u.num_examples <= cap]
        if not self.max_update_norm or len(updates) < 3:
            return updates
        weights = self.pretraining(server_round) or self.reply_key == ARRAYS

        def norm(u: ClientUpdate) -> float:  # in float64: a huge reply must not overflow
            vectors = ((current[k] - t) if weights else t for k, t in u.tensors.items())
            return float(np.sqrt(sum(np.square(v.astype(np.float64)).sum() for v in vectors)))

        norms = np.array([norm(u) for u in updates])
        reference = max(float(np.median(norms)), self.update_norm_reference.get(weights, 0.0))
        self.update_norm_reference[weights] = reference
        bound = self.max_update_norm * reference
        if not bound > 0:
            return updates
        kept = []
        for u, size in zip(updates, norms):
            if size > bound:
                self._drop(
                    server_round,
                    u.node_id,
                    f"update norm {size:.3g} > max-update-norm x largest round median "
                    f"= {bound:.3g}",
                )
            else:
                kept.append(u)
        return kept

    def _check_record(self, server_round, node, record, expected) -> dict | None:
        """The record's tensors, or None (and a drop) if its names, shapes, dtypes or
        values are not those of finite shared parameters."""
        problem = layout_problem(record, expected)
        if problem:
            self._drop(server_round, node, problem)
            return None
        tensors = {k: array_view(a) for k, a in record.items()}  # views: no second copy
        if not all(np.isfinite(t).all() for t in tensors.values()):
            self._drop(server_round, node, "non-finite values")
            return None
        return tensors

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
    ) -> dict[str, np.ndarray]:
        """The clients' update vectors (``vectors``, or ``center - vectors[i]`` for returned
        weights) combined: their weighted mean in float64 or, with ``robust``, the robust
        rule over them (unweighted; f = ``byzantine``, capped at what the rule tolerates for
        this round's number of replies, with a warning). Both read the replies in place and
        never hold all N updates (``combine.weighted_mean_of_updates``, ``robust_combine``)."""
        if self.robust is None:
            if center is not None:
                return weighted_mean_of_updates(center, vectors, weights)
            return weighted_mean(vectors, weights)
        if self.robust.problem(len(vectors), 0):  # too few left after drops: no aggregate
            raise RoundSkipped(self.robust.problem(len(vectors), 0))
        f = min(self.byzantine, max(0, self.robust.max_byzantine(len(vectors))))
        if f < self.byzantine:
            log.warning(
                "%s tolerates %d of %d replies, fewer than byzantine = %d",
                self.robust.name,
                f,
                len(vectors),
                self.byzantine,
            )
        return robust_combine(self.robust, vectors, f, center)

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
        adversary's vector (``pflower.experiments.attacks.simulate_omniscient``)."""
        return attacks.simulate_omniscient(
            server_round,
            current,
            updates,
            enabled=self.attack_simulation,
            weights=self.pretraining(server_round) or self.reply_key == ARRAYS,
            drop=self._drop,
        )

    def round_metrics(self, updates: list[ClientUpdate]) -> dict[str, float]:
        """The round's training metrics: the replies' metrics weighted by num-examples."""
        return weighted_mean_metrics([u.metrics for u in updates])

    def aggregate_train(
        self, server_round, replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # in partition order, not arrival order: float sums then do not depend on timing
        replies = self._in_order(replies)
        self._count_silent(server_round, replies)
        updates = self.check_train_replies(server_round, replies)
        current = {k: a.numpy() for k, a in self._current.items()}
        updates = self.simulate_omniscient(server_round, current, updates)
        updates = self.bound_updates(server_round, current, updates)
        entry = self._log(server_round)
        entry.seconds = time.perf_counter() - self._round_start
        metrics = {
            "replies": len(replies),
            "applied": len(updates),
            "dropped": len(replies) - len(updates),
        }
        if not updates:
            log.warning(
                "round %d: no usable reply; the shared parameters are unchanged", server_round
            )
            entry.train = metrics
            return self._current, MetricRecord(metrics)
        try:
            if self.pretraining(server_round):
                tensors, sizes = [u.tensors for u in updates], [u.num_examples for u in updates]
                new = weighted_mean(tensors, sizes)
            else:
                new = self.aggregate(server_round, current, updates)
        except RoundSkipped as skipped:  # too few replies left for the robust rule
            log.warning(
                "round %d: skipped, the shared parameters are unchanged: %s", server_round, skipped
            )
            metrics["skipped"] = 1
            entry.train = metrics
            return self._current, MetricRecord(metrics)
        metrics.update(self.round_metrics(updates))
        entry.train = metrics
        arrays = ArrayRecord(
            {k: Array(np.ascontiguousarray(v, dtype=current[k].dtype)) for k, v in new.items()}
        )
        return arrays, MetricRecord(metrics)

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        replies = self._in_order(replies)
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
                kept.append(metrics)
        rows = kept
        if not rows:
            return None
        summary = summarize_clients(rows)
        self._log(server_round).evaluate = summary
        if server_round == self.num_rounds:
            self.final_clients = rows
        return MetricRecord(summary)


def strategy_kwargs(cfg: Config, shared_names: Sequence[str] | None = None) -> dict:
    """The base-strategy settings of a run config."""
    return {
        "fraction_train": cfg.fraction_train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "evaluate_every": cfg.evaluate_every,
        "final_evaluate_fraction": cfg.final_evaluate_fraction,
        "max_in_flight": cfg.max_in_flight,
        "lr": cfg.lr,
        "lr_schedule": cfg.lr_schedule,
        "lr_warmup_fraction": cfg.lr_warmup_fraction,
        "lr_halve_every": cfg.lr_halve_every,
        "server_optimizer": ServerOptimizer(
            cfg.effective_server_optimizer,
            cfg.effective_server_lr,
            (cfg.server_beta1, cfg.server_beta2),
            cfg.server_eps,
        ),
        "pretrain_rounds": cfg.pretrain_rounds,
        "pretrain_lr": cfg.effective_pretrain_lr,
        "shared_names": shared_names,
        "seed": cfg.seed,
        "holdout_fraction": cfg.holdout_fraction,
        "robust": robust_aggregator(cfg),
        "byzantine": cfg.robust_byzantine,
        "attack_simulation": cfg.attack_simulation,
        "max_update_norm": cfg.max_update_norm,
        "max_num_examples": cfg.max_num_examples,
    }
