"""The reply pipeline's last stage: what a training round's outcome means for the run.

**Rounds that apply nothing.** ``max_failed_rounds`` consecutive training rounds in which no
reply was applied (all dropped, or skipped) stop the run with ``RunFailed``, listing the
round's drop reasons: a misconfigured federation fails loudly instead of saving an untrained
model as its result.

**A phase that applied nothing, a model that never moved.** A phase (the pre-training
rounds, the algorithm's rounds) none of whose rounds applied a reply fails the run at its last
round, however few rounds it has (fewer than ``max_failed_rounds`` never reached that count);
so does a run at its last training round whose shared parameters never moved (every reply
applied was a zero step: an ``lr`` of 0, or clients that cannot train), for an algorithm that
federates any. A run that did nothing never ends "successfully" (``max_failed_rounds = 0``
switches these checks off with the other).

**A taken model** (``Rollback``). A round whose replies show that a Byzantine majority took
theta (more replies dropped for their size than kept) is not applied: theta goes back to the last
good round's, and the round counts as one that applied nothing.

**Recovery.** A node whose replies were dropped for their values (non-finite, update norm) in
``RESET_AFTER`` consecutive training rounds gets ``personal-reset`` in its next training
message: it starts that round from the personal init, so stored state of its own that makes
its replies huge cannot keep it out of the federation for good.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from flwr.app import ArrayRecord

from pflower.strategies.rounds import Round

log = logging.getLogger("flwr.pflower")

#: consecutive value drops (non-finite, update norm) after which a node is sent personal-reset
RESET_AFTER = 2


class RunFailed(RuntimeError):
    """Consecutive training rounds applied no reply: the federation cannot train."""


class Settle:
    """The settle stage (module docstring).

    Parameters
    ----------
    max_failed_rounds : int (default: 3)
        Stop the run after this many consecutive training rounds that applied no reply;
        0: never.
    """

    def __init__(self, max_failed_rounds: int = 3) -> None:
        if max_failed_rounds < 0:
            raise ValueError(f"max_failed_rounds = {max_failed_rounds}: must be >= 0 (0: off)")
        self.max_failed_rounds = max_failed_rounds
        self._reasons = ""  # the last round's drop reasons
        self.failed_rounds = 0  # consecutive training rounds that applied no reply
        self.value_drops: dict[int, int] = {}  # node -> consecutive rounds of value drops
        self.phase_applied: dict[str, int] = {}  # phase -> replies applied in it
        self.moved = False  # whether a round changed the shared parameters

    def __call__(self, rnd: Round, applied: int) -> None:
        """After a training round: track the nodes whose replies keep being dropped for
        their values, then count the consecutive rounds that applied nothing."""
        self.track(rnd.asked, rnd.value_drops)
        self.count(rnd.number, applied, rnd.dropped)

    def track(self, asked: Iterable[int], dropped: set[int]) -> None:
        """Per node asked: one more consecutive round of value drops, or none."""
        for node in asked:
            if node in dropped:
                self.value_drops[node] = self.value_drops.get(node, 0) + 1
            else:
                self.value_drops.pop(node, None)

    def count(self, number: int, applied: int, dropped: Mapping[str, int]) -> None:
        """Raise ``RunFailed`` after ``max_failed_rounds`` consecutive rounds that applied
        no reply, listing the last one's drop reasons (``dropped``)."""
        self.failed_rounds = 0 if applied else self.failed_rounds + 1
        reasons = self._reasons = "; ".join(f"{n} x {r}" for r, n in sorted(dropped.items()))
        if self.max_failed_rounds and self.failed_rounds >= self.max_failed_rounds:
            reasons = reasons or "none"
            raise RunFailed(
                f"{self.failed_rounds} consecutive training rounds applied no reply (key "
                f"'max-failed-rounds' = {self.max_failed_rounds}); round {number}'s "
                f"drops: {reasons}"
            )

    def phase(self, name: str, rounds: range, number: int, applied: int) -> None:
        """After training round ``number`` of phase ``name`` (its ``rounds``): raise
        ``RunFailed`` at the phase's last round when none of its rounds applied a reply."""
        done = self.__dict__.setdefault("phase_applied", {})  # a checkpoint from before
        done[name] = done.get(name, 0) + applied
        if self.max_failed_rounds and number == rounds[-1] and not done[name]:
            raise RunFailed(
                f"the {name} phase (rounds {rounds[0]}-{rounds[-1]}) applied no reply in any "
                f"round; round {number}'s drops: {getattr(self, '_reasons', '') or 'none'}"
            )

    def moves(self, number: int, last: int, moved: bool) -> None:
        """After training round ``number`` (``moved``: it changed the shared parameters):
        raise ``RunFailed`` at the run's ``last`` training round if no round ever did."""
        self.moved = self.__dict__.get("moved", False) or moved
        if self.max_failed_rounds and number == last and not self.moved:
            raise RunFailed(
                f"the shared parameters never moved in {last} training rounds: every step "
                "applied was zero (is 'lr' 0, or can the clients not train?)"
            )

    def reset_nodes(self) -> set[int]:
        """Nodes whose replies were dropped for their values in ``RESET_AFTER`` consecutive
        training rounds: their next training message carries ``personal-reset``."""
        return {n for n, k in self.value_drops.items() if k >= RESET_AFTER}

    def restart(self) -> None:
        """A new run: no failed round, no value drop, nothing applied or moved yet."""
        self.failed_rounds, self.value_drops = 0, {}
        self.phase_applied, self.moved, self._reasons = {}, False, ""


class Rollback:
    """Undo a round whose replies show that the model was taken.

    A Byzantine majority of one round can move theta far enough that the honest clients'
    next updates exceed the update-norm bound while the attackers stay just under it: from
    then on only hostile replies would be applied (a *lockout*), and the run would report
    success. A training round in which more replies were dropped for their size (``update
    norm ...``) than were kept is *taken*: its kept replies are not
    applied and theta goes back to the parameters of the last round that was not taken (the
    last good theta), counted (``model-taken``, ``rolled-back-to``) and as a round that
    applied nothing, so that ``max-failed-rounds`` taken rounds in a row fail the run loudly.
    An honest round never drops a majority for its size (the bound is 1000 x the replies'
    lower median norm), so a clean run never rolls back. A tie (one of two) is not judged:
    the replies cannot say which side is hostile, and the bound has already dropped the
    larger one.

    Parameters
    ----------
    enabled : bool (default: True)
        False: no round is judged (the size drops are only counted).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.last_good: tuple[int, ArrayRecord] | None = None  # (round, parameters sent)

    def __call__(self, rnd: Round, kept: int, sent: ArrayRecord) -> ArrayRecord | None:
        """The parameters to go back to when ``rnd`` (``kept`` replies kept, ``sent`` the
        parameters it sent) was taken; None when it was not (then ``sent`` is the last good
        theta)."""
        size = sum(n for reason, n in rnd.dropped.items() if reason.startswith("update norm"))
        if not self.enabled or size <= kept:
            self.last_good = (rnd.number, sent)
            return None
        back = self.last_good
        if back is None or _layout(back[1]) != _layout(sent):  # none, or of another phase
            rnd.taken = (rnd.number, sent)
        else:
            rnd.taken = back
        log.warning(
            "round %d: %d replies dropped for their size, %d kept: the model was taken; its "
            "replies are not applied, the parameters are round %d's",
            rnd.number,
            size,
            kept,
            rnd.taken[0],
        )
        return rnd.taken[1]


def _layout(record: ArrayRecord) -> dict:
    return {k: (tuple(a.shape), a.dtype) for k, a in record.items()}
