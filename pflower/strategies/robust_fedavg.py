"""pflower's robust aggregators inside a plain Flower project: ``RobustFedAvg``.

A drop-in replacement for ``flwr.serverapp.strategy.FedAvg`` (same constructor, same messages,
so the ClientApp is unchanged) whose ``aggregate_train`` applies a robust rule of
``pflower.strategies.aggregators`` to the clients' *updates* ``current - w_i`` and returns
``current - rule(updates)``::

    from pflower.strategies.aggregators import make_aggregator
    from pflower.strategies.robust_fedavg import RobustFedAvg

    strategy = RobustFedAvg(
        aggregator=make_aggregator("median", bucket_size=2),  # bucketing + coordinate median
        byzantine=2,  # tolerate 2 Byzantine replies per round (checked against the rule)
        fraction_train=1.0,
    )
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)

Unlike Flower's own ``FedMedian``, ``FedTrimmedAvg`` and ``MultiKrum``, which act on the raw
weights and raise on the first inconsistent reply (the whole round is skipped), a reply that is
an error, lacks the ArrayRecord, has other names, shapes or dtypes than the model, or carries a
NaN / Inf is dropped and counted (``dropped``, per reason) and the round goes on with the
others. With ``aggregator = Mean()`` the result equals FedAvg's unweighted mean; the rules are
unweighted (a Byzantine client could claim any ``num-examples``). A node asked that did not
answer within the round's timeout is counted too (``no reply within the round timeout``).

The update-norm bound of pflower's own strategies (``checks.UpdateNormBound``: every update at
most ``max_update_norm`` x a reference that starts at the model's norm and grows at most
``update_norm_growth`` per round) holds at every round size, and the rule's preconditions
(breakdown point for ``byzantine``, Multi-Krum's m <= N - f) are checked every round against
the replies kept. ``byzantine`` = f bounds the faulty nodes of a round, so each node asked
that left no kept reply (dropped, an error, silent) is one of them and the kept replies hold
at most ``f_kept = f - (asked - kept)``: the rule runs with ``f_kept``; where it cannot and
``f_kept`` = 0 the kept replies are all honest and their mean is taken; otherwise the round
is skipped and counted (``skipped``), never combined with an f below ``f_kept``. A round
that aggregates nothing keeps the model, and ``Result.arrays`` is always the last good
model (the initial one if no round aggregated).

Every array keeps its shape and dtype (a 0-dim scalar parameter comes back 0-dim). Like
Flower's own strategies, ``aggregate_train`` also aggregates replies it did not ask for (no
``configure_train`` before it: weights in, weights out). It then checks the replies against the
layout most of them carry and takes as the centre of the updates the coordinate-wise median of
the well-formed replies (robust to a minority of Byzantine replies, where their mean would
follow one 1e30 reply): the rules are translation-equivariant (mean, median, trimmed mean,
Krum, Multi-Krum, geometric median, bucketing), so the result is the rule applied to the
weights; centered clipping clips around that median instead of around the model sent.

``RobustAggregation`` is the mixin behind it: put it first in the bases of any strategy whose
``aggregate_train`` is FedAvg's (e.g. ``class RobustFedProx(RobustAggregation, FedProx)``).
Strategies that post-process FedAvg's aggregate (FedAdam, FedYogi, ...) are not covered.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from pflower.strategies import aggregators
from pflower.strategies.aggregators import Aggregator
from pflower.strategies.checks import UpdateNormBound, provisional_scale
from pflower.wire import (
    REASON_CHARS,
    UNDECODABLE,
    array_view,
    layout_problem,
    metrics_problem,
)

# A child of Flower's logger, so the records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


class RobustAggregation:
    """Mixin: robust aggregation of updates for FedAvg-like Flower strategies."""

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
        if byzantine < 0:
            raise ValueError(f"byzantine = {byzantine}: must be >= 0")
        self.aggregator, self.byzantine = aggregator, byzantine
        self.norm_bound = UpdateNormBound(max_update_norm, update_norm_growth)
        self.dropped: dict[str, int] = {}  # reason -> count, over the run
        self.skipped = 0  # rounds that could not meet the rule's preconditions
        self._current: ArrayRecord | None = None
        self._asked: set[int] = set()

    def configure_train(self, server_round, arrays, config, grid):
        self._current = arrays  # the model the clients start from: updates are relative to it
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._asked = {m.metadata.dst_node_id for m in messages}
        return messages

    def _drop(self, node: int, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.warning("dropped the reply of node %d: %s", node, reason)

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

    def _checked(
        self, replies: list[Message], expected: dict[str, tuple]
    ) -> tuple[list[Message], torch.Tensor, list]:
        """The well-formed replies, their weights as the rows of one N x d tensor (each reply
        decoded once straight into its row: N = 100 ResNet-18 replies are 4.5 GB, a list of
        decoded arrays and then a stack would need twice that) and the layout to undo it."""
        template = {k: np.zeros(shape, dtype) for k, (shape, dtype) in expected.items()}
        probe, layout = aggregators.stack([template])
        X = torch.empty((len(replies), probe.shape[1]), dtype=probe.dtype)
        kept: list[Message] = []
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                self._drop(node, f"client error: {str(msg.error.reason)[:REASON_CHARS]}")
                continue
            record = msg.content.array_records.get(self.arrayrecord_key)
            metrics = list(msg.content.metric_records.values())
            if record is None or len(metrics) != 1:
                self._drop(
                    node, f"expected ArrayRecord {self.arrayrecord_key!r} and one MetricRecord"
                )
                continue
            problem = layout_problem(record, expected)
            if problem:
                self._drop(node, problem)
                continue
            problem = metrics_problem(metrics[0], (self.weighted_by_key,))
            if not problem and not metrics[0][self.weighted_by_key] > 0:
                problem = f"metric {self.weighted_by_key!r} is not positive"
            if problem:
                self._drop(node, problem)
                continue
            row, i = X[len(kept)].numpy(), 0
            try:  # array_view: the bytes must be the array the layout check read
                for name, shape, _ in layout:
                    size = int(np.prod(shape))
                    row[i : i + size] = array_view(record[name]).ravel()
                    i += size
            except (ValueError, TypeError):
                self._drop(node, UNDECODABLE)
                continue
            # float32 entries sum in float64 without overflow, and a NaN or Inf anywhere
            # makes the sum non-finite: one pass, no d-sized boolean temporary
            finite = (
                np.isfinite(row.sum(dtype=np.float64))
                if row.dtype == np.float32
                else np.isfinite(row).all()
            )
            if not finite:
                self._drop(node, "non-finite values")
                continue
            kept.append(msg)
        return kept, X[: len(kept)], layout

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        answered = {m.metadata.src_node_id for m in replies}
        for node in sorted(self._asked - answered):
            self._drop(node, "no reply within the round timeout")
        expected = self._layout(replies)
        if expected is None:  # nothing sent and no reply with arrays: nothing to aggregate
            self._checked(replies, {})  # counts each reply's reason
            log.warning("round %d: no usable reply", server_round)
            return None, None
        kept, X, layout = self._checked(replies, expected)
        if self._current is not None:
            current = {k: a.numpy() for k, a in self._current.items()}
        elif kept:  # replies alone: their coordinate-wise median is the centre (docstring)
            current = aggregators.unstack(X.median(dim=0).values, layout)
        else:
            log.warning("round %d: no usable reply", server_round)
            return None, None
        centre, _ = aggregators.stack([current])
        X.neg_().add_(centre)  # the updates current - w_i, in place
        if kept and self.norm_bound.factor:
            kept, X = self._bounded(kept, X, current)
        if not kept:
            log.warning("round %d: no usable reply; the model is unchanged", server_round)
            return self._current, None
        # f counts the round's faulty nodes: each node asked that left no kept reply (dropped,
        # an error, silent) is one of them, so the kept replies hold at most f_kept
        f_kept = max(0, self.byzantine - max(0, len(self._asked) - len(kept)))
        problem = self.aggregator.problem(len(kept), f_kept)
        if problem and f_kept == 0:  # every kept reply is honest: their plain mean
            rule: Aggregator = aggregators.Mean()
        elif problem:  # too few replies left for the rule and f: skip, keep the model
            self.skipped += 1
            log.warning("round %d: skipped, the model is unchanged: %s", server_round, problem)
            return self._current, None
        else:
            rule = self.aggregator
        step = aggregators.unstack(rule(X, f=f_kept), layout)
        # np.asarray, not np.ascontiguousarray: that one turns a 0-dim array into shape (1,)
        arrays = ArrayRecord(
            {k: Array(np.asarray(current[k] - step[k], dtype=current[k].dtype)) for k in current}
        )
        metrics = self.train_metrics_aggr_fn([m.content for m in kept], self.weighted_by_key)
        return arrays, metrics

    def _bounded(self, kept: list[Message], X: torch.Tensor, current) -> tuple[list, torch.Tensor]:
        """The replies (and rows of ``X``) whose update norm is within the bound."""
        norms = torch.linalg.vector_norm(X.double(), dim=1).tolist()
        bound = self.norm_bound.bound(norms, True, provisional_scale(current))
        inside = [i for i, size in enumerate(norms) if size <= bound]
        for i, size in enumerate(norms):
            if size > bound:
                self._drop(
                    kept[i].metadata.src_node_id,
                    f"update norm {size:.3g} > max-update-norm x reference = {bound:.3g}",
                )
        return [kept[i] for i in inside], X[inside]


class RobustFedAvg(RobustAggregation, FedAvg):
    """Flower's ``FedAvg`` with a robust rule over the updates (see the module docstring)."""

    def summary(self) -> None:
        log.info("RobustFedAvg: %s, byzantine = %d", self.aggregator.name, self.byzantine)
        super().summary()
