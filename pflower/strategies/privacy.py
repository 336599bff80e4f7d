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
the sensitivity depend on the claims). Adaptive clipping (``dp-adaptive-clip``; Andrew et al.
2021, "Differentially private learning with adaptive clipping"): the share of clients whose
update was not clipped, ``b = (sum_i [||update_i|| <= C] + N(0, s^2)) / m``, moves the clip
geometrically toward the target quantile ``g``: ``C <- C exp(-eta (b - g))``; the updates' noise
multiplier is raised so that the two releases together are worth ``z`` (Flower's
``compute_adaptive_noise_params``, ``s = m / 20`` unless ``dp-clip-count-stddev``).

**Local DP** (``dp = "local"``; Flower's ``localdp_mod`` does this to weights): each client
clips its own update to ``C`` and adds ``N(0, (z C)^2 I)`` before it sends it
(``local_release``): the server, trusted or not, only ever sees noised updates, and whatever
it does with them, robust rules included, is post-processing.

**Accounting** (Flower's ``RdpAccountant``, Rényi DP through Google's ``dp-accounting``).
Neighbouring federations differ in one client's data set (user-level DP).

- central: pflower samples ``m`` of the ``N`` trainable clients without replacement, so each
  round is a ``SampledWithoutReplacement`` Gaussian event under the *replace-one* relation
  (Wang, Balle & Kasiviswanathan 2019, Thm. 27). Replacing one client moves the sum of
  clipped updates by up to ``2C``, so the event's noise multiplier (noise std over
  sensitivity) is ``z C / 2C = z / 2``.
- local: a client's report is a Gaussian mechanism of sensitivity ``2C`` and std ``z C``
  (multiplier ``z / 2``) each time it is sampled, without amplification (it knows it was
  sampled); the run's epsilon is that of the client sampled most often so far.

``dp-epsilon`` with ``dp-noise = -1`` calibrates ``z`` so that the planned rounds spend exactly
that budget at ``dp-delta`` (bisection on the accountant: ``noise_for_epsilon``); with both
set, a run whose plan would exceed the budget is refused before its first round, and a round
that would exceed it (the population changed) stops the run with Flower's
``PrivacyBudgetExhausted``.

**Why not Flower's wrappers and mods.** ``DifferentialPrivacyServerSide*Clipping`` wrap a
strategy's ``aggregate_train`` and clip each reply's single ``ArrayRecord`` of *weights*
against the sent ones; their accounting requires ``NO_AMPLIFICATION`` and
``FedAvg.aggregate_train``'s weighted mean. The client mods (``fixedclipping_mod``,
``localdp_mod``) likewise take the reply's one ``ArrayRecord`` minus the message's as the
update (``compute_clip_model_update``): right for weights, wrong for a gradient or a delta,
refused for Scaffold's two records. pflower's mean sits inside each algorithm's ``aggregate``
(before its server optimizer, after the reply checks), over gradients, deltas and weights, so
the mechanism is here and uses Flower's pieces underneath the wrappers: ``clip_inputs_inplace``,
``compute_stdv``, ``compute_adaptive_noise_params``, ``RdpAccountant`` and
``PrivacyBudgetExhausted`` (Flower's ``add_gaussian_noise_inplace`` draws from NumPy's global
generator, so the noise is drawn here from a generator of its own).

**Noise source.** OS entropy unless ``dp-noise-seed`` >= 0. A seeded noise is reproducible
and, for anyone who knows the seed, no noise at all: for tests and experiments only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from flwr.supercore.differential_privacy import (
    clip_inputs_inplace,
    compute_adaptive_noise_params,
    compute_stdv,
)

if TYPE_CHECKING:
    from pflower.config import Config

NONE, CENTRAL, LOCAL = "none", "central", "local"

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

    @classmethod
    def of(cls, cfg: Config) -> DPSettings:
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


def _accountant(delta: float, population: int, local: bool):
    try:
        import dp_accounting  # noqa: F401  (Flower's RdpAccountant imports it on first use)
        from flwr.serverapp import RdpAccountant
        from flwr.supercore.privacy_accounting import (
            NeighboringRelation,
            PrivacyConfig,
            SamplingMethod,
        )
    except ImportError as err:
        from pflower.settings import ConfigError

        raise ConfigError(
            f"key 'dp': the accountant needs Flower >= 1.35 with Google's dp-accounting "
            f"({err}); pip install 'pflower[dp]'"
        ) from None

    return RdpAccountant(
        PrivacyConfig(
            target_delta=delta,
            population_size=population,
            neighboring_relation=(
                NeighboringRelation.ADD_OR_REMOVE_ONE if local else NeighboringRelation.REPLACE_ONE
            ),
            sampling_method=(
                SamplingMethod.NO_AMPLIFICATION if local else SamplingMethod.WITHOUT_REPLACEMENT
            ),
        )
    )


def _event(noise: float, sample: int, population: int):
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    # the sum of clipped updates moves by up to 2C when one client's data is replaced
    return GaussianPrivacyEvent(
        noise_multiplier=noise / 2, sample_size=sample, population_size=population
    )


def epsilon_of(
    noise: float, rounds: int, sample: int, population: int, delta: float, local: bool = False
) -> float:
    """(epsilon at ``delta``) after ``rounds`` releases of noise multiplier ``noise`` (pflower's
    ``z``: std ``z C`` on the sum), ``sample`` of ``population`` clients per round; local: one
    client's reports, ``rounds`` of them."""
    return spent(noise, ((sample, rounds),), population, delta, local)


@functools.lru_cache(maxsize=4096)
def spent(
    noise: float,
    ledger: tuple[tuple[int, int], ...],
    population: int,
    delta: float,
    local: bool = False,
) -> float:
    """(epsilon at ``delta``) after the releases of ``ledger`` ((sample size, rounds) pairs)
    at noise multiplier ``noise``, from a fresh Flower ``RdpAccountant``: identical releases
    compose in one call (``compose(event, count)``: their RDP once, times the count), so a
    round costs one RDP evaluation, not one per past round. Memoized: a run asks for each
    (ledger) once when it checks the next round and once when it releases it."""
    if not any(rounds for _, rounds in ledger):
        return 0.0
    if noise == 0:  # clipping only
        return math.inf
    acc = _accountant(delta, 1 if local else population, local)
    for sample, rounds in ledger:
        if rounds:
            acc.compose(_event(noise, 1 if local else sample, 1 if local else population), rounds)
    return acc.get_epsilon(delta)


def noise_for_epsilon(
    epsilon: float, rounds: int, sample: int, population: int, delta: float, local: bool = False
) -> float:
    """The smallest noise multiplier ``z`` (to 0.1 %) whose ``rounds`` releases spend at most
    ``epsilon`` at ``delta``: bisection on ``epsilon_of``, decreasing in ``z``."""
    low, high = 0.01, 1.0
    while epsilon_of(high, rounds, sample, population, delta, local) > epsilon:
        low, high = high, high * 2
        if high > 1e4:
            raise ValueError(f"no noise multiplier below 1e4 reaches epsilon {epsilon}")
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        if epsilon_of(mid, rounds, sample, population, delta, local) > epsilon:
            low = mid
        else:
            high = mid
    return high


@dataclass
class Mechanism:
    """The server's half: central DP's clipped, noised mean (``mean``), the adaptive clip,
    and the accountant of either mode (``start``, ``released``), for a strategy."""

    dp: DPSettings
    clip: float = 0.0
    noise: float = -1.0  # z of the run (calibrated from dp-epsilon when dp-noise is -1)
    population: int = 0
    sample: int = 0
    rounds: int = 0
    participation: dict[int, int] = field(default_factory=dict)  # local: releases per node
    #: central: the released rounds by sample size (the accountant composes each group once)
    ledger: dict[int, int] = field(default_factory=dict)
    epsilon: float = 0.0
    started: bool = False

    def __post_init__(self) -> None:
        self.clip = self.clip or self.dp.clip
        if self.noise < 0:
            self.noise = self.dp.noise

    @property
    def local(self) -> bool:
        return self.dp.mode == LOCAL

    def start(self, population: int, sample: int, rounds: int) -> None:
        """At the first training round (the population known): calibrate ``z`` from
        ``dp-epsilon`` if asked, refuse a plan that would exceed the budget, open the
        accountant."""
        from flwr.serverapp.exception import PrivacyBudgetExhausted

        self.population, self.sample, self.rounds = population, sample, rounds
        budget = self.dp.epsilon or None
        if self.dp.noise < 0:
            self.noise = noise_for_epsilon(
                self.dp.epsilon, rounds, sample, population, self.dp.delta, self.local
            )
        planned = epsilon_of(self.noise, rounds, sample, population, self.dp.delta, self.local)
        if budget is not None and planned > budget * (1 + 1e-9):
            fits, over = 0, rounds  # bisection: epsilon grows with the rounds
            while over - fits > 1:
                mid = (fits + over) // 2
                eps = epsilon_of(self.noise, mid, sample, population, self.dp.delta, self.local)
                fits, over = (mid, over) if eps <= budget else (fits, mid)
            raise PrivacyBudgetExhausted(
                f"keys 'dp-epsilon' = {self.dp.epsilon} / 'dp-noise' = {self.noise}: the "
                f"{rounds} training rounds ({sample} of {population} clients each) would spend "
                f"epsilon {planned:.3g} at delta {self.dp.delta}; that noise allows {fits} "
                "rounds: raise 'dp-noise', set it to -1 (calibrated from 'dp-epsilon') or run "
                "fewer rounds"
            )
        self.started = True

    def check(self, sampled: Sequence[int]) -> None:
        """Before a round: refuse a sample the accounting does not cover, and stop the run
        (Flower's ``PrivacyBudgetExhausted``) if releasing the round would exceed
        ``dp-epsilon`` (possible only when the sample size changed since ``start``)."""
        from flwr.serverapp.exception import PrivacyBudgetExhausted

        if not self.local and len(sampled) > self.population:
            raise PrivacyBudgetExhausted(
                f"dp = 'central': {len(sampled)} clients sampled from an accounted population "
                f"of {self.population} (nodes joined after the first round); the accountant's "
                "sampling without replacement needs the population fixed: restart the run"
            )
        if not self.dp.epsilon:
            return
        if self.local:
            most = max(self.participation.values(), default=0)
            after = max([most] + [self.participation.get(n, 0) + 1 for n in sampled])
            would = epsilon_of(self.noise, after, 1, 1, self.dp.delta, local=True)
        elif self.noise == 0:
            would = math.inf
        else:
            ledger = dict(self.ledger)
            ledger[len(sampled)] = ledger.get(len(sampled), 0) + 1
            would = self._spent(ledger)
        if would > self.dp.epsilon * (1 + 1e-9):
            raise PrivacyBudgetExhausted(
                f"key 'dp-epsilon' = {self.dp.epsilon}: the next training round would spend "
                f"epsilon {would:.3g} (spent: {self.epsilon:.3g} at delta {self.dp.delta}); the "
                "run stops here"
            )

    def released(self, nodes: Sequence[int]) -> float:
        """Compose a released round (``nodes``: the sampled clients) and return the run's
        epsilon at ``dp-delta``."""
        if self.local:
            for n in nodes:
                self.participation[n] = self.participation.get(n, 0) + 1
            most = max(self.participation.values(), default=0)
            self.epsilon = epsilon_of(self.noise, most, 1, 1, self.dp.delta, local=True)
            return self.epsilon
        self.ledger[len(nodes)] = self.ledger.get(len(nodes), 0) + 1
        self.epsilon = self._spent(self.ledger)
        return self.epsilon

    def _spent(self, ledger: Mapping[int, int]) -> float:
        return spent(self.noise, tuple(sorted(ledger.items())), self.population, self.dp.delta)

    def mean(
        self,
        vectors: list[Mapping[str, np.ndarray]],
        sampled: int,
        rng: np.random.Generator,
        center: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Central DP: ``(1/m) sum_i clip(update_i, C) + N(0, (z C / m)^2)`` over the replies
        kept, ``m = sampled`` (module docstring); adapts ``C`` after the round if asked."""
        m = max(sampled, len(vectors))
        w = 1.0 / m
        out: dict[str, np.ndarray] | None = None
        unclipped = 0
        for vector in vectors:
            update, norm = clipped(vector, self.clip, center)
            unclipped += norm <= self.clip
            if out is None:
                out = {k: w * a for k, a in update.items()}
            else:
                for k, a in update.items():
                    out[k] += w * a
        noise, count_std = self.noise, 0.0
        if self.dp.adaptive:
            count_std, noise = compute_adaptive_noise_params(
                self.noise, m, self.dp.count_stddev or None
            )
        std = compute_stdv(noise, self.clip, m)
        if std > 0:
            for a in out.values():
                a += rng.normal(0.0, std, a.shape)
        if self.dp.adaptive:  # Andrew et al. 2021: geometric update toward the quantile
            share = (unclipped + rng.normal(0.0, count_std)) / m if count_std else unclipped / m
            self.clip *= math.exp(-self.dp.clip_lr * (share - self.dp.quantile))
        return out

    def metrics(self) -> dict[str, float]:
        """The round metrics: the run's epsilon so far, the clip (adaptive: this round's
        next) and the noise multiplier."""
        return {"dp-epsilon": self.epsilon, "dp-clip": self.clip, "dp-noise": self.noise}

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

    def reply_norm_allowance(self, size: int) -> float:
        """Local DP: the norm an honest noised update stays below (``NOISE_NORM_SLACK``),
        which the update-norm bound must let through; 0 otherwise."""
        if not self.local:
            return 0.0
        return self.dp.clip * (1.0 + self.noise * (math.sqrt(size) + NOISE_NORM_SLACK))
