"""The reply pipeline: the one way a reply goes through the server, in named stages.

::

    replies -> admit -> [stages inserted from outside] -> bound -> combine -> apply -> settle
               error,     (the experiment side's:         update    mean |      server   round
               handshake,  the omniscient attack's         size,    clipped     optimizer log,
               layout,     simulation)                     claims   mean |               failed
               finite,                                     [taken?  robust(f) |          rounds,
               metrics                                      rollback] central DP         resets

Each stage is a module with its guarantee in its docstring: ``admit``, ``bound``,
``combine`` (one class per mode), ``server_opt`` (apply: the server optimizer the algorithm
steps with) and ``settle`` (with ``settle.Rollback``, which judges a round before it is
combined: one whose replies show that the model was taken is not applied, and theta goes
back). A stage takes the round (``rounds.Round``) and the replies or updates as arguments
and writes what it finds into the round; stages may keep per-node state across rounds (the
bounds' references, the clip's norms, the settle stage's counts) and see the whole round.
The round loop (``server.PersonalizedStrategy``, ``AsyncFFGG``, and ``RobustFedAvg`` inside
Flower's own FedAvg) calls the pipeline; the algorithm's ``aggregate`` calls the combine
stage with its vectors and weights, and its server optimizer.

``build`` assembles a pipeline from the settings and is the one place that decides which
modes compose: differential privacy replaces every statistic across replies (central DP:
the clipped, noised mean, no update-norm reference, no claim median; a robust rule or the
default defence's clip is refused with it), a robust rule replaces the mean (with the
small-round clip beside it where the algorithm's default defence asks for it, and the
default defence's clip in the rounds it cannot take with its f), and without either the
default defence is adaptive clipping.

Stages inserted from outside (``ReplyPipeline.insert``) run between admission and the
bounds: the experiment side's simulation of an omniscient adversary replaces the replies its
nodes tagged by the vector such a client would send, which the bounds then judge as they
judge any reply. A tag no inserted stage took is dropped (``omniscient-attack tag without
attack-simulation``): a production server never honours it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

from flwr.app import Message

from pflower.settings import RunSettings, modes_problem
from pflower.strategies.admit import Admit
from pflower.strategies.aggregators import Aggregator
from pflower.strategies.bound import Bound
from pflower.strategies.combine import (
    AdaptiveClipping,
    CentralDP,
    ClippedMean,
    Combine,
    Mean,
    RobustRule,
    StepBound,
    adaptive_clipping,
    robust_aggregator,
)
from pflower.strategies.privacy import DPSettings, Mechanism
from pflower.strategies.rounds import Round
from pflower.strategies.settle import Rollback, Settle
from pflower.wire import OMNISCIENT_TAG, ClientUpdate

if TYPE_CHECKING:
    from collections.abc import Mapping

#: a stage inserted from outside: the round and its admitted updates -> the updates
Stage = Callable[[Round, list[ClientUpdate]], list[ClientUpdate]]

#: every run-level key at its default
RUN_DEFAULTS = RunSettings()


class ReplyPipeline:
    """The stages of one strategy (module docstring), built by ``build``.

    Parameters
    ----------
    admit : Admit
    bound : Bound
    combine : Combine
    settle : Settle
    privacy : Mechanism or None (default: None)
        The differential-privacy mechanism whose accountant counts the releases.
    rollback : Rollback or None (default: a new one)
        The judge of a round that shows the model was taken (``settle.Rollback``).
    """

    def __init__(
        self,
        admit: Admit,
        bound: Bound,
        combine: Combine,
        settle: Settle,
        privacy: Mechanism | None = None,
        rollback: Rollback | None = None,
    ) -> None:
        self.admit, self.bound, self.combine, self.settle = admit, bound, combine, settle
        self.privacy, self.rollback = privacy, rollback or Rollback()
        self.inserted: list[Stage] = []

    def insert(self, stage: Stage) -> None:
        """Insert ``stage`` between admission and the bounds (after those inserted before)."""
        self.inserted.append(stage)

    def updates(self, rnd: Round, replies: Iterable[Message]) -> list[ClientUpdate]:
        """A training round's replies through admission, the inserted stages and the bounds:
        the updates the combine stage gets (their nodes in ``rnd.nodes``)."""
        replies = self.admit.answers(rnd, replies)
        if self.privacy is not None and self.privacy.local:  # every report left its client
            self.privacy.released([rnd.sender(m) for m in replies if not m.has_error()])
        updates = self.admit.train(rnd, replies)
        for stage in self.inserted:
            updates = stage(rnd, updates)
        updates = self.bound(rnd, self.untagged(rnd, updates))
        rnd.nodes = [u.node_id for u in updates]
        return updates

    @staticmethod
    def untagged(rnd: Round, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates without an attack tag: a tag no inserted stage took is dropped (a
        production server never honours one)."""
        for u in updates:
            if OMNISCIENT_TAG in u.metrics:
                rnd.drop(u.node_id, "omniscient-attack tag without attack-simulation")
        return [u for u in updates if OMNISCIENT_TAG not in u.metrics]

    def evaluation(
        self, rnd: Round, replies: Iterable[Message], required: Iterable[str]
    ) -> list[dict]:
        """An evaluation round's replies through admission and the claim bound: each row's
        metrics, its ``num-examples`` a bounded weight."""
        rows = self.admit.evaluate(rnd, self.admit.answers(rnd, replies), required)
        return self.bound.weigh_evaluation(rnd, rows)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the stages, by the names checkpoints have always used:
        the bounds' references and first claims, the rule (a bucketing rule's generator), the
        clip (its rho and recent norms) and the DP mechanism (its ledger, adaptive clip)."""
        bound = self.bound
        return {
            "claimed_num_examples": bound.claims.claimed,
            "claimed_evaluate_examples": bound.eval_claims.claimed,
            "update_norm_reference": bound.norm.reference,
            "update_norm_first_scale": bound.norm.first_scale,
            "extra_norm_bounds": bound.extra,
            "robust": self.combine.rule,
            "clipping": self.combine.clip,
            "privacy": self.privacy,
            # the clip a robust rule falls back to, where it is not ``clipping``
            "robust_fallback": getattr(self.combine, "fallback", None),
            "last_good": self.rollback.last_good,  # the parameters a taken round goes back to
            "step_bound": self.combine.step,  # the history of applied steps
            # what the phases applied and whether theta moved (a run that did nothing fails)
            "settled": (dict(self.settle.phase_applied), self.settle.moved),
        }

    def load_state_dict(self, state: Mapping) -> dict:
        """Take the stages' part of a checkpoint's ``state`` (``state_dict``; an older
        checkpoint may lack some); returns the rest."""
        rest, bound = dict(state), self.bound
        parts = {
            "claimed_num_examples": (bound.claims, "claimed"),
            "claimed_evaluate_examples": (bound.eval_claims, "claimed"),
            "update_norm_reference": (bound.norm, "reference"),
            "update_norm_first_scale": (bound.norm, "first_scale"),
        }
        for name, (part, attribute) in parts.items():
            if name in rest:
                setattr(part, attribute, dict(rest.pop(name)))
        bound.extra = dict(rest.pop("extra_norm_bounds", bound.extra))
        self.attach(rest.pop("robust", None), rest.pop("clipping", None), rest.pop("privacy", None))
        self.rollback.last_good = rest.pop("last_good", self.rollback.last_good)
        step = rest.pop("step_bound", None)
        if step is not None and self.combine.step is not None:  # the history, this run's c
            self.combine.step.norms = dict(step.norms)
        settled = rest.pop("settled", None)
        if settled is not None:
            self.settle.phase_applied, self.settle.moved = dict(settled[0]), bool(settled[1])
        fallback = rest.pop("robust_fallback", None)
        if fallback is not None and hasattr(self.combine, "fallback"):
            clip = self.combine.clip
            self.combine.fallback = clip if clip is not None else fallback
        return rest

    def attach(
        self,
        robust: Aggregator | None = None,
        clipping: AdaptiveClipping | None = None,
        privacy: Mechanism | None = None,
    ) -> None:
        """Put restored state objects (a checkpoint's) where the stages use them."""
        if robust is not None and self.combine.rule is not None:
            self.combine.rule = robust
        if clipping is not None and self.combine.clip is not None:
            if getattr(self.combine, "fallback", None) is self.combine.clip:
                self.combine.fallback = clipping
            self.combine.clip = clipping
        if privacy is not None and self.privacy is not None:
            self.privacy = privacy
            if isinstance(self.combine, CentralDP):
                self.combine.mechanism = privacy
            if self.bound.local_dp is not None:
                self.bound.local_dp = privacy


def build(
    app: RunSettings,
    defaults: Mapping,
    *,
    seed: int,
    robust: Aggregator | None | Literal[False] = None,
    clipping: AdaptiveClipping | None | Literal[False] = None,
    privacy: DPSettings | None = None,
    byzantine: int = 0,
    max_update_norm: float = RUN_DEFAULTS.max_update_norm,
    update_norm_growth: float = RUN_DEFAULTS.update_norm_growth,
    max_num_examples: int = RUN_DEFAULTS.max_num_examples,
    max_failed_rounds: int = RUN_DEFAULTS.max_failed_rounds,
    step_bound: float | None = None,
) -> ReplyPipeline:
    """The pipeline of a strategy: the one place that decides which modes compose.

    ``app``: the run-level settings the strategy runs with where a parameter is ``None``
    (its class's ``defaults`` and default ``defence`` resolved; ``defaults`` alone: what it
    runs under DP, whose clip is the defence, so that a default defence's rule is not taken).
    ``robust`` / ``clipping``: ``None`` the app's, ``False`` none; ``privacy``: ``None`` the
    app's ``dp-*`` keys. Raises ``ValueError`` for central DP with a robust rule or the
    clip: the noise is calibrated to the mean's sensitivity, and their statistics across
    replies would decide one reply by the others."""
    privacy = privacy or DPSettings.of(app)
    given = robust
    if robust is None:  # the algorithm's rule (BR-FFGG's, FFGG's), drawing from this seed
        rules = RUN_DEFAULTS.resolved(defaults) if privacy.on else app
        robust = robust_aggregator(rules.model_copy(update={"seed": seed}))
    rule = robust or None
    if step_bound is None:  # the app's: FFGG's default defence's 2, not beside a rule given
        # by hand (as a rule the run config names keeps its own keys); under DP the mean has
        # neither rule nor clip, and so no bound
        own = given is not None
        step_bound = (RUN_DEFAULTS.resolved(defaults) if own else app).robust_step_bound
    if step_bound == "auto":  # settings not resolved (built by hand): the generic, off
        step_bound = 0.0
    mechanism = Mechanism(privacy) if privacy.on else None
    central = mechanism is not None and not mechanism.local
    if clipping is None:  # the app's: adaptive clipping unless a rule or DP replaces it;
        # beside the app's own rule, in the rounds too small for it (robust-small-rounds)
        beside = given is None and app.robust_small_rounds == "clip"
        clipping = adaptive_clipping(app) if (rule is None or beside) and not privacy.on else False
    clip = clipping or None
    problem = modes_problem(central, rule is not None, clip is not None)
    if problem:
        raise ValueError(f"privacy mode 'central' with a robust rule or clipping: {problem}")
    if central:
        combine: Combine = CentralDP(mechanism, byzantine)
    elif rule is not None:
        # where the rule cannot take a round with its f: the default defence, at its defaults
        fallback = clip or AdaptiveClipping(growth=update_norm_growth)
        combine = RobustRule(rule, byzantine, clip, fallback)
    elif clip is not None:
        combine = ClippedMean(clip, byzantine)
    else:
        combine = Mean(byzantine)
    if step_bound and (clip is not None or rule is not None) and not central:
        combine.step = StepBound(step_bound)
    bound = Bound(
        max_update_norm,
        update_norm_growth,
        max_num_examples,
        replies_alone=central,
        local_dp=mechanism if mechanism is not None and mechanism.local else None,
    )
    admit = Admit(by_norm=bool(bound.norm.factor))
    return ReplyPipeline(admit, bound, combine, Settle(max_failed_rounds), mechanism)
