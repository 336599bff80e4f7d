"""pflower's robust aggregators inside a plain Flower project: ``RobustFedAvg``.

A drop-in replacement for ``flwr.serverapp.strategy.FedAvg`` (same constructor, same messages,
so the ClientApp is unchanged) whose ``aggregate_train`` applies a robust rule of
``pflower.strategies.aggregators`` to the clients' *updates* ``current - w_i`` and returns
``current - rule(updates)``::

    from pflower.strategies.aggregators import make_aggregator
    from pflower.strategies.robust_fedavg import RobustFedAvg

    strategy = RobustFedAvg(
        aggregator=make_aggregator("geometric-median", bucket_size=2),  # bucketing + RFA
        byzantine=2,  # tolerate 2 Byzantine replies per round: 9 replies a round or more
        fraction_train=1.0,
    )
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=40)

Unlike Flower's own ``FedMedian``, ``FedTrimmedAvg`` and ``MultiKrum``, which act on the raw
weights and raise on the first inconsistent reply (the whole round is skipped), a reply that is
an error, lacks the ArrayRecord, has other names, shapes or dtypes than the model, or carries a
NaN / Inf is dropped and counted (``dropped``, per reason) and the round goes on with the
others. With ``aggregator = Mean()`` the result equals FedAvg's unweighted mean; the rules are
unweighted (a Byzantine client could claim any ``num-examples``). A node asked that did not
answer within the round's timeout is counted too (``no reply within the round timeout``).

Every reply goes through the admit, bound and combine stages of pflower's own strategies
(``pflower.strategies.pipeline``): the same checks and drop reasons, the update-norm bound
(``bound.UpdateNormBound``: every update at most ``max_update_norm`` x a reference that starts at
the model's norm and grows at most ``update_norm_growth`` per round) at every round size, and the
rule with its f (``combine.RobustRule``), whose preconditions (breakdown point for ``byzantine``,
Multi-Krum's m <= N - f) are checked before the first message against the planned round size
(a rule that cannot take its f there is refused, naming the size that would) and every round
against the replies kept. ``byzantine`` = f
Byzantine replies among those kept, whatever else the round lost (a failed device is not an
attacker); a round the rule cannot take with its f falls back to the default defence's clip
(counted in ``fallbacks``), never to a plain mean, never skipped. A round that aggregates
nothing keeps the model, and ``Result.arrays`` is always the last good model (the initial
one if no round aggregated).

Every array keeps its shape and dtype (a 0-dim scalar parameter comes back 0-dim). Like
Flower's own strategies, ``aggregate_train`` also aggregates replies it did not ask for (no
``configure_train`` before it: weights in, weights out). It then checks the replies against the
layout most of them carry and takes as the centre of the updates the coordinate-wise median of
the well-formed replies (robust to a minority of Byzantine replies, where their mean would
follow one 1e30 reply): the rules are translation-equivariant (mean, median, trimmed mean,
Krum, Multi-Krum, geometric median, bucketing), so the result is the rule applied to the
weights; centered clipping clips around that median instead of around the model sent.

Any strategy of Flower's FedAvg family whose ``aggregate_train`` is FedAvg's gets it by
putting ``RobustFedAvg`` first in its bases (``class RobustFedProx(RobustFedAvg, FedProx)``:
FedProx's messages, this aggregation). Strategies that post-process FedAvg's aggregate
(FedAdam, FedYogi, ...) are not covered.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from pflower.strategies import aggregators
from pflower.strategies.admit import Admit
from pflower.strategies.aggregators import Aggregator
from pflower.strategies.bound import Bound
from pflower.strategies.combine import AdaptiveClipping, RobustRule
from pflower.strategies.pipeline import ReplyPipeline
from pflower.strategies.rounds import Round
from pflower.strategies.settle import Settle
from pflower.wire import array_view

# A child of Flower's logger, so the records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


class RobustFedAvg(FedAvg):
    """Flower's ``FedAvg`` with a robust rule over the updates (the module docstring).

    Parameters
    ----------
    aggregator : Aggregator
        The robust rule (``pflower.strategies.aggregators.make_aggregator``).
    byzantine : int (default: 0)
        f, the Byzantine replies per round the rule must tolerate.
    max_update_norm : float (default: 1000.0)
        ``K`` of the update-norm bound (``bound.UpdateNormBound``); 0: off.
    update_norm_growth : float (default: 2.0)
        ``g`` of the update-norm bound.
    *args, **kwargs
        Flower's ``FedAvg``'s (``fraction_train``, ``arrayrecord_key``,
        ``weighted_by_key``, ``train_metrics_aggr_fn``...).
    """

    def __init__(
        self,
        *args,
        aggregator: Aggregator,
        byzantine: int = 0,
        max_update_norm: float = 1000.0,
        update_norm_growth: float = 2.0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        # refuses a negative f; the rounds the rule cannot take: the default defence's clip
        fallback = AdaptiveClipping(growth=update_norm_growth)
        combine = RobustRule(aggregator, byzantine, fallback=fallback)
        # unweighted rules, and Flower's metrics of the replies as sent: no claim bound
        bound = Bound(max_update_norm, update_norm_growth, weigh=False)
        admit = Admit(by_norm=bool(bound.norm.factor), count_key=self.weighted_by_key)
        self.pipeline = ReplyPipeline(admit, bound, combine, Settle(0))
        self.aggregator, self.byzantine = aggregator, byzantine
        self.dropped: dict[str, int] = {}  # reason -> count, over the run
        self.fallbacks = 0  # rounds the rule could not take with its f: the clip took them
        self._current: ArrayRecord | None = None
        self._out: list[Message] = []
        self._sample_checked = False

    def configure_train(self, server_round, arrays, config, grid):
        self._current = arrays  # the model the clients start from: updates are relative to it
        self._out = list(super().configure_train(server_round, arrays, config, grid))
        if not self._sample_checked:  # before the first message: a rule that cannot take
            self._sample_checked = True  # its f at the planned round size is refused
            problem = self.pipeline.combine.sample_problem(len(self._out))
            if problem:
                raise ValueError(
                    f"RobustFedAvg(byzantine={self.byzantine}): {problem}; sample more nodes "
                    "a round (fraction_train, min_train_nodes) or tolerate fewer (byzantine)"
                )
        return self._out

    def _layout(self, replies: list[Message]) -> dict[str, tuple] | None:
        """Name -> (shape, dtype) every reply must carry: the model ``configure_train`` sent,
        or, for replies aggregated without one, the layout most replies carry (None: no
        reply carries an ArrayRecord)."""
        if self._current is not None:
            return {k: (tuple(a.shape), a.dtype) for k, a in self._current.items()}
        seen: Counter = Counter()
        key = self.arrayrecord_key
        for msg in replies:
            record = None if msg.has_error() else msg.content.array_records.get(key)
            if record is not None:
                seen[tuple((k, tuple(a.shape), a.dtype) for k, a in record.items())] += 1
        if not seen:
            return None
        return {k: (shape, dtype) for k, shape, dtype in seen.most_common(1)[0][0]}

    def _round(self, server_round: int, layout: dict) -> Round:
        configured = self._current is not None
        return Round(
            server_round,
            {m.metadata.dst_node_id for m in self._out} if configured else set(),
            {m.metadata.message_id: m.metadata.dst_node_id for m in self._out}
            if configured
            else None,
            self.dropped,
            reply_key=self.arrayrecord_key,
            layout=layout,
            current={k: array_view(a) for k, a in self._current.items()} if configured else {},
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        layout = self._layout(replies)
        rnd = self._round(server_round, layout or {})
        admit = self.pipeline.admit
        replies = admit.answers(rnd, replies)
        updates = admit.train(rnd, replies)  # with no layout: each reply's reason counted
        if layout is None or (self._current is None and not updates):
            log.warning("round %d: no usable reply", server_round)
            return None, None
        if self._current is None:  # replies alone: their coordinate-wise median is the centre
            X, stacked = aggregators.stack([u.tensors for u in updates])
            rnd.current = aggregators.unstack(X.median(dim=0).values, stacked)
        updates = self.pipeline.bound(rnd, updates)
        if not updates:
            log.warning("round %d: no usable reply; the model is unchanged", server_round)
            return self._current, None
        rnd.nodes = [u.node_id for u in updates]
        # the rule with its f among the kept replies, or the clip (``combine.RobustRule``)
        step = self.pipeline.combine(
            rnd, [u.tensors for u in updates], [1.0] * len(updates), rnd.current
        )
        self.fallbacks += rnd.fell_back
        current = rnd.current
        # np.asarray, not np.ascontiguousarray: that one turns a 0-dim array into shape (1,)
        arrays = ArrayRecord(
            {k: Array(np.asarray(current[k] - step[k], dtype=current[k].dtype)) for k in current}
        )
        kept = {u.node_id for u in updates}
        contents = [m.content for m in replies if rnd.sender(m) in kept]
        return arrays, self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def summary(self) -> None:
        log.info("RobustFedAvg: %s, byzantine = %d", self.aggregator.name, self.byzantine)
        super().summary()
