"""The one evaluation protocol (DESIGN.md), the part a server decides: which rounds are
evaluated and on which clients. Each evaluated client reports its personalized model and the
global one on its own test split (the client halves, ``client.ClientHalf``); the server pools
the rows (``history.summarize_clients``: pooled accuracy, mean, p10/p50/p90, worst client,
clients hurt by personalization), each weighed by its bounded claim (``bound.ClaimBound``).
"""

from __future__ import annotations

from flwr.serverapp import Grid

from pflower.strategies.nodes import NodeSampler

#: ``final_fraction`` = 0: up to this many nodes the final round evaluates them all
FINAL_EVALUATE_ALL = 100


class EvaluationPlan:
    """Evaluate every ``every`` rounds and in the final one, on ``fraction`` of the nodes;
    the final round on every node up to ``FINAL_EVALUATE_ALL``, else a uniform sample of
    max(100, 10%) of them (or ``final_fraction`` of them).

    Parameters
    ----------
    fraction : float (default: 0.5)
        Share of the nodes sampled in an evaluation round before the last.
    every : int (default: 1)
        Evaluate every this many rounds (and always in the final round).
    final_fraction : float (default: 0.0)
        Share of the nodes the final round evaluates; 0: auto (above).
    """

    def __init__(self, fraction: float = 0.5, every: int = 1, final_fraction: float = 0.0):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction_evaluate = {fraction}: must be in (0, 1]")
        if every < 1:
            raise ValueError(f"evaluate_every = {every}: must be >= 1")
        if not 0 <= final_fraction <= 1:
            raise ValueError(
                f"final_evaluate_fraction = {final_fraction}: must be in [0, 1] (0: every node "
                "up to 100, else max(100, 10%) of them)"
            )
        self.fraction, self.every, self.final_fraction = fraction, every, final_fraction

    def due(self, server_round: int, num_rounds: int) -> bool:
        return server_round == num_rounds or server_round % self.every == 0

    def sample(
        self, nodes: NodeSampler, grid: Grid, server_round: int, num_rounds: int
    ) -> list[int]:
        """The nodes round ``server_round`` evaluates (drawn by ``nodes``)."""
        if server_round != num_rounds:
            return nodes.sample(grid, self.fraction)
        share = self.share_of_final(len(list(grid.get_node_ids())))
        return nodes.sample(grid, share, everyone=share == 1.0)

    def share_of_final(self, num_nodes: int) -> float:
        """The share of nodes the final round evaluates."""
        if self.final_fraction:
            return self.final_fraction
        if num_nodes <= FINAL_EVALUATE_ALL:
            return 1.0
        return max(FINAL_EVALUATE_ALL, round(0.1 * num_nodes)) / num_nodes
