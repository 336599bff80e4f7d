"""Round history and per-client summaries (what results.json and the summary table are
written from): the training metrics of a round, the evaluation statistics of DESIGN.md's
protocol (pooled, mean, p10/p50/p90, worst, clients hurt), drops with their reasons, and
the bytes each round put on the wire (``WireCount``).

**Pooled figures a liar cannot steer.** Every row's ``num-examples`` is its bounded weight
(``bound.ClaimBound``); every loss and RMSE (``wire.is_loss``) is clipped at
``LOSS_CLIP`` x the lower median of the round's values of that metric before anything is
pooled or averaged (``clip_losses``), and the metrics were range-checked on arrival (a loss
below 0, an accuracy outside [0, 1]: dropped; ``wire.metrics_problem``). While liars are at
most half of a round's rows the lower median is at most an honest value, so a liar's loss
counts for at most ``LOSS_CLIP`` x an honest loss, with its bounded share of the weights."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Message

from pflower.strategies.bound import lower_median
from pflower.wire import ALPHA, CONFIG, LOCAL_PART, NUM_EXAMPLES, SERVER_ROUND, is_loss


@dataclass
class RoundLog:
    """What happened in one round, for results.json."""

    round: int
    train: dict[str, float] = field(default_factory=dict)
    evaluate: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    server: dict[str, float] = field(default_factory=dict)  # server-side evaluation
    #: array bytes sent to the clients (``<type>-down``) and received (``<type>-up``) per
    #: message type (``train``, ``evaluate``), as ``WireCount`` measured them
    wire: dict[str, int] = field(default_factory=dict)


def train_loss(train: dict[str, float]) -> float | None:
    """The round's training loss: ``train-loss``, else the first other ``*-loss`` metric
    the clients report (an algorithm that trains only some parameters names its loss)."""
    if "train-loss" in train:
        return train["train-loss"]
    return next((v for k, v in sorted(train.items()) if k.endswith("-loss")), None)


def array_bytes(msg: Message) -> int:
    """Bytes of the arrays a message carries, as Flower serializes them (``Array.data``, the
    numpy ``.npy`` bytes); config and metric records (tens of bytes) are not counted."""
    if msg.has_error():
        return 0
    return sum(
        len(a.data) for record in msg.content.array_records.values() for a in record.values()
    )


class WireCount:
    """A ``Grid`` in front of another that counts the array bytes of every message pushed
    and every reply pulled, by round and message type: what partial personalization saves
    is what it does not send. A reply counts in its request's round (matched by message
    id), so an asynchronous server's late replies land where they were asked for."""

    def __init__(self, grid) -> None:
        self.grid = grid
        self.by_round: dict[int, dict[str, int]] = {}
        self._asked: dict[str, tuple[int, str]] = {}  # message id -> (round, type)
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def _add(self, server_round: int, key: str, size: int) -> None:
        with self._lock:
            counts = self.by_round.setdefault(server_round, {})
            counts[key] = counts.get(key, 0) + size

    @staticmethod
    def _round_and_type(msg: Message) -> tuple[int, str]:
        config = msg.content.config_records.get(CONFIG, {})
        return int(config.get(SERVER_ROUND, 0)), msg.metadata.message_type.split(".")[0]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self.grid.push_messages(messages))
        for msg, msg_id in zip(messages, ids):
            server_round, kind = self._round_and_type(msg)
            self._add(server_round, f"{kind}-down", array_bytes(msg))
            if msg_id:
                self._asked[msg_id] = (server_round, kind)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.grid.pull_messages(message_ids))
        for reply in replies:
            asked = self._asked.pop(reply.metadata.reply_to_message_id, None)
            if asked is not None:
                self._add(asked[0], f"{asked[1]}-up", array_bytes(reply))
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout=None) -> Iterable[Message]:
        # the wrapped grid's own send_and_receive may push through another path (a
        # SuperLink's): count here, by the request each reply answers
        messages = list(messages)
        asked = [self._round_and_type(m) for m in messages]
        for msg, (server_round, kind) in zip(messages, asked):
            self._add(server_round, f"{kind}-down", array_bytes(msg))
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        by_id = {m.metadata.message_id: a for m, a in zip(messages, asked)}
        for reply in replies:
            server_round, kind = by_id.get(reply.metadata.reply_to_message_id, asked[0])
            self._add(server_round, f"{kind}-up", array_bytes(reply))
        return replies


#: a round's client compute: sum over its replies of data-passes x num-examples
EXAMPLES_PROCESSED = "examples-processed"
#: c: a pooled loss or RMSE takes each row's value clipped at c x the lower median of the
#: round's values of that metric. Honest per-client losses are heavy-tailed where most
#: clients fit their data: PFLEGO's reached 270 x the lower median (20 clients, 30
#: rounds), and a clip at 10 x (100 x) lowered its honest pooled loss by 90 % (57 %);
#: 1000 x clipped none (``benchmarks/claim_weights.py --losses``)
LOSS_CLIP = 1000.0
#: how many loss values ``clip_losses`` clipped, in a round's metrics when some were
LOSSES_CLIPPED = "losses-clipped"


def clip_losses(rows: list[dict[str, float]]) -> tuple[list[dict[str, float]], int]:
    """The rows with each loss and RMSE (``wire.is_loss``) clipped at ``LOSS_CLIP`` x the
    lower median of the rows' values of that metric, and how many values were clipped.
    The lower median is at most an honest value while at most half of the rows lie (the
    ceiling cannot be raised); losses are >= 0, so a low liar moves a mean by at most its
    share of it."""
    ceilings = {}
    for key in {k for r in rows for k in r if is_loss(k)}:
        values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        if values:
            ceilings[key] = LOSS_CLIP * lower_median(values)
    clipped, out = 0, []
    for r in rows:
        over = {k: c for k, c in ceilings.items() if k in r and r[k] > c}
        clipped += len(over)
        out.append({**r, **over} if over else r)
    return out, clipped


def weighted_mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of the numeric metrics of the replies, weighted by ``num-examples`` (their
    bounded weights), losses clipped (``clip_losses``); and the round's total
    ``examples-processed`` (each reply's ``data-passes`` times its ``num-examples``: the
    examples its client took through the model)."""
    rows, clipped = clip_losses(rows)
    weights = np.asarray([r[NUM_EXAMPLES] for r in rows], dtype=float)
    out = {NUM_EXAMPLES: float(weights.sum())}
    passes = [
        r["data-passes"] * n
        for r, n in zip(rows, weights)
        if isinstance(r.get("data-passes"), (int, float)) and np.isfinite(r["data-passes"])
    ]
    if passes and math.isfinite(sum(passes)):
        out[EXAMPLES_PROCESSED] = float(sum(passes))
    keys = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))} - {
        NUM_EXAMPLES,
        EXAMPLES_PROCESSED,
    }
    for key in sorted(keys):
        pairs = [(r[key], w) for r, w in zip(rows, weights) if key in r and np.isfinite(r[key])]
        if pairs:
            values, ws = zip(*pairs)
            with np.errstate(over="ignore", invalid="ignore"):
                mean = float(np.average(values, weights=ws))
            if math.isfinite(mean):  # finite values near 1e308 may sum past it: left out
                out[key] = mean
    if clipped:
        out[LOSSES_CLIPPED] = clipped
    return out


def summarize_clients(rows: list[dict[str, float]]) -> dict[str, float]:
    """Pooled and per-client statistics of personalized (and global) test accuracy and loss,
    weighted by the rows' ``num-examples`` (their bounded weights), losses clipped
    (``clip_losses``); a statistic that overflows (finite losses near 1e308 from a bad
    client) is left out, never written as ``Infinity`` into ``results.json``."""
    rows, clipped = clip_losses(rows)
    with np.errstate(over="ignore", invalid="ignore"):
        out = _summary(rows)
    if clipped:
        out[LOSSES_CLIPPED] = clipped
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    n = np.asarray([r[NUM_EXAMPLES] for r in rows], dtype=float)
    out: dict[str, float] = {"clients": len(rows), NUM_EXAMPLES: float(n.sum())}
    for which in ("personal", "global", "localized", LOCAL_PART):
        if not all(f"{which}-loss" in r for r in rows):
            continue
        loss = np.asarray([r[f"{which}-loss"] for r in rows], dtype=float)
        out[f"{which}-loss"] = float((loss * n).sum() / n.sum())
        if all(f"{which}-rmse" in r for r in rows):  # regression: pooled over test examples
            rmse = np.asarray([r[f"{which}-rmse"] for r in rows], dtype=float)
            out[f"{which}-rmse"] = float(np.sqrt((rmse**2 * n).sum() / n.sum()))
            out[f"{which}-rmse-mean"] = float(rmse.mean())
            for q in (10, 50, 90):
                out[f"{which}-rmse-p{q}"] = float(np.percentile(rmse, q))
            out[f"{which}-rmse-worst"] = float(rmse.max())
        if not all(f"{which}-accuracy" in r for r in rows):
            continue
        acc = np.asarray([r[f"{which}-accuracy"] for r in rows], dtype=float)
        out[f"{which}-accuracy"] = float((acc * n).sum() / n.sum())  # pooled over test examples
        out[f"{which}-accuracy-mean"] = float(acc.mean())
        for q in (10, 50, 90):
            out[f"{which}-accuracy-p{q}"] = float(np.percentile(acc, q))
        out[f"{which}-accuracy-worst"] = float(acc.min())
    if all(ALPHA in r for r in rows):  # APFL's per-client alpha: where it went, client by client
        alpha = np.asarray([r[ALPHA] for r in rows], dtype=float)
        for stat in ("mean", "min", "max"):
            out[f"{ALPHA}-{stat}"] = float(getattr(alpha, stat)())
    # (personal-loss is in every row: the server requires it; an accuracy may be missing
    # from every row of a round, e.g. the one reply of a 1-reply round left it out)
    if "global-accuracy" in out and "personal-accuracy" in out:
        out["clients-hurt"] = int(sum(r["personal-accuracy"] < r["global-accuracy"] for r in rows))
    elif "global-loss" in out:
        out["clients-hurt"] = int(sum(r["personal-loss"] > r["global-loss"] for r in rows))
    return out
