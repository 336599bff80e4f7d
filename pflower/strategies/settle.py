"""The reply pipeline's last stage: what a training round's outcome means for the run.

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

from collections.abc import Iterable, Mapping

from pflower.strategies.rounds import Round

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
        self.failed_rounds = 0  # consecutive training rounds that applied no reply
        self.value_drops: dict[int, int] = {}  # node -> consecutive rounds of value drops

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
        if self.max_failed_rounds and self.failed_rounds >= self.max_failed_rounds:
            reasons = "; ".join(f"{n} x {r}" for r, n in sorted(dropped.items())) or "none"
            raise RunFailed(
                f"{self.failed_rounds} consecutive training rounds applied no reply (key "
                f"'max-failed-rounds' = {self.max_failed_rounds}); round {number}'s "
                f"drops: {reasons}"
            )

    def reset_nodes(self) -> set[int]:
        """Nodes whose replies were dropped for their values in ``RESET_AFTER`` consecutive
        training rounds: their next training message carries ``personal-reset``."""
        return {n for n, k in self.value_drops.items() if k >= RESET_AFTER}

    def restart(self) -> None:
        """A new run: no failed round, no value drop yet."""
        self.failed_rounds, self.value_drops = 0, {}
