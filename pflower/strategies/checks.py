"""Reply checks and bounds: what a training or evaluation reply must be before it reaches an
aggregate, and the bounds that keep a reply that passes from steering the run.

``ReplyChecks`` is the part of ``PersonalizedStrategy`` that judges replies (mixed in as
``nodes.NodeSampling`` is); ``UpdateNormBound`` and ``ClaimBound`` are the two bounds, usable on
their own (``RobustFedAvg``, ``AsyncFFGG``).

**Layout and values.** A reply that is an error, lacks the algorithm's reply key, carries
other records, names, shapes or dtypes than the shared parameters, non-finite values, or a
metric out of range (not a finite number, an accuracy outside [0, 1], a loss below 0:
``wire.metrics_problem``) is dropped and counted with its reason and node id.

**The update-norm bound** (``UpdateNormBound``). Every accepted reply's update (gradient,
delta, or ``current - returned weights``) has a norm of at most ``K x R``, ``K`` =
``max-update-norm``, ``R`` the *reference* of its kind (returned weights, or vectors):

- ``R`` starts at ``S / K``, ``S`` a scale the server knows before any reply: the norm of the
  shared parameters, at least ``0.1 sqrt(d)`` (RMS 0.1 per coordinate: a zero-initialised
  model has ``||theta|| = 0``), over what multiplies an update when the server applies it (a
  server SGD's lr; under server Adam the client lr for gradients, else 1): an update of norm
  ``S`` moves theta by about its own length. So the first rounds, whatever their size, accept
  updates up to the model's own scale: honest updates measured at most 0.05 S for every
  aggregating algorithm (digits MLP, 6 clients, 3 rounds; ``S`` = 23 there, 461 for PFLEGO's
  gradients under server Adam).
- ``R`` is seeded by the first round of at least 2 replies: ``max(S / K, m)``, ``m`` its
  *lower median* (the ceil(N/2)-th smallest norm); until then every round's bound is ``S``
  (of that round's parameters, but never above ``S_1``, the first round's: the updates a
  lone client gets accepted must not raise the bound). Afterwards it moves only in rounds of
  at least 2 replies:
  ``R <- max(R, min(m, g R))``, ``g`` = ``update-norm-growth``. It never decreases (a client
  sending tiny updates cannot get honest ones dropped later), it grows by at most ``g`` per
  round whatever anyone sends, and with at most floor(N/2) Byzantine replies in a round ``m``
  is at most an honest reply's norm: a minority can neither seed it high nor raise it. A
  1-reply round is checked against ``R`` and leaves it as it is.
- Guarantee: with at most floor(N/2) Byzantine replies in every round of 2 or more, ``R``
  never exceeds ``max(S_1 / K, the largest honest update norm so far)`` and, after being
  seeded in round r_1, ``R <= g^(r - r_1) R_(r_1)`` whatever anyone sends; before it is seeded
  a round accepts at most ``min(S_t, S_1)``. In a (weighted) mean of N
  replies, f Byzantine ones move the aggregate by at most their share of the weights x
  ``K R`` beyond the honest mean. If that damage makes the honest updates themselves grow,
  ``R`` follows them at most ``g`` per round. Keeping the model within the honest spread is a
  robust rule's job (``robust-aggregator``).

**The claim bound** (``ClaimBound``). A reply's ``num-examples`` is its weight in every
mean, and a weight is *bounded*, never a reason to drop a reply: ``min(claim, first, cap)``,
``first`` what its node reported at start-up or in its first weighed reply (a node cannot
raise its own weight), ``cap`` = ``max-num-examples`` if set, else ``kappa x m``, ``m``
the lower median of the *pool*: each node known once, with its first claim. While fewer
than half the nodes known lie, ``m`` lies between two honest first claims, whether the
liars claim 1 or 1e12 (a lower median of the round's claims, and drops above 100 x it, let
a node claiming 1 get the honest one dropped in a 2-node federation). So a liar weighs at
most ``kappa x m`` and a low liar lowers only caps, its own too: f liars of a round whose
N - f honest replies each weigh at least ``m`` hold at most ``f kappa / (f kappa + N - f)``
of the weights (docs/threat-model.md). ``kappa`` = ``CLAIM_FACTOR`` (10) leaves the
built-in partitioners' honest sizes uncapped (``benchmarks/claim_weights.py``).

**Under central DP every decision about a reply depends on that reply alone** (issue 46):
the mechanism's sensitivity is one clipped reply, so nothing another client sent may decide
whether a reply counts or how much. The update-norm bound (a lower median of the round's
norms, carried into later rounds) is off: the clip to ``dp-clip`` replaces it, a reply is
clipped, never dropped for its size. Claims weigh nothing in the mean (it is uniform over
the sampled clients, ``privacy.Mechanism.mean``), and the claim bound's relative cap (a
median of the others' first claims) is not taken: a claim is bounded only by its own node's
first claim and ``max-num-examples`` (it weighs the round's training metrics, which are not
privatized). What is left is local to the reply: its layout, its values being finite, its
round; a reply dropped for them counts as a zero update (the mean's divisor is the planned
sample, whatever was dropped). The logs do not name the node of a dropped or capped reply
under ``dp`` (they would tell who was sampled in the round).

**Robust rules' preconditions** are checked every round against the replies kept (``combine``:
a round that cannot meet them is skipped and counted, never run with a smaller f).

**Rounds that apply nothing.** ``max_failed_rounds`` consecutive training rounds in which no
reply was applied (all dropped, or skipped) stop the run with ``RunFailed``, listing the
round's drop reasons: a misconfigured federation fails loudly instead of saving an untrained
model as its result.

**Recovery.** A node whose replies were dropped for their values (non-finite, update norm) in
``RESET_AFTER`` consecutive training rounds gets ``personal-reset`` in its next training
message: it starts that round from the personal init, so stored state of its own that makes
its replies huge cannot keep it out of the federation for good.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import numpy as np
from flwr.app import ArrayRecord, Message

from pflower.wire import (
    ARRAYS,
    CONFIG_MISMATCH,
    GRADIENT,
    NUM_EXAMPLES,
    REASON_CHARS,
    UNDECODABLE,
    ClientUpdate,
    array_view,
    layout_problem,
    metrics_problem,
)

log = logging.getLogger("flwr.pflower")

#: the recent-norm clip's pool: the last norm of each of this many most recent distinct nodes
CLIP_POOL = 10
#: the recent-norm clip while no other node's norm is known: this x min(S_t, S_1), the
#: update-norm bound's scale (honest updates measured at most 0.05 S, gradients below 0.01 S)
PROVISIONAL_CLIP = 0.05
#: kappa: without ``max_num_examples`` a claim weighs at most this many times the lower
#: median of the nodes' first claims (Dirichlet(0.3) partitions of mnist-5k over 50
#: clients: the largest is 3.6 x it; ``benchmarks/claim_weights.py``)
CLAIM_FACTOR = 10.0
#: how many replies of a round had their claim capped: a key of its metrics when some had
CLAIMS_CAPPED = "claims-capped"
#: consecutive value drops (non-finite, update norm) after which a node is sent personal-reset
RESET_AFTER = 2
#: drop reasons that are about a reply's values (what its own stored state may cause)
VALUE_REASONS = ("non-finite values", "update norm")
#: the provisional scale's floor per coordinate (a zero-initialised model has ||theta|| = 0)
SCALE_FLOOR = 0.1


class RunFailed(RuntimeError):
    """Consecutive training rounds applied no reply: the federation cannot train."""


def lower_median(values: Sequence[float]) -> float:
    """The ceil(N/2)-th smallest value: at most an honest value when at most floor(N/2) of
    the N values are adversarial (for N = 2: the smaller one)."""
    ordered = sorted(values)
    return float(ordered[math.ceil(len(ordered) / 2) - 1])


def update_norm(
    current: Mapping[str, np.ndarray],
    tensors: Mapping[str, np.ndarray],
    weights: bool,
    scratch: dict[str, np.ndarray] | None = None,
) -> float:
    """One reply's update norm, in float64 (a 1e30 reply must not overflow): of ``current -
    tensors`` for returned weights, else of ``tensors``. Non-finite (``inf``, ``nan``) if a
    value is; a finite norm means every value is finite. ``scratch``: float64 buffers by
    layer, kept across replies (a fresh array per reply and layer costs its pages anew: ~1 ms
    per 1.2 MB layer on a virtual machine; issue 29)."""
    scratch = {} if scratch is None else scratch
    total = 0.0
    for k, t in tensors.items():
        buf = scratch.get(k)
        if buf is None or buf.shape != t.shape:
            buf = scratch[k] = np.empty(t.shape, dtype=np.float64)
        if weights:  # the difference in the arrays' own dtype, as ``current - t``
            np.subtract(current[k], t, out=buf, casting="unsafe")
        else:
            np.copyto(buf, t, casting="unsafe")
        total += np.square(buf, out=buf).sum()
    return float(np.sqrt(total))


def update_norms(
    current: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], weights: bool
) -> np.ndarray:
    """Each reply's update norm (``update_norm``): the one its value check computed
    (``ClientUpdate.norm``), else computed here."""
    scratch: dict[str, np.ndarray] = {}
    return np.array(
        [
            u.norm if u.norm is not None else update_norm(current, u.tensors, weights, scratch)
            for u in updates
        ],
        dtype=np.float64,
    )


def all_finite(tensors: Mapping[str, np.ndarray]) -> bool:
    return all(np.isfinite(t).all() for t in tensors.values())


def shared_norm(current: Mapping[str, np.ndarray]) -> float:
    """``||current||`` over all its arrays, in float64."""
    return math.sqrt(sum(float(np.square(a.astype(np.float64)).sum()) for a in current.values()))


def provisional_scale(current: Mapping[str, np.ndarray], lr: float | None = None) -> float:
    """``S``: the shared parameters' norm, at least ``SCALE_FLOOR sqrt(d)``, divided by
    ``lr``, what multiplies an update when it is applied (``ReplyChecks.step_factor``): an
    update of norm ``S`` moves theta by about its own length."""
    d = sum(a.size for a in current.values())
    scale = max(shared_norm(current), SCALE_FLOOR * math.sqrt(d))
    return scale / lr if lr else scale


class UpdateNormBound:
    """The update-norm bound with a bounded-growth reference (module docstring).

    Parameters
    ----------
    factor : float (default: 1000.0)
        ``K``: an accepted update is at most ``K`` times the reference; 0 turns the bound off.
    growth : float (default: 2.0)
        ``g``: the reference grows by at most this factor per round (>= 1).
    """

    def __init__(self, factor: float = 1000.0, growth: float = 2.0) -> None:
        if not (factor == 0 or factor >= 1):
            raise ValueError(f"max_update_norm = {factor}: must be 0 (off) or >= 1")
        if not growth >= 1:
            raise ValueError(f"update_norm_growth = {growth}: must be >= 1")
        self.factor, self.growth = factor, growth
        #: the reference per reply kind (True: returned weights; False: vectors)
        self.reference: dict[bool, float] = {}
        #: per kind, ``S`` of the first round that checked replies of that kind: the scale
        #: never rises above it (a lone client's accepted updates raise ``S_t``: one that
        #: doubled ||theta|| in each of 20 one-reply rounds raised S_t, and the reference
        #: it then seeded, a millionfold)
        self.first_scale: dict[bool, float] = {}

    def bound(self, norms: Sequence[float], kind: bool, scale: float) -> float:
        """This round's bound on update norms; moves the reference of ``kind`` first
        (``scale``: ``S_t``, of which the floor of a reference not yet seeded is
        ``min(S_t, S_1) / K``)."""
        scale = min(scale, self.first_scale.setdefault(kind, scale))
        reference = self.reference.get(kind)
        if reference is None:  # not seeded: S / K, or the first multi-reply round's median
            reference = scale / self.factor
            if len(norms) >= 2:
                self.reference[kind] = reference = max(reference, lower_median(norms))
        elif len(norms) >= 2:
            reference = max(reference, min(lower_median(norms), self.growth * reference))
            self.reference[kind] = reference
        return self.factor * reference


class RecentNormClip:
    """The clip of a reply no majority of its round can vouch for: ``factor`` x the lower
    median of the last norm of each of the last ``pool`` distinct nodes (the reply's own
    norm as its node's entry); ``provisional`` while no other node's norm is known.
    Asynchronous FFGG clips every applied gradient with it (``async_ffgg``), adaptive
    clipping the rounds of 1 or 2 replies before any round of 3 (``combine``). A node has one
    entry however often it replies, so while at most half of the pool is Byzantine the clip
    is at most ``factor`` x an honest node's last norm: one client cannot walk it up, and a
    low liar moves it down by one rank.

    Parameters
    ----------
    factor : float
        m; 0: off (``threshold`` is infinite).
    pool : int (default: ``CLIP_POOL``)
        How many distinct nodes' last norms the median is taken over.
    """

    def __init__(self, factor: float, pool: int = CLIP_POOL) -> None:
        self.factor, self.pool = factor, pool
        self.norms: OrderedDict[int, float] = OrderedDict()  # node -> last norm, oldest first

    def threshold(self, node: int, norm: float, provisional: float) -> float:
        """The largest norm ``node``'s update of norm ``norm`` may keep: m x the lower median
        of the pool with ``norm`` as ``node``'s entry; ``provisional`` while no other node's
        norm is known."""
        if not self.factor:
            return math.inf
        others = [v for n, v in self.norms.items() if n != node][-(self.pool - 1) :]
        if not others:
            return provisional
        return self.factor * lower_median([*others, norm])

    def record(self, node: int, norm: float) -> None:
        """``node``'s update of norm ``norm`` (applied, or clipped and applied): its entry,
        now the newest."""
        self.norms.pop(node, None)
        self.norms[node] = norm
        while len(self.norms) > self.pool:
            self.norms.popitem(last=False)


class ClaimBound:
    """The ``num-examples`` bound (module docstring): each claim becomes a bounded weight.

    Parameters
    ----------
    max_num_examples : int (default: 0)
        An absolute cap on every weight in place of ``factor x`` the pool's lower median
        (0: that relative cap): a run whose honest sizes are known to stay below it weighs
        every reply by its claim, as the papers do.
    factor : float (default: ``CLAIM_FACTOR``)
        ``kappa``: the relative cap's multiple of the pool's lower median (>= 1).
    """

    def __init__(self, max_num_examples: int = 0, factor: float = CLAIM_FACTOR) -> None:
        if max_num_examples < 0:
            raise ValueError(f"max_num_examples = {max_num_examples}: must be >= 0")
        if not factor >= 1:
            raise ValueError(f"claim factor = {factor}: must be >= 1")
        self.max_num_examples, self.factor = max_num_examples, factor
        self.claimed: dict[int, float] = {}  # node id -> its first weighed claim

    def cap(self, known: Mapping[int, float], new: Mapping[int, float] | None = None) -> float:
        """The largest weight: ``max_num_examples``, else ``factor`` x the lower median of
        the pool, every node once with its first claim (``known``: start-up sizes, before
        its first weighed claim; ``new``: claims of nodes not yet in the pool); ``inf``
        while the pool is empty."""
        if self.max_num_examples:
            return float(self.max_num_examples)
        pool = {**self.claimed, **known}
        pool.update({n: c for n, c in (new or {}).items() if n not in pool})
        return self.factor * lower_median(list(pool.values())) if pool else math.inf

    def weigh(
        self, claims: Mapping[int, float], known: Mapping[int, float], relative: bool = True
    ) -> dict[int, tuple[float, str]]:
        """The round's weights: node -> (``min(claim, first, cap)``, why it is below the
        claim: '' if it is not). The claims of nodes not yet in the pool become their first
        claims and join it before the cap is taken: the cap is of every node known and this
        round's newcomers (in a first round of 2 replies a liar meets the honest claim).
        ``relative`` False (central DP): no cap from the others' claims, only
        ``max_num_examples`` (if set): each weight then depends on its own node alone."""
        if relative:
            cap = self.cap(known, claims)
        else:
            cap = float(self.max_num_examples) if self.max_num_examples else math.inf
        out = {}
        for node, claim in claims.items():
            first = known.get(node, self.claimed.get(node))
            if first is None:
                self.claimed[node] = first = claim
            weight = min(claim, first, cap)
            if weight == claim:
                out[node] = (weight, "")
            elif weight == first and first < cap:
                out[node] = (weight, f"above the {first:g} this node first reported")
            elif self.max_num_examples:
                out[node] = (weight, "above max-num-examples")
            else:
                out[node] = (weight, f"above {self.factor:g} x the first claims' lower median")
        return out


def _part_state(part: str, name: str) -> property:
    """A dict ``name`` of the check ``part`` as an attribute of the strategy (set: a copy)."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, dict(value)),
    )


class ReplyChecks:
    """Mixin of ``PersonalizedStrategy``: checks replies, drops and counts bad ones, bounds
    the rest. It expects ``_asked``, ``_sent``, ``_current``, ``reply_key``,
    ``extra_reply_keys``, ``num_train_of``, ``_log(round)`` and ``pretraining(round)``, and
    keeps its own state in ``norm_bound``, ``claims``, ``value_drops`` and ``failed_rounds``.
    Under central DP (``central_dp``, where the strategy has it) it decides about a reply from
    that reply alone (module docstring); under any ``privacy`` its logs name no node."""

    norm_bound: UpdateNormBound
    claims: ClaimBound
    max_failed_rounds: int

    def init_checks(
        self,
        max_update_norm: float,
        update_norm_growth: float,
        max_num_examples: int,
        max_failed_rounds: int,
    ) -> None:
        if max_failed_rounds < 0:
            raise ValueError(f"max_failed_rounds = {max_failed_rounds}: must be >= 0 (0: off)")
        self.norm_bound = UpdateNormBound(max_update_norm, update_norm_growth)
        self.claims = ClaimBound(max_num_examples)
        # evaluation replies weigh the pooled test metrics by their num-examples (the
        # client's test set): bounded as training claims are, in a pool of their own
        self.eval_claims = ClaimBound()
        # replies whose claim was capped in the last training / evaluation round (counted in
        # the round's metrics as ``claims-capped``)
        self.train_claims_capped = self.eval_claims_capped = 0
        self.extra_norm_bounds: dict[str, UpdateNormBound] = {}  # by record (``extra``)
        self.max_failed_rounds = max_failed_rounds
        self.failed_rounds = 0  # consecutive training rounds that applied no reply
        self.value_drops: dict[int, int] = {}  # node -> consecutive rounds of value drops
        self._round_value_drops: set[int] = set()

    # checkpointed state (``pflower.checkpoint``), under the names it always had
    update_norm_reference = _part_state("norm_bound", "reference")
    update_norm_first_scale = _part_state("norm_bound", "first_scale")
    claimed_num_examples = _part_state("claims", "claimed")
    claimed_evaluate_examples = _part_state("eval_claims", "claimed")

    @property
    def replies_alone(self) -> bool:
        """Central DP: every decision about a reply depends on that reply alone (no
        update-norm reference, no claim median; module docstring)."""
        return bool(getattr(self, "central_dp", False))

    @property
    def names_nodes(self) -> bool:
        """Whether the logs may name the node of a reply: not under ``dp``, where a line
        naming it would tell that it was sampled in the round (issue 46)."""
        return getattr(self, "privacy", None) is None

    # --- who sent what -------------------------------------------------------------------
    def _count_silent(self, server_round: int, replies: list[Message]) -> None:
        """Count as dropped the nodes asked this round that sent nothing back (Flower's
        grid returns only the replies that arrived within ``timeout``)."""
        answered = {self.sender(msg) for msg in replies}
        for node in sorted(self._asked - answered):
            self._drop(server_round, node, "no reply within the round timeout")

    def _answers(self, server_round: int, replies: list[Message]) -> list[Message]:
        """The replies that answer one of this round's messages, one per node: a reply to
        another round's message, and a node's second reply in a round, are dropped and
        counted (Flower's SuperLink refuses both; a ``Grid`` of one's own may not)."""
        sent = {m.metadata.message_id for m in self._sent}
        seen: set[int] = set()
        kept = []
        for msg in replies:
            node = self.sender(msg)
            if msg.metadata.reply_to_message_id not in sent:
                self._drop(server_round, node, "reply to a message of another round")
            elif node in seen:
                self._drop(server_round, node, "a second reply of this node in the round")
            else:
                seen.add(node)
                kept.append(msg)
        return kept

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
        if reason.startswith(VALUE_REASONS):
            self._round_value_drops.add(node_id)
        if self.names_nodes:
            log.warning("round %d: dropped the reply of node %d: %s", server_round, node_id, reason)
        else:
            log.warning("round %d: dropped a reply: %s", server_round, reason)

    def _metrics(self, server_round: int, msg: Message, required: Iterable[str]) -> dict | None:
        """The reply's single MetricRecord as a dict, or None (and a drop) if malformed. A
        client that refused the handshake is counted as ``config mismatch``."""
        node = self.sender(msg)
        if msg.has_error():
            reason = str(msg.error.reason)
            if CONFIG_MISMATCH in reason:  # the client's own words follow the count's key
                reason = reason[reason.index(CONFIG_MISMATCH) :].rstrip("'>\"")
            else:
                reason = f"client error: {reason}"
            # the client's own words, cut short: they become a key of the counts
            self._drop(server_round, node, reason[:REASON_CHARS])
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

    def check_evaluate_claims(
        self, server_round: int, rows: list[tuple[int, dict]]
    ) -> list[tuple[int, dict]]:
        """The evaluation rows (node, metrics), each with its ``num-examples`` (the node's
        test set, the weight of its metrics in the pooled figures) bounded as training
        claims are, in a pool of their own (``eval_claims``): at most the node's first
        evaluation claim and ``CLAIM_FACTOR`` x the lower median of the nodes' first
        evaluation claims. No row is dropped for its claim; the rows capped are counted
        (``eval_claims_capped``)."""
        weights = self.eval_claims.weigh({node: m[NUM_EXAMPLES] for node, m in rows}, {})
        out = []
        self.eval_claims_capped = 0
        for node, metrics in rows:
            weight, reason = weights[node]
            if reason:
                self._capped(server_round, node, metrics[NUM_EXAMPLES], weight, reason)
                self.eval_claims_capped += 1
                metrics = {**metrics, NUM_EXAMPLES: weight}
            out.append((node, metrics))
        return out

    def _capped(self, server_round, node: int, claim: float, weight: float, reason: str) -> None:
        if not self.names_nodes:
            log.warning("round %d: a num-examples claim was capped: %s", server_round, reason)
            return
        log.warning(
            "round %d: node %d's num-examples %g weighs %g: %s",
            server_round,
            node,
            claim,
            weight,
            reason,
        )

    # --- training replies ----------------------------------------------------------------
    def check_train_replies(
        self, server_round: int, replies: Iterable[Message]
    ) -> list[ClientUpdate]:
        """Keep well-formed replies; drop and count the others."""
        self._round_value_drops = set()
        pretraining = self.pretraining(server_round)
        reply_key = ARRAYS if pretraining else self.reply_key
        keys = {reply_key, *(() if pretraining else self.extra_reply_keys)}
        expected = {k: (tuple(a.shape), a.dtype) for k, a in self._current.items()}
        # with the update-norm bound on, the reply's values are checked by its norm, one
        # float64 pass that is non-finite if and only if a value is (or the norm overflows,
        # then the values are looked at), instead of an isfinite pass and then the norm's
        norms = bool(self.norm_bound.factor)
        weights = pretraining or self.reply_key == ARRAYS
        current = {k: array_view(a) for k, a in self._current.items()} if norms else {}
        scratch: dict[str, np.ndarray] = {}
        updates = []
        for msg in replies:
            metrics = self._metrics(server_round, msg, [NUM_EXAMPLES])
            if metrics is None:
                continue
            node = self.sender(msg)
            records = msg.content.array_records
            if set(records) != keys:
                self._drop(
                    server_round, node, f"expected records {sorted(keys)}, got {sorted(records)}"
                )
                continue
            checked: dict[str, dict[str, np.ndarray]] = {}
            norm = None
            for key in sorted(keys):  # the first bad record drops the reply, counted once
                by_norm = norms and key == reply_key
                tensors = self._check_record(
                    server_round, node, records[key], expected, values=not by_norm
                )
                if tensors is not None and by_norm:
                    norm = update_norm(current, tensors, weights, scratch)
                    if not math.isfinite(norm) and not all_finite(tensors):
                        self._drop(server_round, node, "non-finite values")
                        tensors = None
                if tensors is None:
                    break
                checked[key] = tensors
            if len(checked) != len(keys):
                continue
            tensors = checked.pop(reply_key)
            updates.append(ClientUpdate(node, tensors, metrics, checked, norm))
        return updates

    def _check_record(
        self, server_round, node, record: ArrayRecord, expected, values: bool = True
    ) -> dict | None:
        """The record's tensors, or None (and a drop) if its names, shapes, dtypes or
        (``values``) values are not those of finite shared parameters."""
        problem = layout_problem(record, expected)
        if problem:
            self._drop(server_round, node, problem)
            return None
        try:
            tensors = {k: array_view(a) for k, a in record.items()}  # views: no second copy
        except (ValueError, TypeError):  # bytes that are not the array stated
            self._drop(server_round, node, UNDECODABLE)
            return None
        if values and not all_finite(tensors):
            self._drop(server_round, node, "non-finite values")
            return None
        return tensors

    def bound_updates(
        self, server_round: int, current: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> list[ClientUpdate]:
        """Drop (and count) the replies whose update norm exceeds the bound
        (``UpdateNormBound``), at every round size; then weigh the rest by their bounded
        claims (``weigh_claims``): a claim is capped, never a reason to drop a reply, and
        no norm statistic sees a claim. Under central DP (``replies_alone``) no reply is
        dropped for its norm: the mechanism clips it to ``dp-clip``, and a bound drawn from
        the others' norms would make one client's reply decide another's fate."""
        if self.norm_bound.factor and updates and not self.replies_alone:
            updates = self._bound_norms(server_round, current, updates)
        return self.weigh_claims(server_round, updates)

    def weigh_claims(self, server_round: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates with their ``num-examples`` bounded (``ClaimBound.weigh``): a capped
        one is a copy whose metrics carry the bounded weight, so every aggregation and the
        round's metrics weigh by it; how many were capped is ``train_claims_capped``."""
        claims = {u.node_id: u.num_examples for u in updates}
        weights = self.claims.weigh(claims, self.num_train_of, relative=not self.replies_alone)
        out = []
        self.train_claims_capped = 0
        for u in updates:
            weight, reason = weights[u.node_id]
            if reason:
                self._capped(server_round, u.node_id, u.num_examples, weight, reason)
                self.train_claims_capped += 1
                u = replace(u, metrics={**u.metrics, NUM_EXAMPLES: weight})
            out.append(u)
        return out

    def _bound_norms(self, server_round, current, updates: list[ClientUpdate]):
        weights = self.pretraining(server_round) or self.reply_key == ARRAYS
        factor = self.step_factor(server_round)
        updates = self._bound_record(
            server_round, current, updates, None, self.norm_bound, weights, factor
        )
        if self.pretraining(server_round):
            return updates
        # the algorithm's other records (Scaffold's control deltas) meet a bound of their
        # own: vectors in gradient units, so S = ||theta|| / the client lr (a record the
        # server applies unbounded is one a single client can blow up)
        lr = float(self.schedule(server_round)["lr"])
        for key in self.extra_reply_keys:
            limit = self.extra_norm_bounds.setdefault(
                key, UpdateNormBound(self.norm_bound.factor, self.norm_bound.growth)
            )
            updates = self._bound_record(server_round, current, updates, key, limit, False, lr)
        return updates

    def _bound_record(
        self, server_round, current, updates, key, limit: UpdateNormBound, weights, factor
    ) -> list[ClientUpdate]:
        """The updates whose record ``key`` (None: the reply's update) is within ``limit``."""
        if key is None:
            norms = update_norms(current, updates, weights)
        else:
            scratch: dict[str, np.ndarray] = {}
            norms = np.array([update_norm({}, u.extra[key], False, scratch) for u in updates])
        privacy = getattr(self, "privacy", None)
        if privacy is not None and privacy.local:
            # local DP: an honest noised update is long (the noise's norm), never dropped, and
            # no longer than the allowance; the allowance is then the bound (max(K R, it)
            # let a Byzantine reply reach ~700 x it), and no statistic across replies is used
            size = sum(int(np.size(a)) for a in current.values())
            floats = [a.dtype for a in current.values() if np.issubdtype(a.dtype, np.floating)]
            eps = max((float(np.finfo(t).eps) for t in floats), default=0.0)
            sent = shared_norm(current) if weights and key is None else 0.0
            bound = privacy.reply_norm_allowance(size, eps, sent)
            name = "local DP's allowance"
        else:
            bound = limit.bound(norms, weights, provisional_scale(current, factor))
            name = "max-update-norm x reference"
        what = "" if key is None else f" of {key}"
        kept = []
        for u, size in zip(updates, norms):
            if size > bound:
                self._drop(
                    server_round,
                    u.node_id,
                    f"update norm{what} {size:.3g} > {name} = {bound:.3g}",
                )
            else:
                kept.append(u)
        return kept

    def step_factor(self, server_round: int) -> float:
        """What multiplies an update when the server applies it (``S = ||theta|| / this``):
        a server SGD's lr; under server Adam, whose step does not grow with the update, the
        client lr for gradients (the scale of a client's own step) and 1 for weights and
        deltas; 1 in pre-training (a plain mean)."""
        if self.pretraining(server_round):
            return 1.0
        if self.server_optimizer.name == "sgd":
            return float(self.server_optimizer.lr)
        if self.reply_key == GRADIENT:
            return float(self.schedule(server_round)["lr"])
        return 1.0

    # --- what a round's outcome means for the run ------------------------------------------
    def settle_round(self, server_round: int, applied: int) -> None:
        """After a training round: track the nodes whose replies keep being dropped for their
        values (``personal_reset_nodes``) and count the consecutive rounds that applied
        nothing (``count_round``)."""
        self.track_value_drops()
        self.count_round(server_round, applied)

    def track_value_drops(self) -> None:
        """Per node asked: one more consecutive round of value drops, or none."""
        for node in self._asked:
            if node in self._round_value_drops:
                self.value_drops[node] = self.value_drops.get(node, 0) + 1
            else:
                self.value_drops.pop(node, None)

    def count_round(self, server_round: int, applied: int) -> None:
        """Raise ``RunFailed`` after ``max_failed_rounds`` consecutive rounds that applied
        no reply, listing the last one's drop reasons."""
        self.failed_rounds = 0 if applied else self.failed_rounds + 1
        if self.max_failed_rounds and self.failed_rounds >= self.max_failed_rounds:
            dropped = self._log(server_round).dropped
            reasons = "; ".join(f"{n} x {r}" for r, n in sorted(dropped.items())) or "none"
            raise RunFailed(
                f"{self.failed_rounds} consecutive training rounds applied no reply (key "
                f"'max-failed-rounds' = {self.max_failed_rounds}); round {server_round}'s "
                f"drops: {reasons}"
            )

    def personal_reset_nodes(self) -> set[int]:
        """Nodes whose replies were dropped for their values in ``RESET_AFTER`` consecutive
        training rounds: their next training message carries ``personal-reset``."""
        return {n for n, k in self.value_drops.items() if k >= RESET_AFTER}
