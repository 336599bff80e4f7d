"""One exchange as the reply pipeline sees it (``pflower.strategies.pipeline``).

``Round`` holds what the round loop knows when a round's replies come back -- which message
went to which node, the parameters they carried, the phase, the sample's population, the
step sizes -- and what the stages find on the way: the drops by reason, the nodes whose
values were dropped, the claims capped, the replies clipped. The loop builds one per
exchange and hands it to every stage as an argument; a stage reads the round from it and
writes what it found into it, never into the strategy, so no stage depends on state another
stage left behind.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Message

from pflower.wire import ARRAYS, NUM_EXAMPLES, ClientUpdate

log = logging.getLogger("flwr.pflower")

#: drop reasons that are about a reply's values (what its own stored state may cause)
VALUE_REASONS = ("non-finite values", "update norm")


@dataclass(eq=False)
class Round:
    """One exchange (a training or an evaluation round, or one asynchronous update).

    Parameters
    ----------
    number : int
        The round (an asynchronous server: theta's new version).
    asked : set of int (default: empty)
        The nodes of the exchange's messages.
    sent : mapping of str to int, or None (default: None)
        Message id -> destination node of the exchange's messages (the ids a grid gave them
        when it pushed them); None for replies no message asked for (``RobustFedAvg``
        aggregating replies alone): then no reply is matched to a message and no node counts
        as silent.
    dropped : dict (default: a new one)
        Reason -> count: where the drops are counted (the round log's ``dropped``).
    names_nodes : bool (default: True)
        Whether log lines may name a reply's node (not under differential privacy: a line
        naming it would tell that it was sampled).
    reply_key : str (default: "arrays")
        The record a training reply must carry (``arrays`` in pre-training).
    weights : bool (default: True)
        Whether the replies are returned weights (their updates ``current - w``), or
        vectors (gradients, deltas).
    kind : str (default: "arrays")
        What the updates are, for the state a defence keeps by kind: ``"pretrain"`` or the
        algorithm's reply key.
    extra_keys : tuple of str (default: ())
        Further records a training reply carries (Scaffold's control delta).
    layout : mapping (default: empty)
        Name -> (shape, dtype) every record of a reply must have: the parameters sent.
    current : mapping of str to ndarray (default: empty)
        The parameters sent, as arrays: what ``arrays`` replies are updates from.
    population : int (default: 0)
        How many nodes the round's sample was drawn from.
    step_factor : float (default: 1.0)
        What multiplies an update when the server applies it (``bound.provisional_scale``).
    lr : float (default: 0.0)
        The round's client learning rate (the scale of records in gradient units).
    known_claims : mapping of int to float (default: empty)
        The nodes' start-up ``num-examples`` (their first claims).
    """

    number: int
    asked: set[int] = field(default_factory=set)
    sent: Mapping[str, int] | None = None
    dropped: dict[str, int] = field(default_factory=dict)
    names_nodes: bool = True
    reply_key: str = ARRAYS
    weights: bool = True
    kind: str = ARRAYS
    extra_keys: tuple[str, ...] = ()
    layout: Mapping[str, tuple] = field(default_factory=dict)
    current: Mapping[str, np.ndarray] = field(default_factory=dict)
    population: int = 0
    step_factor: float = 1.0
    lr: float = 0.0
    known_claims: Mapping[int, float] = field(default_factory=dict)
    # --- what the stages find ---------------------------------------------------------------
    #: replies that answer one of the exchange's messages (``admit.Admit.answers``)
    answered: int = 0
    #: the node of each update that reaches the combine stage, in order
    nodes: list[int] = field(default_factory=list)
    #: nodes whose reply was dropped for its values (non-finite, update norm)
    value_drops: set[int] = field(default_factory=set)
    #: replies whose ``num-examples`` claim was capped
    claims_capped: int = 0
    #: replies the default defence clipped, by kind of update
    clipped: dict[str, int] = field(default_factory=dict)
    #: replies the default defence counted under a shared vote, by kind of update
    shared: dict[str, int] = field(default_factory=dict)
    #: replies whose node the default defence distrusted (its standing), by kind of update
    distrusted: dict[str, int] = field(default_factory=dict)
    #: replies the default defence weighed 0 for their reach (``combine.FAR_OFF``), by kind
    far: dict[str, int] = field(default_factory=dict)
    #: the default defence's trust in each update's node (``AdaptiveClipping.trust``)
    trust: np.ndarray | None = None
    #: times a robust rule could not take the round with its f and the clip did
    fell_back: int = 0
    #: combined updates the step bound scaled down (``combine.StepBound``)
    step_bounded: int = 0
    #: the round was taken (``settle.Rollback``): the round and parameters theta went back to
    taken: tuple | None = None

    def sender(self, msg: Message) -> int:
        """The node a reply comes from. For a node that died Flower's SuperLink answers
        itself (an error reply whose source is the SuperLink, node id 1); the reply names the
        message it answers, and that message's destination is the node."""
        node = msg.metadata.src_node_id
        if node in self.asked or not self.sent:
            return node
        return self.sent.get(msg.metadata.reply_to_message_id, node)

    def drop(self, node: int, reason: str) -> None:
        """Count a dropped reply by its reason and log it."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if reason.startswith(VALUE_REASONS):
            self.value_drops.add(node)
        if self.names_nodes:
            log.warning("round %d: dropped the reply of node %d: %s", self.number, node, reason)
        else:
            log.warning("round %d: dropped a reply: %s", self.number, reason)

    def capped(self, node: int, claim: float, weight: float, reason: str) -> None:
        """Count and log a ``num-examples`` claim weighed below what it says."""
        self.claims_capped += 1
        if not self.names_nodes:
            log.warning("round %d: a num-examples claim was capped: %s", self.number, reason)
            return
        log.warning(
            "round %d: node %d's num-examples %g weighs %g: %s",
            self.number,
            node,
            claim,
            weight,
            reason,
        )

    def zero_update(self) -> ClientUpdate:
        """A reply that contributes nothing (the DP mechanism adds a zero update to neither
        the sum nor the adaptive clip's count): the sent weights back, or a zero gradient or
        delta (and zero further records, shaped like the parameters as theirs are)."""
        current = self.current
        tensors = {
            k: np.array(a) if self.weights else np.zeros(a.shape, a.dtype)
            for k, a in current.items()
        }
        extra = {
            key: {k: np.zeros(a.shape, a.dtype) for k, a in current.items()}
            for key in self.extra_keys
        }
        return ClientUpdate(-1, tensors, {NUM_EXAMPLES: 1.0}, extra, norm=0.0)
