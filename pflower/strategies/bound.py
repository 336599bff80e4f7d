"""The reply pipeline's second stage: bounds that keep a reply that passed admission from
steering the run -- the update-norm bound, the claim bound -- and the norms they are taken
over. ``Bound`` is the stage (``pflower.strategies.pipeline``); ``UpdateNormBound``,
``ClaimBound`` and ``RecentNormClip`` are usable on their own (asynchronous FFGG clips with
the last, adaptive clipping's rounds of 1 or 2 replies too).

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


**Under central DP every decision about a reply depends on that reply alone**: the
mechanism's sensitivity is one clipped reply, so nothing another client sent may decide
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

**Under local DP** an honest noised update is long (the noise's norm) and never longer than
local DP's allowance (``privacy.Mechanism.reply_norm_allowance``): the allowance alone is the
bound (``max(K R, allowance)`` let a Byzantine reply reach ~700 x the allowance), and no
statistic across replies is used.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from pflower.strategies.rounds import Round
from pflower.wire import NUM_EXAMPLES, ClientUpdate

if TYPE_CHECKING:
    from pflower.strategies.privacy import Mechanism

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
#: the provisional scale's floor per coordinate (a zero-initialised model has ||theta|| = 0)
SCALE_FLOOR = 0.1


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
    per 1.2 MB layer on a virtual machine)."""
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
    ``lr``, what multiplies an update when it is applied (``rounds.Round.step_factor``): an
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



class Bound:
    """The bound stage (module docstring): each update within the update-norm bound of its
    kind (at every round size), then its ``num-examples`` bounded into a weight.

    Parameters
    ----------
    max_update_norm : float (default: 1000.0)
        ``K`` of ``UpdateNormBound``; 0 turns the bound off.
    update_norm_growth : float (default: 2.0)
        ``g`` of ``UpdateNormBound``.
    max_num_examples : int (default: 0)
        The absolute cap of ``ClaimBound`` (0: ``CLAIM_FACTOR`` x the first claims' lower
        median).
    replies_alone : bool (default: False)
        Central DP: no update-norm reference, no claim median (module docstring).
    local_dp : Mechanism or None (default: None)
        Local DP's mechanism: its allowance is the bound of every reply.
    weigh : bool (default: True)
        Bound the claims into weights (``False``: a strategy whose rules are unweighted and
        whose metrics are Flower's, ``RobustFedAvg``).
    """

    def __init__(
        self,
        max_update_norm: float = 1000.0,
        update_norm_growth: float = 2.0,
        max_num_examples: int = 0,
        *,
        replies_alone: bool = False,
        local_dp: Mechanism | None = None,
        weigh: bool = True,
    ) -> None:
        self.norm = UpdateNormBound(max_update_norm, update_norm_growth)
        #: the bounds of further records (Scaffold's control deltas), by record
        self.extra: dict[str, UpdateNormBound] = {}
        self.claims = ClaimBound(max_num_examples)
        # evaluation replies weigh the pooled test metrics by their num-examples (the
        # client's test set): bounded as training claims are, in a pool of their own
        self.eval_claims = ClaimBound()
        self.replies_alone, self.local_dp, self.weigh = replies_alone, local_dp, weigh

    def __call__(self, rnd: Round, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """Drop (and count) the replies whose update norm exceeds the bound, at every round
        size; then weigh the rest by their bounded claims: a claim is capped, never a reason
        to drop a reply, and no norm statistic sees a claim."""
        if self.norm.factor and updates and not self.replies_alone:
            updates = self.norms(rnd, updates)
        return self.weigh_claims(rnd, updates) if self.weigh else updates

    def norms(self, rnd: Round, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates within the update-norm bound, and each further record within its own:
        vectors in gradient units, so ``S = ||theta|| / the client lr`` (a record the server
        applies unbounded is one a single client can blow up)."""
        updates = self._record(rnd, updates, None, self.norm, rnd.weights, rnd.step_factor)
        for key in rnd.extra_keys:
            limit = self.extra.setdefault(key, UpdateNormBound(self.norm.factor, self.norm.growth))
            updates = self._record(rnd, updates, key, limit, False, rnd.lr)
        return updates

    def _record(
        self, rnd: Round, updates, key, limit: UpdateNormBound, weights: bool, factor: float
    ) -> list[ClientUpdate]:
        """The updates whose record ``key`` (None: the reply's update) is within ``limit``."""
        current = rnd.current
        if key is None:
            norms = update_norms(current, updates, weights)
        else:
            scratch: dict[str, np.ndarray] = {}
            norms = np.array([update_norm({}, u.extra[key], False, scratch) for u in updates])
        if self.local_dp is not None:
            size = sum(int(np.size(a)) for a in current.values())
            floats = [a.dtype for a in current.values() if np.issubdtype(a.dtype, np.floating)]
            eps = max((float(np.finfo(t).eps) for t in floats), default=0.0)
            sent = shared_norm(current) if weights and key is None else 0.0
            bound = self.local_dp.reply_norm_allowance(size, eps, sent)
            name = "local DP's allowance"
        else:
            bound = limit.bound(norms, weights, provisional_scale(current, factor))
            name = "max-update-norm x reference"
        what = "" if key is None else f" of {key}"
        kept = []
        for u, size in zip(updates, norms):
            if size > bound:
                rnd.drop(u.node_id, f"update norm{what} {size:.3g} > {name} = {bound:.3g}")
            else:
                kept.append(u)
        return kept

    def weigh_claims(self, rnd: Round, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates with their ``num-examples`` bounded (``ClaimBound.weigh``): a capped
        one is a copy whose metrics carry the bounded weight, so every aggregation and the
        round's metrics weigh by it; how many were capped is ``rnd.claims_capped``."""
        claims = {u.node_id: u.num_examples for u in updates}
        weights = self.claims.weigh(claims, rnd.known_claims, relative=not self.replies_alone)
        out = []
        for u in updates:
            weight, reason = weights[u.node_id]
            if reason:
                rnd.capped(u.node_id, u.num_examples, weight, reason)
                u = replace(u, metrics={**u.metrics, NUM_EXAMPLES: weight})
            out.append(u)
        return out

    def weigh_evaluation(self, rnd: Round, rows: list[tuple[int, dict]]) -> list[dict]:
        """The evaluation rows' metrics, each with its ``num-examples`` (the node's test set,
        the weight of its metrics in the pooled figures) bounded as training claims are, in a
        pool of their own: at most the node's first evaluation claim and ``CLAIM_FACTOR`` x
        the lower median of the nodes' first evaluation claims. No row is dropped for its
        claim; the rows capped are counted (``rnd.claims_capped``)."""
        weights = self.eval_claims.weigh({node: m[NUM_EXAMPLES] for node, m in rows}, {})
        out = []
        for node, metrics in rows:
            weight, reason = weights[node]
            if reason:
                rnd.capped(node, metrics[NUM_EXAMPLES], weight, reason)
                metrics = {**metrics, NUM_EXAMPLES: weight}
            out.append(metrics)
        return out
