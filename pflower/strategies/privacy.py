"""Differential privacy of the shared updates: user-level (client-level) DP on what leaves a
client, for every algorithm and every reply kind. Personal parameters never leave a client,
so they never meet the mechanism.

**What is privatized.** A client's *shared update* of the round, one vector over all the
arrays of its reply: returned weights -> ``sent - returned`` (the server's own sent
parameters; pre-training rounds: the whole model), a gradient or a delta -> itself, Scaffold's
``(delta, control delta)`` -> both together (one vector, one clip). Metrics (losses,
``num-examples``) and evaluation replies are not privatized (as in Flower's wrappers).

**Central DP** (``dp = "central"``; McMahan et al. 2018, DP-FedAvg; Flower's
``DifferentialPrivacyServerSideFixedClipping`` / ``...AdaptiveClipping``): a trusted server
clips each sampled client's update to norm ``C`` (Flower's ``clip_inputs_inplace``, the
FlatClip of Andrew et al.), sums them, divides by the planned sample size ``m`` (not by the
replies kept: a dropped reply counts as a zero update, so the divisor does not depend on the
data) and adds Gaussian noise of standard deviation ``z C / m`` to that mean (Flower's
``compute_stdv``)::

    u_i  = clip(update_i, C)                   for each sampled client i that replied
    mean = (1/m) sum_i u_i + N(0, (z C / m)^2 I)
    -> the algorithm's server step (its optimizer) on ``mean``

Every algorithm's mean is then uniform over the sampled clients (data-size weights would make
the sensitivity depend on the claims), and every decision before it reads one reply alone (no
update-norm reference, no claims' median: ``checks``), so one client moves the sum by at most
``C`` whatever it sends (``tests/test_dp_release.py``).

Adaptive clipping (``dp-adaptive-clip``; Andrew et al. 2021, "Differentially private
learning with adaptive clipping"): the share of clients whose
update was not clipped, ``b = (sum_i [||update_i|| <= C] + N(0, s^2)) / m``, moves the clip
geometrically toward the target quantile ``g``: ``C <- C exp(-eta (b - g))``; the updates' noise
multiplier is raised so that the two releases together are worth ``z`` (Flower's
``compute_adaptive_noise_params``, ``s = m / 20`` unless ``dp-clip-count-stddev``).

**Local DP** (``dp = "local"``; Flower's ``localdp_mod`` does this to weights): each client
clips its own update to ``C`` and adds ``N(0, (z C)^2 I)`` before it sends it
(``local_release``): the server, trusted or not, only ever sees noised updates, and whatever
it does with them, robust rules included, is post-processing.

**Accounting** (Google's ``dp-accounting``, after every released round). Neighbouring
federations differ in one client's data set (user-level DP); every round is a Gaussian event
whose sampling probability comes from the clients eligible when it was sampled (nodes join and
leave: a round that sampled ``m`` of the ``N_t`` online, trainable nodes is ``q_t = m / N_t``).

- central, ``dp-sampling = "fixed"`` (the default): ``m`` of the ``N_t`` clients without
  replacement, the *replace-one* relation: replacing one client's data moves the sum of
  clipped updates by up to ``2C``, so the event's multiplier (noise std over sensitivity) is
  ``z C / 2C = z / 2``; RDP with Wang, Balle & Kasiviswanathan's bound (AISTATS 2019, Thm.
  27). dp-accounting's PLD has no event for a fixed-size sample, and a Poisson event does not
  bound one (Lebeda et al. 2024: the two can differ many times over), so RDP alone is this
  run's guarantee; the Poisson accounting of the same rounds is reported beside it as a
  comparison (``poisson-rdp``, ``poisson-pld``), not as this run's guarantee.
- central, ``dp-sampling = "poisson"`` (DP-FedAvg, McMahan et al. 2018; what TensorFlow
  Federated and pfl-research account): each eligible client is sampled on its own coin with
  ``q = fraction-train``, the mean divides by the expected size ``q N_t`` (fixed: it must not
  depend on who was drawn), *add/remove* neighbours: sensitivity ``C``, multiplier ``z``;
  RDP and PLD (privacy loss distributions, Koskela et al. / Doroshenko et al.), the tighter
  of the two is the run's epsilon and calibrates ``dp-epsilon``.
- local: a client's report is a Gaussian mechanism of sensitivity ``2C`` and std ``z C``
  (multiplier ``z / 2``) each time it is sampled, without amplification (it knows it was
  sampled); the run's epsilon is that of the client sampled most often so far (RDP and PLD,
  the tighter).
- a sample anyone can reproduce (``Mechanism.start(..., amplified=False)``) amplifies
  nothing: each client's epsilon is that of the Gaussian mechanism composed over the rounds
  it was in (replace-one: multiplier z / 2; Poisson's add/remove: z), the run's that of the
  most sampled client, as for local DP; the plan (and ``dp-epsilon``'s calibration) assumes
  a client in every round.

``dp-epsilon`` with ``dp-noise = -1`` calibrates ``z`` so that the planned rounds spend exactly
that budget at ``dp-delta`` (bisection on the accountant: ``noise_for_epsilon``); with both
set, a run whose plan would exceed the budget is refused before its first round, and a round
that would exceed it (the population shrank) stops the run with Flower's
``PrivacyBudgetExhausted``. A round in which no reply was kept is released all the same (the
noised mean of no contribution) and accounted.

**Empirical check** (``dp-canaries = k``; Andrew et al., ICLR 2024, "One-shot empirical
privacy estimation for federated learning"): ``k`` canary clients, each a fixed random
direction, join the population and are sampled like a client; each time, their update of
norm ``C`` enters the sum before the noise. After the last round, the cosines of the final
model's movement with the canaries, fitted by a Gaussian, are compared with those of a
direction the model never saw (``N(0, 1/d)``); the epsilon of that pair of Gaussians is an
estimate of what the final model reveals (``dp-canary-epsilon``), to be read beside the
accountant's bound, which covers every intermediate model too.

**Why not Flower's wrappers and mods.** ``DifferentialPrivacyServerSide*Clipping`` wrap a
strategy's ``aggregate_train`` and clip each reply's single ``ArrayRecord`` of *weights*
against the sent ones; their accounting requires ``NO_AMPLIFICATION`` and
``FedAvg.aggregate_train``'s weighted mean. The client mods (``fixedclipping_mod``,
``localdp_mod``) likewise take the reply's one ``ArrayRecord`` minus the message's as the
update (``compute_clip_model_update``): right for weights, wrong for a gradient or a delta,
refused for Scaffold's two records. pflower's mean sits inside each algorithm's ``aggregate``
(before its server optimizer, after the reply checks), over gradients, deltas and weights, so
the mechanism is here and uses Flower's pieces underneath the wrappers: ``clip_inputs_inplace``,
``compute_stdv``, ``compute_adaptive_noise_params`` and ``PrivacyBudgetExhausted``; the
accountant is dp-accounting's own (Flower's ``RdpAccountant`` holds one population for the
whole run and has no PLD) (Flower's ``add_gaussian_noise_inplace`` draws from NumPy's global
generator, so the noise is drawn here from a generator of its own).

**Noise source.** OS entropy unless ``dp-noise-seed`` >= 0. A seeded noise is reproducible
and, for anyone who knows the seed, no noise at all: for tests and experiments only.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pflower.flower import dp as flower_dp
from pflower.flower.dp import clip_inputs_inplace, compute_adaptive_noise_params, compute_stdv

# A child of Flower's logger, so the records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")

if TYPE_CHECKING:
    from pflower.settings import RunSettings

NONE, CENTRAL, LOCAL = "none", "central", "local"
FIXED, POISSON = "fixed", "poisson"  # dp-sampling
RDP, PLD = "rdp", "pld"  # the accountants
#: PLD's discretization of the privacy loss (dp-accounting's default is 1e-4): its pessimistic
#: rounding keeps epsilon an upper bound at any interval; 1e-3 is 3-10x faster and moves the
#: sweep's epsilons by under 0.2 %
PLD_INTERVAL = 1e-3

#: honest local-DP replies are never dropped by the update-norm bound: ``||N(0, s^2 I_d)||``
#: exceeds ``s (sqrt(d) + t)`` with probability below ``exp(-t^2 / 2)`` (Gaussian
#: concentration of a 1-Lipschitz function), ``exp(-50)`` at this ``t``
NOISE_NORM_SLACK = 10.0


@dataclass(frozen=True)
class DPSettings:
    """The run's DP keys (``dp-*``), as the mechanism reads them."""

    mode: str = NONE
    clip: float = 1.0
    noise: float = -1.0
    epsilon: float = 0.0
    delta: float = 1e-5
    adaptive: bool = False
    quantile: float = 0.5
    clip_lr: float = 0.2
    count_stddev: float = 0.0
    seed: int = -1
    sampling: str = FIXED
    canaries: int = 0

    @classmethod
    def of(cls, cfg: RunSettings) -> DPSettings:
        return cls(
            mode=cfg.dp,
            clip=cfg.dp_clip,
            noise=cfg.dp_noise,
            epsilon=cfg.dp_epsilon,
            delta=cfg.dp_delta,
            adaptive=cfg.dp_adaptive_clip,
            quantile=cfg.dp_clip_quantile,
            clip_lr=cfg.dp_clip_lr,
            count_stddev=cfg.dp_clip_count_stddev,
            seed=cfg.dp_noise_seed,
            sampling=cfg.dp_sampling,
            canaries=cfg.dp_canaries,
        )

    @property
    def on(self) -> bool:
        return self.mode != NONE


def noise_rng(seed: int, *stream: int) -> np.random.Generator:
    """OS entropy (``seed`` < 0), or the seeded stream ``(seed, *stream)`` for tests."""
    return np.random.default_rng(None if seed < 0 else [seed, *stream])


def clipped(
    vector: Mapping[str, np.ndarray],
    clip: float,
    center: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], float]:
    """The update (``center - vector``, or ``vector``) in float64, clipped to norm ``clip``
    over all its arrays together (Flower's ``clip_inputs_inplace``), and its norm before."""
    if center is None:
        update = {k: np.array(v, dtype=np.float64) for k, v in vector.items()}
    else:
        update = {k: c.astype(np.float64) - vector[k] for k, c in center.items()}
    norm = math.sqrt(sum(float(np.vdot(a, a)) for a in update.values()))
    arrays = list(update.values())
    if norm > clip:  # scale min(1, C / norm): the unclipped stay bit for bit
        clip_inputs_inplace(arrays, clip)
    return dict(zip(update, arrays)), norm


def local_release(
    update: Mapping[str, np.ndarray], dp: DPSettings, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """A client's update as it leaves the client under local DP: clipped to ``C``, plus
    ``N(0, (z C)^2)`` in every coordinate (float64; the caller casts to the reply's dtype)."""
    out, _ = clipped(update, dp.clip)
    std = dp.noise * dp.clip
    if std > 0:
        for a in out.values():
            a += rng.normal(0.0, std, a.shape)
    return out


# --- accounting ----------------------------------------------------------------------------
#: a released round as the accountant composes it: (q, sample, population): a fixed-size
#: sample of ``sample`` of the ``population`` clients eligible when it was drawn (q = their
#: ratio), or a Poisson sample at rate q (sample = population = 0)
Release = tuple[float, int, int]


@contextmanager
def _quiet_absl():
    """dp-accounting's RDP logs a warning for each order whose series does not converge
    (the order is left out; the bound stays valid): dozens per call at small z."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _dp_accounting():
    try:
        import dp_accounting
    except ImportError as err:
        from pflower.settings import ConfigError

        raise ConfigError(
            f"key 'dp': the accountant needs Google's dp-accounting ({err}); "
            "pip install 'pflower[dp]'"
        ) from None
    return dp_accounting


def _event(noise: float, release: Release, sampling: str, amplified: bool):
    """One round as a dp-accounting event. Fixed-size, replace-one: replacing a client's data
    moves the sum of clipped updates by up to 2C, noise std z C: multiplier z / 2, sampled
    without replacement (Wang, Balle & Kasiviswanathan 2019). Poisson, add/remove: adding or
    removing a client moves the sum by up to C: multiplier z at rate q (McMahan et al. 2018).
    Not amplified (a sample anyone can reproduce): the Gaussian alone, every round."""
    events = _dp_accounting().dp_event
    q, sample, population = release
    gaussian = events.GaussianDpEvent(noise / 2 if sampling == FIXED else noise)
    if not amplified:
        return gaussian
    if sampling == FIXED:
        if sample >= population:
            return gaussian
        return events.SampledWithoutReplacementDpEvent(population, sample, gaussian)
    return gaussian if q >= 1 else events.PoissonSampledDpEvent(q, gaussian)


def supports(accountant: str, sampling: str, amplified: bool = True) -> bool:
    """Whether ``accountant`` gives a valid bound for that sampling: dp-accounting's PLD
    has no event for a sample without replacement, and its add/remove PLD (the two
    directions composed apart) is no bound under replace-one (Lebeda et al. 2024); RDP
    covers every case (Wang, Balle & Kasiviswanathan's bound for the fixed-size sample)."""
    return accountant == RDP or sampling == POISSON or not amplified


@functools.lru_cache(maxsize=4096)
def spent(
    noise: float,
    ledger: tuple[tuple[Release, int], ...],
    delta: float,
    sampling: str = FIXED,
    accountant: str = RDP,
    amplified: bool = True,
) -> float:
    """(epsilon at ``delta``) after the releases of ``ledger`` ((release, rounds) pairs) at
    noise multiplier ``noise`` (pflower's z: std z C on the sum), from a fresh dp-accounting
    accountant: identical releases compose in one call (``compose(event, count)``), so a round
    costs one evaluation per distinct release, not one per past round. Memoized: a run asks
    for each ledger when it checks the next round and again when it releases it."""
    if not any(rounds for _, rounds in ledger):
        return 0.0
    if noise == 0:  # clipping only
        return math.inf
    if not supports(accountant, sampling, amplified):
        raise ValueError(f"accountant {accountant!r} gives no bound for sampling {sampling!r}")
    if accountant == RDP:  # RDP composes by adding curves: one curve per distinct release
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        total = sum(
            rounds * _rdp_curve(noise, release, sampling, amplified)
            for release, rounds in ledger
            if rounds
        )
        return float(compute_epsilon(_rdp_orders(), total, delta)[0])
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    # a plain Gaussian at z / 2 has the PLD of replace-one at z under the add/remove form
    relation = _dp_accounting().NeighboringRelation.ADD_OR_REMOVE_ONE
    acc = PLDAccountant(relation, value_discretization_interval=PLD_INTERVAL)
    for release, rounds in ledger:
        if rounds:
            acc.compose(_event(noise, release, sampling, amplified), rounds)
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def _rdp_curve(noise: float, release: Release, sampling: str, amplified: bool) -> np.ndarray:
    """One round's RDP at dp-accounting's default orders (``_rdp_orders``): the
    sample-without-replacement bound costs about a second, so each distinct round is computed
    once per run, not once per past round."""
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    relation = _dp_accounting().NeighboringRelation
    acc = RdpAccountant(
        neighboring_relation=relation.REPLACE_ONE
        if sampling == FIXED
        else relation.ADD_OR_REMOVE_ONE
    )
    with _quiet_absl():
        acc.compose(_event(noise, release, sampling, amplified))
    return np.array(acc.rdp)


@functools.cache
def _rdp_orders() -> np.ndarray:
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    return np.array(RdpAccountant().orders)


def epsilons(
    noise: float,
    ledger: tuple[tuple[Release, int], ...],
    delta: float,
    sampling: str = FIXED,
    amplified: bool = True,
) -> dict[str, float]:
    """Epsilon under every accountant that bounds this sampling: ``rdp`` and, where it is a
    bound, ``pld``."""
    return {
        name: spent(noise, ledger, delta, sampling, name, amplified)
        for name in (RDP, PLD)
        if supports(name, sampling, amplified)
    }


def guarantee(
    noise: float,
    ledger: tuple[tuple[Release, int], ...],
    delta: float,
    sampling: str = FIXED,
    amplified: bool = True,
) -> float:
    """The run's epsilon: the tightest of the valid accountants (each is an upper bound on
    the same mechanism's privacy loss, so their minimum is one too)."""
    return min(epsilons(noise, ledger, delta, sampling, amplified).values())


def poisson_comparison(
    noise: float, ledger: tuple[tuple[Release, int], ...], delta: float
) -> dict[str, float]:
    """What a fixed-size run's rounds would have spent had each client been sampled on its
    own coin at the same rate q = m / N, add/remove neighbours (``dp-sampling = "poisson"``,
    DP-FedAvg's accounting): a comparison with what most deployments report, not this run's
    guarantee (Lebeda et al. 2024: the two can differ many times over)."""
    as_poisson: dict[Release, int] = {}
    for (q, _, _), rounds in ledger:
        as_poisson[(q, 0, 0)] = as_poisson.get((q, 0, 0), 0) + rounds
    return epsilons(noise, tuple(sorted(as_poisson.items())), delta, POISSON)


def plan(rounds: int, sample: int, population: int, sampling: str = FIXED, rate: float = 0.0):
    """The ledger of ``rounds`` identical releases: ``sample`` of ``population`` (fixed), or
    at rate ``rate`` (Poisson; ``sample / population`` if not given)."""
    if sampling == POISSON:
        release: Release = (rate or sample / population, 0, 0)
    else:
        release = (sample / population, sample, population)
    return ((release, rounds),)


def epsilon_of(
    noise: float,
    rounds: int,
    sample: int,
    population: int,
    delta: float,
    local: bool = False,
    sampling: str = FIXED,
    amplified: bool = True,
) -> float:
    """(epsilon at ``delta``) after ``rounds`` releases of noise multiplier ``noise``, ``sample``
    of ``population`` clients per round (Poisson: at rate ``sample / population``), by the
    tightest valid accountant; local: one client's ``rounds`` reports, no amplification."""
    if local:
        return guarantee(noise, plan(rounds, 1, 1), delta, FIXED, amplified=False)
    return guarantee(noise, plan(rounds, sample, population, sampling), delta, sampling, amplified)


def noise_for_epsilon(
    epsilon: float,
    rounds: int,
    sample: int,
    population: int,
    delta: float,
    local: bool = False,
    sampling: str = FIXED,
    amplified: bool = True,
) -> float:
    """The smallest noise multiplier ``z`` (to 0.1 %) whose ``rounds`` releases spend at most
    ``epsilon`` at ``delta`` (the tightest valid accountant): bisection on ``epsilon_of``,
    decreasing in ``z``."""

    def eps(z: float) -> float:
        return epsilon_of(z, rounds, sample, population, delta, local, sampling, amplified)

    low, high = 0.01, 1.0
    while eps(high) > epsilon:
        low, high = high, high * 2
        if high > 1e4:
            raise ValueError(f"no noise multiplier below 1e4 reaches epsilon {epsilon}")
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        if eps(mid) > epsilon:
            low = mid
        else:
            high = mid
    return high


def count_stddev(noise: float, sample: float, configured: float = 0.0) -> float:
    """Adaptive clipping's noise std on the count of unclipped updates: ``dp-clip-count-stddev``
    if set, else Flower's ``m / 20`` where it can be used, else ``z``. Flower's
    ``compute_adaptive_noise_params`` needs ``z < 2 s`` (it raises otherwise: at ``m / 20``
    for every ``z >= m / 10``, the sweep's z = 6.75 at m = 60) and multiplies the updates'
    noise by ``(1 - (z / 2s)^2)^(-1/2)``: over 2x from ``s < z / sqrt(3)``; ``s = z`` costs
    1.155x."""
    if configured or noise == 0:
        return configured  # z = 0: clipping only, the count as exact as the updates
    return max(sample / 20, noise)


# --- the empirical check -------------------------------------------------------------------
def gaussian_pair_delta(epsilon: float, p: tuple[float, float], q: tuple[float, float]) -> float:
    """``sup_S P(S) - e^epsilon Q(S)`` for the 1-D Gaussians ``P = N(p)``, ``Q = N(q)`` (mean,
    std): the set where ``log p/q > epsilon`` is where a quadratic is positive, whose mass under
    each Gaussian is a difference of normal CDFs (in logs: the tails are far below 1e-300)."""
    (m1, s1), (m0, s0) = p, q
    a = 1 / (2 * s0**2) - 1 / (2 * s1**2)
    b = m1 / s1**2 - m0 / s0**2
    c = m0**2 / (2 * s0**2) - m1**2 / (2 * s1**2) + math.log(s0 / s1) - epsilon
    # intervals of x where a x^2 + b x + c > 0
    if abs(a) < 1e-12 * max(abs(b), 1 / s0**2):
        if b == 0:
            intervals = [(-math.inf, math.inf)] if c > 0 else []
        else:
            root = -c / b
            intervals = [(root, math.inf)] if b > 0 else [(-math.inf, root)]
    else:
        disc = b * b - 4 * a * c
        if disc <= 0:
            intervals = [(-math.inf, math.inf)] if a > 0 else []
        else:
            r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a)))
            intervals = [(-math.inf, r1), (r2, math.inf)] if a > 0 else [(r1, r2)]
    if not intervals:
        return 0.0
    log_p, log_q = _log_mass(intervals, m1, s1), _log_mass(intervals, m0, s0)
    if log_p == -math.inf or epsilon + log_q >= log_p:
        return 0.0
    return math.exp(log_p) * -math.expm1(epsilon + log_q - log_p)


def _log_mass(intervals: Sequence[tuple[float, float]], mean: float, std: float) -> float:
    """log N(mean, std^2)(union of ``intervals``), from the nearer tail of each."""
    from scipy.special import log_ndtr, logsumexp, ndtr

    def log_diff(big: float, small: float) -> float:  # log(e^big - e^small), big >= small
        return -math.inf if big == -math.inf else big + math.log1p(-math.exp(small - big))

    logs = []
    for lo, hi in intervals:
        a, b = (lo - mean) / std, (hi - mean) / std
        if b <= 0:
            logs.append(log_diff(float(log_ndtr(b)), float(log_ndtr(a))))
        elif a >= 0:
            logs.append(log_diff(float(log_ndtr(-a)), float(log_ndtr(-b))))
        else:
            logs.append(math.log1p(-(float(ndtr(a)) + float(ndtr(-b)))))
    return float(logsumexp(logs))


def gaussian_pair_epsilon(p: tuple[float, float], q: tuple[float, float], delta: float) -> float:
    """The smallest epsilon at which the Gaussians ``N(p)`` and ``N(q)`` (mean, std) are
    (epsilon, delta)-indistinguishable, both ways (bisection, to 1e-4)."""

    def over(eps: float) -> bool:
        return max(gaussian_pair_delta(eps, p, q), gaussian_pair_delta(eps, q, p)) > delta

    if not over(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while over(high):
        low, high = high, high * 2
        if high > 1e6:
            return math.inf
    while high - low > 1e-4 * max(high, 1.0):
        mid = (low + high) / 2
        low, high = (mid, high) if over(mid) else (low, mid)
    return high


def canary_estimate(cosines: Sequence[float], dimension: int, delta: float) -> float:
    """Andrew et al. (ICLR 2024), one-shot: the final model's cosines with the inserted
    canaries, fitted by a Gaussian, against the cosine of a random direction it never saw,
    ``N(0, 1/d)`` (exactly its mean and variance on the sphere): the epsilon of that pair."""
    values = np.asarray(cosines, dtype=np.float64)
    fitted = (float(values.mean()), float(values.std(ddof=1)))
    return gaussian_pair_epsilon(fitted, (0.0, 1 / math.sqrt(dimension)), delta)


def canary_direction(seed: int, canary: int, shapes: Mapping[str, tuple[int, ...]]):
    """Canary ``canary``'s unit direction over the arrays ``shapes`` (in their order):
    isotropic, from its own stream of ``seed``, drawn again wherever it is needed (never all
    held at once)."""
    rng = np.random.default_rng([seed, 1 << 20, canary])
    flat = rng.standard_normal(sum(int(np.prod(s)) for s in shapes.values()))
    flat /= np.linalg.norm(flat)
    out, at = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = flat[at : at + size].reshape(shape)
        at += size
    return out


# --- the server's half ---------------------------------------------------------------------
@dataclass
class Mechanism:
    """The server's half: central DP's clipped, noised mean (``mean``), the adaptive clip,
    the accountant of either mode (``start``, ``check``, ``released``) and the canaries, for a
    strategy. Pickled whole into checkpoints: the ledger, the clip and the canaries' state
    resume with it."""

    dp: DPSettings
    clip: float = 0.0
    noise: float = -1.0  # z of the run (calibrated from dp-epsilon when dp-noise is -1)
    population: int = 0
    sample: int = 0
    rounds: int = 0
    participation: dict[int, int] = field(default_factory=dict)  # local: releases per node
    #: central: the released rounds by release (q, sample, population of that round)
    ledger: dict[Release, int] = field(default_factory=dict)
    epsilon: float = 0.0
    started: bool = False
    #: whether the accountant may use the sample's secrecy (False: a sample anyone holding
    #: its seed reproduces; every round is then the Gaussian mechanism alone)
    amplified: bool = True
    rate: float = 0.0  # Poisson: each eligible client's chance per round (fraction-train)
    count_std: float = 0.0  # adaptive clipping: the count's noise std, fixed at the start
    #: this round, as ``check`` saw it: its release and the mean's divisor
    current: Release | None = None
    divisor: float = 0.0
    canary_seed: int = 0
    canary_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    canary_start: dict[str, np.ndarray] = field(default_factory=dict)  # theta_0 (float64)
    canaries_now: list[int] = field(default_factory=list)
    canary_epsilon: float | None = None

    def __post_init__(self) -> None:
        self.clip = self.clip or self.dp.clip
        if self.noise < 0:
            self.noise = self.dp.noise

    def __setstate__(self, state: dict) -> None:
        """A checkpoint of an older pflower: its ledger counted rounds by sample size over
        the population fixed at the first round; the fields it lacks take their defaults."""
        fresh = Mechanism(state["dp"]).__dict__
        self.__dict__.update({**fresh, **state})
        if any(isinstance(k, int) for k in self.ledger):
            n = self.population
            self.ledger = {(m / n, m, n): c for m, c in self.ledger.items()}

    @property
    def local(self) -> bool:
        return self.dp.mode == LOCAL

    @property
    def sampling(self) -> str:
        return self.dp.sampling

    def start(
        self,
        population: int,
        sample: int,
        rounds: int,
        amplified: bool = True,
        rate: float = 0.0,
    ) -> None:
        """At the first training round (the population known): calibrate ``z`` from
        ``dp-epsilon`` if asked, refuse a plan that would exceed the budget, open the
        accountant. ``amplified`` False: the sample is reproducible by others (a seeded
        sample), so no round is amplified by it; ``rate``: Poisson's per-client chance."""
        PrivacyBudgetExhausted = flower_dp.budget_exhausted()  # noqa: N806
        flower_dp.helpers()  # a Flower without them: refused here, before anything is released
        self.population, self.sample, self.rounds = population, sample, rounds
        self.amplified, self.rate = amplified, rate
        per_round = f"{sample} of {population} clients each"
        args = (rounds, sample, population, self.dp.delta, self.local, self.sampling, amplified)
        if self.sampling == POISSON:  # q = rate exactly; the expected size for the rest
            self.sample = sample = max(1, round(rate * population))
            per_round = f"each of {population} clients with probability {rate:g}"
            args = (rounds, rate, 1, self.dp.delta, False, POISSON, amplified)
        budget = self.dp.epsilon or None
        if self.dp.noise < 0:
            self.noise = noise_for_epsilon(self.dp.epsilon, *args)
        planned = epsilon_of(self.noise, *args)
        if budget is not None and planned > budget * (1 + 1e-9):
            fits, over = 0, rounds  # bisection: epsilon grows with the rounds
            while over - fits > 1:
                mid = (fits + over) // 2
                eps = epsilon_of(self.noise, mid, *args[1:])
                fits, over = (mid, over) if eps <= budget else (fits, mid)
            raise PrivacyBudgetExhausted(
                f"keys 'dp-epsilon' = {self.dp.epsilon} / 'dp-noise' = {self.noise}: the "
                f"{rounds} training rounds ({per_round}) would spend "
                f"epsilon {planned:.3g} at delta {self.dp.delta}; that noise allows {fits} "
                "rounds: raise 'dp-noise', set it to -1 (calibrated from 'dp-epsilon') or run "
                "fewer rounds"
            )
        if self.dp.adaptive:  # the count's noise, fixed for the run (Flower's would follow m)
            self.count_std = count_stddev(self.noise, sample, self.dp.count_stddev)
            from pflower.settings import ConfigError, dp_adaptive_problem

            problem = dp_adaptive_problem(self.noise, self.count_std, sample)
            if problem:
                raise ConfigError(problem)
        if self.dp.canaries:
            self.canary_seed = int(noise_rng(self.dp.seed, 1 << 21).integers(1 << 62))
        self.started = True

    def sampled(
        self,
        nodes: Sequence[int],
        population: int,
        rounds: int,
        *,
        secret: bool,
        rate: float,
        shared: Mapping[str, np.ndarray],
    ) -> None:
        """Before a training round of ``nodes`` sampled from ``population`` eligible ones
        (they join and leave, so q is this round's): at the first, the accountant opened
        (``start``; a sample others can reproduce, not ``secret``, amplifies nothing) and a
        weak signal warned of; then the round's release noted (``check``) and the canaries
        drawn against the ``shared`` parameters sent (``observe``)."""
        if not self.started:
            self.start(population, len(nodes), rounds, amplified=secret, rate=rate)
            problem = self.signal_problem(sum(int(np.prod(a.shape)) for a in shared.values()))
            if problem:
                log.warning("dp: %s", problem)
        self.check(nodes, population)
        self.observe(shared)

    def _release(self, sampled: int, population: int) -> Release:
        if self.sampling == POISSON:
            return (self.rate, 0, 0)
        return (sampled / population, sampled, population)

    def check(self, sampled: Sequence[int], population: int | None = None) -> None:
        """Before a round whose ``sampled`` clients were drawn from ``population`` eligible
        ones: note the round's release (q from the live population) and the mean's divisor,
        draw the canaries that take part, and stop the run (Flower's
        ``PrivacyBudgetExhausted``) if releasing the round would exceed ``dp-epsilon``."""
        PrivacyBudgetExhausted = flower_dp.budget_exhausted()  # noqa: N806

        population = population or self.population
        self.current = self._release(len(sampled), population)
        if self.sampling == POISSON:  # a fixed divisor: the expected size, not the drawn one
            self.divisor = max(self.rate * population, 1e-12)
        else:
            self.divisor = float(len(sampled))
        if self.dp.canaries and not self.local:
            q = self.current[0]
            rng = noise_rng(self.dp.seed, 1 << 22, sum(self.ledger.values()))
            self.canaries_now = [j for j in range(self.dp.canaries) if rng.random() < q]
        if not self.dp.epsilon:
            return
        if self.per_client:
            most = max(self.participation.values(), default=0)
            after = max([most] + [self.participation.get(n, 0) + 1 for n in sampled])
            would = self._client_epsilon(after)
        elif self.noise == 0:
            would = math.inf
        else:
            ledger = dict(self.ledger)
            ledger[self.current] = ledger.get(self.current, 0) + 1
            would = self._guarantee(ledger)
        if would > self.dp.epsilon * (1 + 1e-9):
            raise PrivacyBudgetExhausted(
                f"key 'dp-epsilon' = {self.dp.epsilon}: the next training round would spend "
                f"epsilon {would:.3g} (spent: {self.epsilon:.3g} at delta {self.dp.delta}); the "
                "run stops here"
            )

    def released(
        self, nodes: Sequence[int], shared: Mapping[str, np.ndarray] | None = None
    ) -> float:
        """Compose a released round (``nodes``: the sampled clients; ``shared``: the shared
        parameters it released, which the canary estimate reads after the last planned
        round) and return the run's epsilon at ``dp-delta``."""
        if self.per_client:
            for n in nodes:
                self.participation[n] = self.participation.get(n, 0) + 1
            self.epsilon = self._client_epsilon(max(self.participation.values(), default=0))
            if self.local:
                return self.epsilon
        release = self.current or self._release(len(nodes), self.population)
        self.ledger[release] = self.ledger.get(release, 0) + 1
        self.current = None
        if not self.per_client:
            self.epsilon = self._guarantee(self.ledger)
        if self.canary_start and shared is not None and sum(self.ledger.values()) >= self.rounds:
            self.canary_epsilon = self.estimate(shared)
        return self.epsilon

    @property
    def per_client(self) -> bool:
        """Whether epsilon is each client's own (the most sampled one's): local DP, whose
        client knows it was sampled, and a sample anyone can reproduce (``amplified`` False),
        where a round costs a client something only if it was in it."""
        return self.local or not self.amplified

    def _client_epsilon(self, releases: int) -> float:
        """A client's epsilon after ``releases`` rounds it took part in, each the Gaussian
        mechanism alone (replace-one: z / 2; a Poisson run's add/remove: z)."""
        sampling = FIXED if self.local else self.sampling
        return guarantee(self.noise, plan(releases, 1, 1), self.dp.delta, sampling, False)

    def _key(self, ledger: Mapping[Release, int]) -> tuple[tuple[Release, int], ...]:
        return tuple(sorted(ledger.items()))

    def _guarantee(self, ledger: Mapping[Release, int]) -> float:
        return guarantee(
            self.noise, self._key(ledger), self.dp.delta, self.sampling, self.amplified
        )

    def accountants(self, compare: bool = True) -> dict[str, float]:
        """Epsilon so far under each accountant: this run's sampling (``rdp``, ``pld`` where
        it is a bound) and, for a fixed-size sample with ``compare``, the Poisson comparison
        (``poisson-rdp``, ``poisson-pld``)."""
        if self.per_client:
            most = max(self.participation.values(), default=0)
            sampling = FIXED if self.local else self.sampling
            return epsilons(self.noise, plan(most, 1, 1), self.dp.delta, sampling, False)
        if self.noise == 0 or not self.ledger:
            return {}
        key = self._key(self.ledger)
        out = epsilons(self.noise, key, self.dp.delta, self.sampling, self.amplified)
        if compare and self.sampling == FIXED and self.amplified:
            compared = poisson_comparison(self.noise, key, self.dp.delta)
            out.update({f"poisson-{name}": eps for name, eps in compared.items()})
        return out

    # --- the mechanism -----------------------------------------------------------------------
    def mean(
        self,
        vectors: list[Mapping[str, np.ndarray]],
        sampled: int,
        rng: np.random.Generator,
        center: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Central DP: ``(1/m) sum_i clip(update_i, C) + N(0, (z C / m)^2)`` over the replies
        kept, ``m = sampled`` (Poisson: the expected sample size, ``check``), the canaries
        of the round added to the sum; adapts ``C`` after the round if asked. A zero update
        (a reply that carries nothing, the all-dropped round's stand-in) adds nothing, to the
        sum or to the adaptive clip's count."""
        m = max(sampled, len(vectors)) if self.sampling == FIXED else self.divisor
        w = 1.0 / m
        out: dict[str, np.ndarray] | None = None
        below = 0.0  # sum of (b_i - 1/2), b_i = [||update_i|| <= C] (Andrew et al. 2021)
        for vector in vectors:
            update, norm = clipped(vector, self.clip, center)
            if out is None:
                out = {k: np.zeros_like(a) for k, a in update.items()}
            if norm == 0:
                continue
            below += (norm <= self.clip) - 0.5
            for k, a in update.items():
                out[k] += w * a
        if out is None:  # nothing kept, nothing to shape the mean by but the sent parameters
            if center is None:
                raise ValueError("central DP: a mean of no update needs the sent parameters")
            out = {k: np.zeros(np.shape(c)) for k, c in center.items()}
        if set(self.canary_shapes) <= set(out):
            for j in self.canaries_now:  # each one an update of norm C in its direction
                for k, a in canary_direction(self.canary_seed, j, self.canary_shapes).items():
                    out[k] += w * self.clip * a
        noise, count_std = self.noise, 0.0
        if self.dp.adaptive:
            count_std = self.count_std or count_stddev(self.noise, m, self.dp.count_stddev)
            count_std, noise = compute_adaptive_noise_params(self.noise, m, count_std)
        std = compute_stdv(noise, self.clip, m)
        if std > 0:
            for a in out.values():
                a += rng.normal(0.0, std, a.shape)
        if self.dp.adaptive:  # Andrew et al. 2021: geometric update toward the quantile
            share = (below + (rng.normal(0.0, count_std) if count_std else 0.0)) / m + 0.5
            self.clip *= math.exp(-self.dp.clip_lr * (share - self.dp.quantile))
        return out

    # --- canaries ----------------------------------------------------------------------------
    def observe(self, shared: Mapping[str, np.ndarray]) -> None:
        """The shared parameters a training round starts from: the first that the canaries
        see (after pre-training: the parameters they will be measured on) become theta_0."""
        if not self.dp.canaries or self.local:
            return
        shapes = {k: tuple(np.shape(a)) for k, a in shared.items()}
        if shapes != self.canary_shapes:  # the first round, or the end of pre-training
            self.canary_shapes = shapes
            self.canary_start = {k: np.array(a, dtype=np.float64) for k, a in shared.items()}

    def estimate(self, shared: Mapping[str, np.ndarray]) -> float | None:
        """The one-shot canary epsilon of the model ``shared`` (the final one): the cosines of
        ``theta_0 - theta_T`` (the direction the released means moved it) with each canary."""
        if set(shared) != set(self.canary_shapes):
            return None
        moved = {k: self.canary_start[k] - np.asarray(shared[k], np.float64) for k in shared}
        norm = math.sqrt(sum(float(np.vdot(a, a)) for a in moved.values()))
        if norm == 0:
            return None
        cosines = [
            sum(float(np.vdot(moved[k], c)) for k, c in direction.items()) / norm
            for direction in (
                canary_direction(self.canary_seed, j, self.canary_shapes)
                for j in range(self.dp.canaries)
            )
        ]
        size = sum(int(np.prod(s)) for s in self.canary_shapes.values())
        return canary_estimate(cosines, size, self.dp.delta)

    # --- reporting ---------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The round metrics: the run's epsilon so far (the tightest valid accountant), each
        accountant's (the Poisson comparison after the last planned round: it costs a PLD),
        whether the sample amplified it, the clip (adaptive: this round's
        next), the noise multiplier, and the canary estimate once there is one."""
        out = {"dp-epsilon": self.epsilon, "dp-clip": self.clip, "dp-noise": self.noise}
        last = sum(self.ledger.values()) >= self.rounds  # the comparison once, at the end
        out.update({f"dp-epsilon-{n}": eps for n, eps in self.accountants(last).items()})
        out["dp-amplified"] = float(self.amplified and not self.local)
        if self.canary_epsilon is not None:
            out["dp-canary-epsilon"] = self.canary_epsilon
        return out

    def signal_problem(self, size: int) -> str:
        """Why the shared model will not learn, if it will not: the noise's expected norm
        on the mean (central: z C sqrt(d) / m; local: z C sqrt(d / m)) far above the
        clipped signal's C. User-level DP needs many clients per round."""
        if self.noise == 0:
            return ""
        m = max(self.sample, 1)
        norm = self.noise * self.dp.clip * math.sqrt(size) / (math.sqrt(m) if self.local else m)
        if norm <= 10 * self.dp.clip:
            return ""
        return (
            f"noise multiplier {self.noise:.3g} on {m} clients per round: the noise on the mean "
            f"has norm ~{norm:.3g} over {size} shared values, against at most {self.dp.clip:g} "
            "of signal (dp-clip); the shared model will barely learn (or diverge). User-level "
            "DP needs many more clients per round (the noise shrinks as 1/m), fewer rounds, a "
            "larger dp-epsilon or fewer shared parameters"
        )

    def reply_norm_allowance(self, size: int, eps: float = 0.0, sent_norm: float = 0.0) -> float:
        """Local DP: the norm an honest noised update stays below (``NOISE_NORM_SLACK``),
        which the update-norm bound must let through; 0 otherwise. ``eps``: the machine
        epsilon of the reply's dtype, whose rounding the server sees on top (the client
        casts its float64 release: returned weights ``sent - noised``, error at most
        ``eps / 2 (||sent|| + ||noised||)``, ``sent_norm`` 0 for a vector); twice that is
        allowed. Without it, at ``dp-noise = 0`` every float32 reply clipped to exactly C
        came back a hair above C and was dropped."""
        if not self.local:
            return 0.0
        allowance = self.dp.clip * (1.0 + self.noise * (math.sqrt(size) + NOISE_NORM_SLACK))
        return allowance + eps * (sent_norm + allowance)
