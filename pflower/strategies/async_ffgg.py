"""Asynchronous FFGG: Mishchenko et al., *Partially Personalized Federated Learning*, Alg. 3.

Alg. 3::

    initially every client in the active set C^0 starts computing at theta^0
    for r = 0, 1, 2, ...:
        receive the update of the first client j_r to finish; it was computed at theta^{r-d}
        theta^{r+1} = theta^r - gamma_theta * Delta_{j_r}      # applied at once, no averaging
        sample a new client m_r, initialise its w randomly, start it on theta^{r+1}

The active set keeps its size C. The clients are FFGG's (fine-tune w from a fresh init, reply
with grad_theta f_m at the fine-tuned w), unchanged: only the server differs. Flower's rounds
are synchronous, so ``AsyncFFGG.start`` replaces the round loop by its own loop over
``grid.push_messages`` / ``grid.pull_messages``: it keeps C training messages in flight,
applies each gradient the moment it is pulled, and sends the new theta to an idle client drawn
uniformly (from the partition-ordered nodes, with the strategy's seeded generator).

Every pulled reply is either applied or dropped with its reason (malformed, client error,
too stale), counted in ``dropped`` and in the history; a message not answered within
``client_timeout`` frees its slot for another client and is counted as ``timed-out`` (its
late reply, if any, is ignored). Options: ``max_staleness`` (drop updates computed on a
theta more than that many versions old; -1: none), ``staleness_power`` a (step
gamma / (1 + s)^a, a = 0 is the paper's constant step), the number of server updates and a
time budget, and evaluation (client-side, the usual protocol) every ``evaluate_every``
updates; the server-side ``evaluate_fn`` (synthetic-linear's closed form) runs there too.

The history has one entry per applied update (``round`` = the update's index r + 1, i.e.
theta's new version) with ``staleness``, ``seconds`` (training wall clock since the start,
evaluation pauses excluded) and the client's metrics.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from flwr.app import Array, ArrayRecord, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from pydantic import Field

from pflower.settings import ConfigError, Settings
from pflower.strategies.ffgg import FFGG, FFGGClient, FFGGSettings
from pflower.strategies.nodes import in_memory_grid, index_dispatch
from pflower.strategies.registry import Algorithm

if TYPE_CHECKING:
    from pflower.config import Config

# A child of Flower's logger, so the records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


#: Asynchronous FFGG's values for run-config keys left at ``auto`` (``config.AUTO``): each
#: arriving gradient is applied alone, so the step is the synchronous one (1.0 on a mean of
#: C gradients) divided by C = 5, the default concurrency of the default run (10 nodes x
#: fraction-train 0.5); at 1.0 single clients' gradients overshoot (64% vs 89% measured,
#: benchmarks/default_runs.py)
ASYNC_FFGG_DEFAULTS = {"server_lr": 0.2, "robust_aggregator": "none"}


class AsyncFFGGSettings(Settings):
    """Asynchronous FFGG's own keys (FFGG's keys apply too: ``FFGGSettings``)."""

    async_concurrency: int = Field(
        0,
        alias="async-concurrency",
        ge=0,
        description="AsyncFFGG's C, clients computing at once (0: `fraction-train` × N)",
    )
    async_updates: int = Field(
        0,
        alias="async-updates",
        ge=0,
        description="server updates to apply (0: `num-server-rounds` × C)",
    )
    async_max_staleness: int = Field(
        -1,
        alias="async-max-staleness",
        ge=-1,
        description="drop updates computed on a θ more than this many versions old (-1: keep all)",
    )
    async_staleness_power: float = Field(
        0.0,
        alias="async-staleness-power",
        ge=0,
        description=(
            "a in the step γθ/(1+s)^a of an update of staleness s; 0: the paper's constant step"
        ),
    )
    async_time_budget_s: float = Field(
        0.0,
        alias="async-time-budget-s",
        ge=0,
        description="stop after this many seconds of training (0: no limit)",
    )
    async_evaluate_every: int = Field(
        0,
        alias="async-evaluate-every",
        ge=0,
        description="evaluate every that many updates (0: `evaluate-every` × C)",
    )
    async_client_timeout_s: float = Field(
        600.0,
        alias="async-client-timeout-s",
        gt=0,
        description="a message unanswered this many seconds frees its slot for another client",
    )

    @classmethod
    def check(cls, cfg: Config) -> None:
        if cfg.pretrain_rounds:
            raise ConfigError(
                f"key 'pretrain-rounds' = {cfg.pretrain_rounds}: async-ffgg applies single "
                "client updates as they arrive and has no FedAvg pre-training rounds; set 0"
            )
        if cfg.robust_aggregator not in ("auto", "none"):
            raise ConfigError(
                f"key 'robust-aggregator' = {cfg.robust_aggregator!r}: async-ffgg applies "
                "single client updates, there is nothing to combine robustly; set 'none'"
            )
        if cfg.dp != "none":
            raise ConfigError(
                f"key 'dp' = {cfg.dp!r} with algorithm 'async-ffgg': its updates are applied one "
                "at a time as they arrive, not as a sampled round's mean, which the accountant's "
                "sampling without replacement describes; use 'ffgg' or 'local-ffgg' with dp"
            )


#: asynchronous FFGG's keys at their defaults: ``AsyncFFGG``'s constructor defaults
SETTINGS = AsyncFFGGSettings()


class AsyncFFGG(FFGG):
    """Asynchronous FFGG's server (Alg. 3); the parameters of ``FFGG`` (their defaults: the
    app's for ``async-ffgg``, ``ASYNC_FFGG_DEFAULTS``'s server lr) plus:

    concurrency : int (default: ``async-concurrency``)
        C, the number of clients computing at any time; 0: ``round(fraction_train * N)``.
    max_updates : int (default: ``async-updates``)
        Server updates to apply; 0: ``num_rounds * C`` (as many gradients as synchronous
        FFGG with C clients per round uses).
    max_staleness : int (default: ``async-max-staleness``)
        Drop (and count) updates older than this many versions; -1: keep all.
    staleness_power : float (default: ``async-staleness-power``)
        a in gamma / (1 + s)^a; 0 is Alg. 3's constant step.
    time_budget : float (default: ``async-time-budget-s``)
        Stop after this many seconds of training; 0: no limit.
    evaluate_every_updates : int (default: ``async-evaluate-every``)
        Evaluate every that many updates; 0: ``evaluate_every * C``.
    client_timeout : float (default: ``async-client-timeout-s``)
        Seconds after which an unanswered message frees its slot.
    poll_interval : float (default: 0.01)
        Pause between pulls when nothing has arrived.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    algorithm = "async-ffgg|ffgg|br-ffgg"
    defaults = ASYNC_FFGG_DEFAULTS

    def __init__(
        self,
        *,
        concurrency: int = SETTINGS.async_concurrency,
        max_updates: int = SETTINGS.async_updates,
        max_staleness: int = SETTINGS.async_max_staleness,
        staleness_power: float = SETTINGS.async_staleness_power,
        time_budget: float = SETTINGS.async_time_budget_s,
        evaluate_every_updates: int = SETTINGS.async_evaluate_every,
        client_timeout: float = SETTINGS.async_client_timeout_s,
        poll_interval: float = 0.01,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        checks = {
            "concurrency": concurrency >= 0,
            "max_updates": max_updates >= 0,
            "max_staleness": max_staleness >= -1,
            "staleness_power": staleness_power >= 0,
            "time_budget": time_budget >= 0,
            "evaluate_every_updates": evaluate_every_updates >= 0,
            "client_timeout": client_timeout > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} = {locals()[name]}: out of range")
        if self.pretrain_rounds:
            raise ValueError("AsyncFFGG has no pre-training phase: set pretrain_rounds = 0")
        if self.robust is not None:
            raise ValueError("AsyncFFGG applies single updates: a robust rule needs a round")
        self.concurrency = concurrency
        self.max_updates = max_updates
        self.max_staleness = max_staleness
        self.staleness_power = staleness_power
        self.time_budget = time_budget
        self.evaluate_every_updates = evaluate_every_updates
        self.client_timeout = client_timeout
        self.poll_interval = poll_interval
        self.counts: dict[str, int] = {}

    def summary(self) -> None:
        super().summary()
        log.info(
            "\t└── async: C = %s, max staleness %d, step / (1 + s)^%g",
            self.concurrency or "fraction-train x N",
            self.max_staleness,
            self.staleness_power,
        )

    # --- the asynchronous loop -----------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float | None = 3600,
        train_config=None,
        evaluate_config=None,
        evaluate_fn=None,
    ) -> Result:
        self.refuse_other_lr(train_config)
        self.history = []
        self.counts = {"replies": 0, "applied": 0, "dropped": 0, "timed-out": 0}
        if in_memory_grid(grid):
            index_dispatch()
        self.learn_partitions(grid, timeout=timeout or 3600.0)
        nodes = self._ordered(grid.get_node_ids())
        held = self.held_out(nodes)
        nodes = [n for n in nodes if n not in held]
        slots = self.concurrency or max(1, round(self.fraction_train * len(nodes)))
        if slots > len(nodes):
            raise ValueError(f"concurrency = {slots}: more than the {len(nodes)} trainable nodes")
        total = self.max_updates or num_rounds * slots
        every = self.evaluate_every_updates or self.evaluate_every * slots
        self.num_rounds = total  # the "round" of messages, logs and evaluation = theta's version
        self.check_robust(slots)
        self._slots = slots
        self.failed_rounds, self.failed_replies, self.value_drops = 0, 0, {}
        self._current = initial_arrays
        base_config = dict(train_config or {})
        log.info("async FFGG: %d updates, %d clients in flight, %d nodes", total, slots, len(nodes))

        version = 0
        idle = list(nodes)
        in_flight: dict[str, tuple[int, int, float]] = {}  # message id -> node, version, sent
        paused = 0.0  # seconds spent evaluating: not training time
        started = time.perf_counter()
        if evaluate_fn is not None:
            self._server_evaluate(evaluate_fn, 0)

        def launch() -> None:
            while len(in_flight) < slots and idle:
                node = self.rng.sample(self._ordered(idle), 1)[0]
                idle.remove(node)
                settings = {**base_config, **self.train_config(version + 1)}
                messages = self._messages(
                    version + 1, [node], self._current, settings, MessageType.TRAIN
                )
                for msg_id in grid.push_messages(messages):
                    in_flight[msg_id] = (node, version, time.perf_counter())

        launch()
        while version < total:
            elapsed = time.perf_counter() - started - paused
            if self.time_budget and elapsed >= self.time_budget:
                log.info("async FFGG: time budget reached after %d updates", version)
                break
            replies = list(grid.pull_messages(list(in_flight)))
            now = time.perf_counter()
            for msg_id, (node, _, sent) in list(in_flight.items()):
                if now - sent > self.client_timeout and all(
                    r.metadata.reply_to_message_id != msg_id for r in replies
                ):
                    del in_flight[msg_id]
                    idle.append(node)
                    self.counts["timed-out"] += 1
                    log.warning("async FFGG: node %d timed out; its slot goes to another", node)
            if not replies:
                launch()
                time.sleep(self.poll_interval)
                continue
            for reply in replies:
                entry = in_flight.pop(reply.metadata.reply_to_message_id, None)
                if entry is None:  # a late reply to a timed-out message: already counted
                    continue
                node, sent_version, _ = entry
                idle.append(node)
                self.counts["replies"] += 1
                if version >= total:  # the budget was spent by an earlier reply of this pull
                    self.counts["dropped"] += 1
                    self._drop(version, node, "arrived after the last update")
                    continue
                if self._apply(version + 1, reply, version - sent_version):
                    version += 1
                    self._log(version).seconds = time.perf_counter() - started - paused
                    if version % every == 0 and version < total:  # the last: below
                        pause = time.perf_counter()
                        self._evaluate(grid, version, evaluate_config, evaluate_fn)
                        paused += time.perf_counter() - pause
            launch()
        self.counts["abandoned-in-flight"] = len(in_flight)
        self.num_rounds = version  # the final evaluation: every client
        self._log(version).server.update({f"async-{k}": float(v) for k, v in self.counts.items()})
        self._evaluate(grid, version, evaluate_config, evaluate_fn)
        log.info("async FFGG: %s", self.counts)
        return Result(arrays=self._current)

    def should_evaluate(self, server_round: int) -> bool:
        return True  # the loop decides when (every ``evaluate_every_updates`` updates)

    def _apply(self, new_version: int, reply, staleness: int) -> bool:
        """Check the reply and apply it: theta <- theta - gamma / (1 + s)^a * Delta. The
        update-norm and claim bounds hold for each reply (a 1-reply round: checked against
        the reference, which it does not move); ``max_failed_rounds`` x C replies in a row
        dropped stop the run (``RunFailed``)."""
        current = {k: a.numpy() for k, a in self._current.items()}
        self._asked = {self.sender(reply)}
        updates = self.check_train_replies(new_version, [reply])
        updates = self.bound_updates(new_version, current, updates) if updates else updates
        if not updates:
            self.counts["dropped"] += 1
            self.settle_reply(new_version, applied=False)
            return False
        if 0 <= self.max_staleness < staleness:
            self.counts["dropped"] += 1
            self._drop(new_version, updates[0].node_id, f"stale: s = {staleness}")
            self.settle_reply(new_version, applied=False)
            return False
        self.settle_reply(new_version, applied=True)
        scale = (1.0 + staleness) ** -self.staleness_power
        gradient = {k: scale * v for k, v in updates[0].tensors.items()}
        new = self.server_optimizer.step(current, gradient)
        self._current = ArrayRecord({k: Array(new[k].astype(current[k].dtype)) for k in current})
        self.counts["applied"] += 1
        metrics = self.round_metrics(updates)
        self._log(new_version).train = {**metrics, "staleness": float(staleness)}
        return True

    def settle_reply(self, version: int, applied: bool) -> None:
        """``settle_round`` for one reply: the node's value drops are tracked per reply, and
        C (``concurrency``) replies dropped in a row count as one round that applied nothing."""
        self.track_value_drops()
        self.failed_replies = 0 if applied else self.failed_replies + 1
        if applied or self.failed_replies % self._slots == 0:
            self.count_round(version, applied=int(applied))

    def _evaluate(self, grid, version, evaluate_config, evaluate_fn) -> None:
        """The usual protocol on the current theta; every client when ``version`` is
        ``num_rounds`` (the base strategy's final evaluation)."""
        if evaluate_fn is not None:
            self._server_evaluate(evaluate_fn, version)
        config = dict(evaluate_config or {})
        messages = list(self.configure_evaluate(version, self._current, config, grid))
        if messages:
            replies = grid.send_and_receive(messages, timeout=self.client_timeout)
            self.aggregate_evaluate(version, replies)

    def _server_evaluate(self, evaluate_fn, version: int) -> None:
        metrics = evaluate_fn(version, self._current)
        if isinstance(metrics, MetricRecord):
            self.record_server_metrics(version, dict(metrics))


def async_ffgg_strategy(cfg: Config, **kwargs) -> AsyncFFGG:
    return AsyncFFGG(
        weighted=cfg.ffgg_weighting == "num-examples",
        concurrency=cfg.async_concurrency,
        max_updates=cfg.async_updates,
        max_staleness=cfg.async_max_staleness,
        staleness_power=cfg.async_staleness_power,
        time_budget=cfg.async_time_budget_s,
        evaluate_every_updates=cfg.async_evaluate_every,
        client_timeout=cfg.async_client_timeout_s,
        **kwargs,
    )


#: this file's algorithm (Alg. 3): FFGG's clients, a server loop applying each gradient
ALGORITHMS = {
    "async-ffgg": Algorithm(
        async_ffgg_strategy,
        FFGGClient(),
        defaults=ASYNC_FFGG_DEFAULTS,
        settings=(FFGGSettings, AsyncFFGGSettings),
    )
}
