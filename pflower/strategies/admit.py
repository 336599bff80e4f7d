"""The reply pipeline's first stage: which replies are what the round asked for.

**Guarantee.** A reply reaches the later stages only if it answers one of the round's
messages (one per node; a reply to another round's message or a node's second reply is
dropped), is not an error (a client's refusal of the handshake is counted as ``config
mismatch`` with the client's own words), carries exactly one MetricRecord whose values are
finite numbers in range (``wire.metrics_problem``: accuracies in [0, 1], losses >= 0, a
``num-examples`` that is a positive integer) and, for a training reply, exactly the records
the algorithm replies with, each with the names, shapes and dtypes of the parameters sent,
bytes that decode to them, and finite values. Anything else is dropped and counted with its
reason and node (``Round.drop``); it never raises, so one broken or hostile client cannot
stop the server. A node asked that sent nothing back within the round's timeout is counted
too (``no reply within the round timeout``).

With the update-norm bound on, a training reply's values are checked through its update
norm: one float64 pass that is non-finite if and only if a value is (or the norm overflows,
and then the values are looked at), instead of a finiteness pass and then the norm's; the
norm is kept on the reply (``ClientUpdate.norm``) for the bound stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, Message

from pflower.strategies.bound import all_finite, update_norm
from pflower.strategies.rounds import Round
from pflower.wire import (
    CONFIG_MISMATCH,
    NUM_EXAMPLES,
    REASON_CHARS,
    UNDECODABLE,
    ClientUpdate,
    array_view,
    layout_problem,
    metrics_problem,
)


class Admit:
    """The admit stage (module docstring).

    Parameters
    ----------
    by_norm : bool (default: True)
        Check a training reply's values through its update norm (the update-norm bound is
        on; the norm is then kept for it).
    count_key : str (default: "num-examples")
        The metric that weighs a training reply (Flower's ``weighted_by_key``); it must be
        present and positive.
    """

    def __init__(self, by_norm: bool = True, count_key: str = NUM_EXAMPLES) -> None:
        self.by_norm, self.count_key = by_norm, count_key

    def answers(self, rnd: Round, replies: Iterable[Message]) -> list[Message]:
        """The replies that answer one of the round's messages, one per node; then every
        node asked without a reply left is counted as silent. With ``rnd.sent`` None
        (replies no message asked for) every reply is kept and nobody is silent."""
        replies = list(replies)
        if rnd.sent is None:
            rnd.answered = len(replies)
            return replies
        seen: set[int] = set()
        kept = []
        for msg in replies:
            node = rnd.sender(msg)
            if msg.metadata.reply_to_message_id not in rnd.sent:
                rnd.drop(node, "reply to a message of another round")
            elif node in seen:
                rnd.drop(node, "a second reply of this node in the round")
            else:
                seen.add(node)
                kept.append(msg)
        # Flower's grid returns only the replies that arrived within the round's timeout
        for node in sorted(rnd.asked - {rnd.sender(m) for m in kept}):
            rnd.drop(node, "no reply within the round timeout")
        rnd.answered = len(kept)
        return kept

    def metrics(self, rnd: Round, msg: Message, required: Iterable[str]) -> dict | None:
        """The reply's single MetricRecord as a dict, or None (and a drop) if the reply is an
        error or its metrics are malformed."""
        node = rnd.sender(msg)
        if msg.has_error():
            reason = str(msg.error.reason)
            if CONFIG_MISMATCH in reason:  # the client's own words follow the count's key
                reason = reason[reason.index(CONFIG_MISMATCH) :].rstrip("'>\"")
            else:
                reason = f"client error: {reason}"
            # the client's own words, cut short: they become a key of the counts
            rnd.drop(node, reason[:REASON_CHARS])
            return None
        records = msg.content.metric_records
        if len(records) != 1:
            rnd.drop(node, f"expected one MetricRecord, got {len(records)}")
            return None
        metrics = dict(next(iter(records.values())))
        problem = metrics_problem(metrics, tuple(required))
        if not problem and self.count_key != NUM_EXAMPLES and not metrics[self.count_key] > 0:
            problem = f"metric {self.count_key!r} is not positive"
        if problem:
            rnd.drop(node, problem)
            return None
        return metrics

    def train(self, rnd: Round, replies: Iterable[Message]) -> list[ClientUpdate]:
        """The well-formed training replies as ``ClientUpdate``s (the records as read-only
        views of the replies' bytes); the others dropped and counted."""
        keys = {rnd.reply_key, *rnd.extra_keys}
        # values checked by the norm only where there is a centre to take it from
        by_norm = self.by_norm and bool(rnd.current)
        scratch: dict[str, np.ndarray] = {}
        updates = []
        for msg in replies:
            metrics = self.metrics(rnd, msg, [self.count_key])
            if metrics is None:
                continue
            node = rnd.sender(msg)
            records = msg.content.array_records
            if set(records) != keys:
                rnd.drop(node, f"expected records {sorted(keys)}, got {sorted(records)}")
                continue
            checked: dict[str, dict[str, np.ndarray]] = {}
            norm = None
            for key in sorted(keys):  # the first bad record drops the reply, counted once
                here = by_norm and key == rnd.reply_key
                tensors = self.record(rnd, node, records[key], rnd.layout, values=not here)
                if tensors is not None and here:
                    norm = update_norm(rnd.current, tensors, rnd.weights, scratch)
                    if not math.isfinite(norm) and not all_finite(tensors):
                        rnd.drop(node, "non-finite values")
                        tensors = None
                if tensors is None:
                    break
                checked[key] = tensors
            if len(checked) != len(keys):
                continue
            tensors = checked.pop(rnd.reply_key)
            updates.append(ClientUpdate(node, tensors, metrics, checked, norm))
        return updates

    @staticmethod
    def record(
        rnd: Round, node: int, record: ArrayRecord, layout: Mapping, values: bool = True
    ) -> dict | None:
        """The record's tensors, or None (and a drop) if its names, shapes, dtypes or
        (``values``) values are not those of finite shared parameters."""
        problem = layout_problem(record, layout)
        if problem:
            rnd.drop(node, problem)
            return None
        try:
            tensors = {k: array_view(a) for k, a in record.items()}  # views: no second copy
        except (ValueError, TypeError):  # bytes that are not the array stated
            rnd.drop(node, UNDECODABLE)
            return None
        if values and not all_finite(tensors):
            rnd.drop(node, "non-finite values")
            return None
        return tensors

    def evaluate(
        self, rnd: Round, replies: Iterable[Message], required: Iterable[str]
    ) -> list[tuple[int, dict]]:
        """The evaluation replies' (node, metrics) rows: each well-formed (``metrics``), and
        each with the metrics most rows report (accuracies for a classifier...): a reply
        without them is dropped, not a KeyError in the summary."""
        rows = []
        for msg in replies:
            metrics = self.metrics(rnd, msg, required)
            if metrics is not None:
                rows.append((rnd.sender(msg), metrics))
        counts: dict[str, int] = {}
        for _, metrics in rows:
            for key in metrics:
                counts[key] = counts.get(key, 0) + 1
        expected = {k for k, c in counts.items() if 2 * c > len(rows)}
        kept = []
        for node, metrics in rows:
            missing = sorted(expected - set(metrics))
            if missing:
                rnd.drop(node, f"metric {missing[0]!r} missing")
            else:
                kept.append((node, metrics))
        return kept
