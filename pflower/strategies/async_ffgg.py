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
theta's new version) with ``staleness``, ``clipped`` (1 if the clip below shortened it),
``seconds`` (training wall clock since the start, evaluation pauses excluded) and the
client's metrics.

**Where pflower departs from Alg. 3, and why.** Alg. 3 applies whatever arrives first, so
the fastest client writes theta: one that answers at once while the others take time made
72% of the applied updates of a 10-node run (fair share 10%), and with its gradients turned
around at the largest norm the update-norm bound accepts it decided the model.
Three rules, each off with its key at 0, stand between a fast client and the model; none
binds while the clients are honest and equally fast (the same theta, bit for bit:
``tests/test_async_ffgg.py``):

- *Fair share* (``async-max-share`` k = 2, ``FairShare``). A node has at most one message in
  flight (an idle node is drawn, never a busy one). Each node holds credits, at most
  B = ``FAIR_BURST`` = 3 (and as many at the start); every message of a node that is
  answered, dropped or times out costs it one, every applied update earns every node k / N,
  N the live nodes (those whose latest message did not time out and was not dropped; at
  least 1), and a node is drawn only among the idle nodes with a whole credit left.
  **Bound**: in any L consecutive applied updates a node makes at most B + k L / N of them
  (N the fewest live nodes in that stretch): its long-run share is at most k / N, twice the
  fair share, and it makes at most B / (1 - k / N) updates in a row (3 of 10 nodes). The
  one exception is a
  dispatch with no credit when no message is in flight and no idle node has credit (the run
  must go on): counted as ``fair-share-waived``, never seen in a measured run. Honest
  stragglers keep their place: the slots go to other idle nodes while they compute, and a
  node faster than its share waits only while it is out of credit.
- *Clip* (``async-clip-factor`` m = 2, ``RecentNormClip``). Each applied gradient is scaled
  down (never dropped) to at most m x the lower median of the last applied norm of each of
  the last ``CLIP_POOL`` = 10 distinct nodes (the reply's own norm as its node's entry);
  while no other node's norm is known, to ``PROVISIONAL_CLIP`` = 0.05 x min(S_t, S_1), the
  update-norm bound's scale (honest gradients measured below 0.01 S). A node has one entry
  however often it replies, so while at most half of the pool is Byzantine the clip is at
  most m x an honest node's last norm: one client cannot walk it up, and a low liar moves
  it down by one rank. The update-norm bound (``checks.UpdateNormBound``: min(S_t, S_1) for
  these 1-reply rounds) still drops what is beyond the model's scale.
- *Rounds that apply nothing* (``max-failed-rounds``). A failed "round" is C distinct nodes
  whose messages were dropped or timed out with no update applied in between, so fewer than
  C Byzantine clients, however fast, cannot end the run: it stops only after
  ``max-failed-rounds`` such rounds in a row, each with at least C - f honest nodes failing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from flwr.app import Array, ArrayRecord, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from pydantic import Field

from pflower.flower import grids
from pflower.settings import ConfigError, Settings
from pflower.strategies.bound import (
    PROVISIONAL_CLIP,
    RecentNormClip,
    provisional_scale,
    update_norm,
)
from pflower.strategies.exchange import index_dispatch
from pflower.strategies.ffgg import FFGG, FFGGClient, FFGGSettings
from pflower.strategies.registry import Algorithm
from pflower.strategies.rounds import Round

if TYPE_CHECKING:
    from pflower.settings import RunSettings

# A child of Flower's logger, so the records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


#: Asynchronous FFGG's values for run-config keys left at ``auto`` (``config.AUTO``): each
#: arriving gradient is applied alone, so the step is the synchronous one (1.0 on a mean of
#: C gradients) divided by C = 5, the default concurrency of the default run (10 nodes x
#: fraction-train 0.5); at 1.0 single clients' gradients overshoot (64% vs 89% measured,
#: benchmarks/default_runs.py)
ASYNC_FFGG_DEFAULTS = {"server_lr": 0.2, "robust_aggregator": "none"}

#: B: the most credits a node holds (``FairShare``), the updates it may make back to back
FAIR_BURST = 3.0
#: credits are compared with this slack (k / N summed N times is not always exactly k)
_EPS = 1e-9


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
    async_max_share: float = Field(
        2.0,
        alias="async-max-share",
        ge=0,
        description=(
            "k: a node makes at most 3 + k L / N of any L consecutive applied updates "
            "(N live nodes; long-run share k / N); 0: off, the fastest client writes θ"
        ),
    )
    async_clip_factor: float = Field(
        2.0,
        alias="async-clip-factor",
        ge=0,
        description=(
            "m: each applied gradient is clipped to m × the lower median of the last norms "
            "of the last 10 distinct nodes; 0: off (only the update-norm bound)"
        ),
    )

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        for key, value in (
            ("async-max-share", cfg.async_max_share),
            ("async-clip-factor", cfg.async_clip_factor),
        ):
            if 0 < value < 1:
                raise ConfigError(f"key '{key}' = {value}: must be 0 (off) or at least 1")
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


if TYPE_CHECKING:

    class RunConfig(RunSettings, FFGGSettings, AsyncFFGGSettings):
        """What this file reads of a run config: the run-level keys, FFGG's and asynchronous
        FFGG's own (the composed ``pflower.config.Config``, defined above this file, is one)."""


#: asynchronous FFGG's keys at their defaults: ``AsyncFFGG``'s constructor defaults
SETTINGS = AsyncFFGGSettings()


class FairShare:
    """Credits that bound a node's share of the applied updates (module docstring: in any L
    consecutive applied updates a node makes at most ``burst + factor * L / N``).

    Parameters
    ----------
    factor : float
        k: every applied update earns every node k / N credits, N the live nodes; 0: off.
    burst : float (default: ``FAIR_BURST``)
        B: the most credits a node holds, and what it starts with.
    """

    def __init__(self, factor: float, burst: float = FAIR_BURST) -> None:
        self.factor, self.burst = factor, burst
        self.credit: dict[int, float] = {}

    def credit_of(self, node: int) -> float:
        return self.credit.get(node, self.burst)

    def eligible(self, node: int) -> bool:
        return not self.factor or self.credit_of(node) >= 1.0 - _EPS

    def charge(self, node: int) -> None:
        """A message of ``node`` was answered, dropped or timed out: one credit."""
        if self.factor:
            self.credit[node] = self.credit_of(node) - 1.0

    def earn(self, nodes: Iterable[int], live: int) -> None:
        """An update was applied: every node earns k / ``live``, up to ``burst``."""
        if self.factor:
            gain = self.factor / max(1, live)
            for node in nodes:
                self.credit[node] = min(self.burst, self.credit_of(node) + gain)


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
    max_share : float (default: ``async-max-share``)
        k of the fair share (``FairShare``): a node's long-run share of the applied updates
        is at most k / N; 0: off (Alg. 3's draw among all idle nodes).
    clip_factor : float (default: ``async-clip-factor``)
        m of the clip (``RecentNormClip``); 0: off.
    poll_interval : float (default: 0.01)
        Pause between pulls when nothing has arrived.
    """

    #: the handshake's algorithm names of a strategy built by hand (the clients it serves)
    serves = ("async-ffgg", "ffgg", "br-ffgg")
    defaults = ASYNC_FFGG_DEFAULTS
    defence = {}  # its own: the fair share and the recent-norm clip, not FFGG's rule

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
        max_share: float = SETTINGS.async_max_share,
        clip_factor: float = SETTINGS.async_clip_factor,
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
            "max_share": max_share == 0 or max_share >= 1,
            "clip_factor": clip_factor == 0 or clip_factor >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} = {locals()[name]}: out of range")
        if self.pretrain_rounds:
            raise ValueError("AsyncFFGG has no pre-training phase: set pretrain_rounds = 0")
        if self.robust is not None:
            raise ValueError("AsyncFFGG applies single updates: a robust rule needs a round")
        if self.privacy is not None:
            raise ValueError(
                "AsyncFFGG applies single updates as they arrive, which the DP accountant's "
                "sampled rounds do not describe: privacy must be None"
            )
        self.concurrency = concurrency
        self.max_updates = max_updates
        self.max_staleness = max_staleness
        self.staleness_power = staleness_power
        self.time_budget = time_budget
        self.evaluate_every_updates = evaluate_every_updates
        self.client_timeout = client_timeout
        self.max_share = max_share
        self.clip_factor = clip_factor
        self.poll_interval = poll_interval
        self.counts: dict[str, int] = {}
        self.fair = FairShare(max_share)
        self.clip = RecentNormClip(clip_factor)
        self._failing: set[int] = set()  # nodes failed since the last update or failed round
        self._first_scale: float | None = None  # S_1 of the provisional clip

    @classmethod
    def from_config(cls, cfg: RunConfig, **settings) -> AsyncFFGG:
        return cls(
            weighted=cfg.ffgg_weighting == "num-examples",
            concurrency=cfg.async_concurrency,
            max_updates=cfg.async_updates,
            max_staleness=cfg.async_max_staleness,
            staleness_power=cfg.async_staleness_power,
            time_budget=cfg.async_time_budget_s,
            evaluate_every_updates=cfg.async_evaluate_every,
            client_timeout=cfg.async_client_timeout_s,
            max_share=cfg.async_max_share,
            clip_factor=cfg.async_clip_factor,
            **settings,
        )

    def summary(self) -> None:
        super().summary()
        log.info(
            "\t└── async: C = %s, max staleness %d, step / (1 + s)^%g, share <= %g / N, "
            "clip %g x median",
            self.concurrency or "fraction-train x N",
            self.max_staleness,
            self.staleness_power,
            self.max_share,
            self.clip_factor,
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
        self.steps.refuse_other(train_config, type(self).__name__)
        self.history = []
        self.counts = {"replies": 0, "applied": 0, "dropped": 0, "timed-out": 0}
        self.counts.update({"clipped": 0, "fair-share-held": 0, "fair-share-waived": 0})
        if grids.engine_of(grid) == grids.SIMULATION:
            index_dispatch()
        self.nodes.learn_partitions(grid, timeout=timeout or 3600.0)
        nodes = self.nodes.ordered(grid.get_node_ids())
        held = self.nodes.held_out(nodes)
        nodes = [n for n in nodes if n not in held]
        slots = self.concurrency or max(1, round(self.fraction_train * len(nodes)))
        if slots > len(nodes):
            raise ValueError(f"concurrency = {slots}: more than the {len(nodes)} trainable nodes")
        total = self.max_updates or num_rounds * slots
        every = self.evaluate_every_updates or self.evaluation.every * slots
        self.num_rounds = total  # the "round" of messages, logs and evaluation = theta's version
        self.pipeline.combine.check_sample(slots)
        self._slots = slots
        self.pipeline.settle.restart()
        self._failing = set()
        self.fair = FairShare(self.max_share)
        self.clip = RecentNormClip(self.clip_factor)
        self._first_scale = None
        self._current = initial_arrays
        base_config = dict(train_config or {})
        log.info("async FFGG: %d updates, %d clients in flight, %d nodes", total, slots, len(nodes))

        version = 0
        idle = list(nodes)
        down: set[int] = set()  # nodes whose latest message timed out or was dropped
        in_flight: dict[str, tuple[int, int, float]] = {}  # message id -> node, version, sent
        paused = 0.0  # seconds spent evaluating: not training time
        started = time.perf_counter()
        if evaluate_fn is not None:
            self._server_evaluate(evaluate_fn, 0)

        def launch() -> None:
            while len(in_flight) < slots and idle:
                node = self._draw(idle, busy=bool(in_flight))
                if node is None:  # the idle nodes are out of credit: wait for an update
                    return
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
                    down.add(node)
                    self.fair.charge(node)
                    self.counts["timed-out"] += 1
                    log.warning("async FFGG: node %d timed out; its slot goes to another", node)
                    self.count_failure(version + 1, node)
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
                self.fair.charge(node)
                self.counts["replies"] += 1
                if version >= total:  # the budget was spent by an earlier reply of this pull
                    self.counts["dropped"] += 1
                    Round(version, dropped=self._log(version).dropped).drop(
                        node, "arrived after the last update"
                    )
                    continue
                sent = {reply.metadata.reply_to_message_id: node}
                if not self._apply(version + 1, reply, sent, version - sent_version):
                    down.add(node)
                    continue
                down.discard(node)
                self.fair.earn(nodes, len(nodes) - len(down))
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

    def _draw(self, idle: list[int], busy: bool) -> int | None:
        """Alg. 3's "sample a new client", among the idle nodes with credit left
        (``FairShare``; with all of them eligible, the very draw of Alg. 3). None if none
        has credit while a message is in flight (``busy``): its update will earn some;
        with nothing in flight, the idle node with the most credit (``fair-share-waived``)."""
        eligible = [n for n in idle if self.fair.eligible(n)]
        if not eligible:
            if busy:
                return None
            self.counts["fair-share-waived"] += 1
            eligible = [max(self.nodes.ordered(idle), key=self.fair.credit_of)]
        elif len(eligible) < len(idle):  # a draw that passed over a node out of credit
            self.counts["fair-share-held"] += 1
        return self.nodes.rng.sample(self.nodes.ordered(eligible), 1)[0]

    def should_evaluate(self, server_round: int) -> bool:
        return True  # the loop decides when (every ``evaluate_every_updates`` updates)

    def _apply(self, new_version: int, reply, sent: dict[str, int], staleness: int) -> bool:
        """Run the reply (to the message ``sent``) through the reply pipeline's admit and
        bound stages and apply it: theta <- theta - gamma / (1 + s)^a * c * Delta, c the
        clip's factor (``RecentNormClip``: 1 when the norm is within it). The update-norm
        and claim bounds hold for each reply (a 1-reply round: checked against the
        reference, which it does not move); ``max_failed_rounds`` rounds of C distinct nodes
        failing in a row stop the run (``count_failure``)."""
        rnd = self.open_round(new_version, sent)
        (node,) = sent.values()
        updates = self.pipeline.updates(rnd, [reply])
        if updates and 0 <= self.max_staleness < staleness:
            rnd.drop(node, f"stale: s = {staleness}")
            updates = []
        self.pipeline.settle.track(rnd.asked, rnd.value_drops)
        if not updates:
            self.counts["dropped"] += 1
            self.count_failure(new_version, node)
            return False
        self._failing.clear()
        self.pipeline.settle.count(new_version, 1, rnd.dropped)
        update = updates[0]
        norm = update.norm
        if norm is None:  # the update-norm bound is off: the value check computed none
            norm = update_norm({}, update.tensors, False)
        limit = self.clip.threshold(node, norm, self._provisional_clip(rnd))
        clip = min(1.0, limit / norm) if norm > 0 else 1.0
        self.clip.record(node, norm)
        scale = (1.0 + staleness) ** -self.staleness_power * clip
        gradient = {k: scale * v for k, v in update.tensors.items()}
        current = dict(rnd.current)
        new = self.server_optimizer.step(current, gradient)
        self._current = ArrayRecord({k: Array(new[k].astype(current[k].dtype)) for k in current})
        self.counts["applied"] += 1
        self.counts["clipped"] += clip < 1.0
        metrics = self.round_metrics(updates)
        self._log(new_version).train = {
            **metrics,
            "staleness": float(staleness),
            "clipped": float(clip < 1.0),
        }
        return True

    def _provisional_clip(self, rnd: Round) -> float:
        """``PROVISIONAL_CLIP`` x min(S_t, S_1), S the update-norm bound's scale: what the
        clip is while no other node's norm is known."""
        scale = provisional_scale(rnd.current, rnd.step_factor)
        if self._first_scale is None:
            self._first_scale = scale
        return PROVISIONAL_CLIP * min(scale, self._first_scale)

    def count_failure(self, version: int, node: int) -> None:
        """A message of ``node`` was dropped or timed out. C (``concurrency``) *distinct*
        nodes failing with no update applied in between count as one round that applied
        nothing (``settle.Settle.count``): a fast client whose every reply is dropped fails alone,
        and cannot end the run while others' updates are applied."""
        self._failing.add(node)
        if len(self._failing) >= self._slots:
            self._failing.clear()
            self.pipeline.settle.count(version, 0, self._log(version).dropped)

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


#: this file's algorithm (Alg. 3): FFGG's clients, a server loop applying each gradient
ALGORITHMS = {
    "async-ffgg": Algorithm(AsyncFFGG, FFGGClient(), settings=(FFGGSettings, AsyncFFGGSettings))
}
