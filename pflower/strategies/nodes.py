"""Which clients exist: the start-up handshake and the sample, as one component a strategy
holds (``NodeSampler``). It waits for the federation to settle, asks each node once for its
partition id, its node facts (``num-partitions``, the kind of its data, its model's
fingerprint) and (PFLEGO) its training-set size, refuses by name the nodes whose facts differ
from the run's or that claim another node's partition id, samples uniformly **without
replacement** from the run's sampling generator (secret unless ``sample-seed`` >= 0) over
the nodes in partition-id order (node ids are random per run), and keeps hold-out clients
out of training."""

from __future__ import annotations

import hashlib
import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pflower.settings import ConfigError
from pflower.task.fingerprint import OWN_LOADERS
from pflower.wire import (
    CONFIG,
    DATA_KIND,
    METRICS,
    MODEL_FINGERPRINT,
    NODE_FACTS,
    NUM_PARTITIONS,
    NUM_TRAIN,
    PARTITION_ID,
    QUERY,
)

# A child of Flower's logger, so our records go wherever Flower's go (console, `flwr log`).
log = logging.getLogger("flwr.pflower")


def _count(value) -> int | None:
    """``value`` as a count (a finite non-negative whole number, as a query reply's metric
    carries it), or None: a NaN, Inf, negative or fractional ``partition-id`` or
    ``num-train`` is no count (``int(nan)`` raised and stopped the server)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value < 0 or value != int(value):
        return None
    return int(value)


class SecretRandom(random.Random):
    """A ``random.Random`` whose bits are BLAKE2b keyed by a secret ``seed`` over a counter
    (a pseudo-random function in counter mode): what clients see of its draws (whether they
    were sampled) tells them nothing of the next ones, as a Mersenne Twister's outputs could
    in principle, and without the seed no one can compute them. Its state (seed, counter)
    pickles, so a checkpoint continues the same stream; ``SecretRandom(seed)`` replays a
    run's draws from the seed its ``results.json`` records (under ``dp``: its checkpoints)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)

    def seed(self, a=None, version: int = 2) -> None:  # noqa: D102 - random.Random's
        self._seed = int(a or 0)
        self._key = hashlib.blake2b(str(self._seed).encode(), digest_size=32).digest()
        self._counter = 0
        self.gauss_next = None

    def getrandbits(self, k: int) -> int:
        if k < 0:
            raise ValueError("number of bits must be non-negative")
        need = (k + 7) // 8
        out = b""
        while len(out) < need:
            block = self._counter.to_bytes(16, "little")
            out += hashlib.blake2b(block, key=self._key, digest_size=64).digest()
            self._counter += 1
        return int.from_bytes(out[:need], "little") >> (8 * need - k)

    def random(self) -> float:
        return self.getrandbits(53) * 2.0**-53

    def getstate(self) -> tuple:
        return (self._seed, self._counter, self.gauss_next)

    def setstate(self, state: tuple) -> None:
        seed, counter, gauss_next = state
        self.seed(seed)
        self._counter, self.gauss_next = counter, gauss_next


def sample_stream(sample_seed: int) -> tuple[random.Random, dict]:
    """The generator a run samples clients from, and what ``results.json`` records of it
    (``sampling``): ``sample_seed`` = -1, a ``SecretRandom`` on 128 bits of OS entropy,
    drawn now and never sent; >= 0, ``random.Random(sample_seed)``, the reproducible
    sample (the stream every run drew from ``seed`` before ``sample-seed`` existed)."""
    if isinstance(sample_seed, bool) or not isinstance(sample_seed, int):
        raise ValueError(f"sample_seed = {sample_seed!r}: must be an int (-1: secret)")
    if sample_seed < 0:
        seed = secrets.randbits(128)
        return SecretRandom(seed), {"seed": seed, "secret": True, "generator": "SecretRandom"}
    stream = {"seed": sample_seed, "secret": False, "generator": "random.Random"}
    return random.Random(sample_seed), stream


#: how much of a node's own text (its facts) a log line or ``results.json`` keeps
FACT_CHARS = 80


def _fact(value) -> str | None:
    """A node's reported fact as a short string (None if absent)."""
    return None if value is None else str(value)[:FACT_CHARS]


def _plurality(values: Iterable, prefer=None):
    """The value most nodes report (None if none does); a tie goes to ``prefer`` when it is
    among the tied, else to the smallest: a minority never sets it."""
    counts = Counter(v for v in values if v is not None)
    if not counts:
        return None
    top = max(counts.values())
    tied = sorted(v for v, c in counts.items() if c == top)
    return prefer if prefer in tied else tied[0]


class NodeSampler:
    """Which nodes exist, which partition each holds, which are refused, and who is sampled
    each round.

    **The handshake at start-up** (``learn_partitions``; a node that joins later is asked
    before it is first sampled). Each node reports its ``partition-id`` and ``num-partitions``
    (node config), the kind of its data (``task.fingerprint.data_kind``) and its model's
    fingerprint (``task.fingerprint.model_fingerprint``). A node is refused, by name, logged
    with both sides and listed in ``refusals`` (``results.json``: ``refused-nodes``), and
    never sampled when:

    - its model fingerprint or data kind differs from the server's own (``expected_facts``:
      the app sets both from the run's model and data set; a strategy built by hand, its
      ``model_fingerprint``), or, where the server has none, from the value most nodes report;
      with an expectation of the server's, a node that reports none is refused too (a node
      whose data are its own loaders, ``PersonalizedClient``'s, meets any data kind);
    - its ``num-partitions`` differs from the federation's: the value most nodes report (a tie
      goes to the number of nodes connected, as Flower's simulation sets it); or its
      partition id is outside ``0..num-partitions - 1``;
    - another connected node (not refused for its facts) claims the same partition id: both
      are refused while both are connected. The server cannot tell which claim is true, and
      refusing only the later one would give the partition to whichever answers first, which
      a liar controls; so a liar can exclude one honest node at the price of its own place,
      never take it.

    A node that does not answer (no reply, an error) is not refused: it is sampled after the
    others, unchecked, as before the handshake (its messages still carry the settings
    handshake). If every node that answered is refused, the run fails at start
    (``ConfigError``), naming them.

    **Sampling** draws from ``rng`` (``sample_stream``: secret unless ``sample-seed`` >= 0)
    over the eligible nodes in partition-id order. With a secret generator the order gives no
    node an advantage: no one can compute which positions a round will draw.

    Parameters
    ----------
    sample_seed : int (default: -1)
        -1: a secret seed from OS entropy (``sample_stream``); >= 0: a reproducible sample.
    model_fingerprint : str (default: "")
        The model every node must run ("": none of the server's own until it sets
        ``expected_facts``; the nodes' plurality then).
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before sampling.
    holdout_fraction : float (default: 0.0)
        Share of the clients (the highest partition ids) never sampled for training.
    poisson : bool (default: False)
        Central DP's Poisson sampling (``dp-sampling = "poisson"``): a coin per eligible node.
    private : bool (default: False)
        The run has differential privacy (the log says how the sample is accounted).
    """

    def __init__(
        self,
        sample_seed: int = -1,
        model_fingerprint: str = "",
        *,
        min_available_nodes: int = 1,
        holdout_fraction: float = 0.0,
        poisson: bool = False,
        private: bool = False,
    ) -> None:
        if not 0 <= holdout_fraction < 1:
            raise ValueError(f"holdout_fraction = {holdout_fraction}: must be in [0, 1)")
        self.rng, self.sampling = sample_stream(sample_seed)
        self.min_available_nodes, self.holdout_fraction = min_available_nodes, holdout_fraction
        self.poisson, self.private = poisson, private
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        self.num_train_of: dict[int, int] = {}  # node id -> training examples (if queried)
        self.query_num_train = False  # ask every node for its num-train at start-up too
        self.sampled_from = 0  # how many nodes the last training sample was drawn from
        #: facts every node must report as the server has them (data kind, model)
        self.expected_facts: dict[str, str] = (
            {MODEL_FINGERPRINT: model_fingerprint} if model_fingerprint else {}
        )
        self.facts_of: dict[int, dict] = {}  # node id -> its reported facts
        self.fact_refusals: dict[int, str] = {}  # node id -> why its facts are refused
        self.duplicates: dict[int, str] = {}  # node id -> the partition id it shares
        #: every refusal once, for results.json: node, partition id, reason
        self.refusals: list[dict] = []
        self._federation: dict = {}  # the facts the start-up answers settled on
        self._asked_nodes: set[int] = set()  # nodes the query went to (answered or not)
        self._query_timeout: float | None = None

    #: what a checkpoint keeps of the sampler (``state_dict``), by its names there
    STATE = ("rng", "sampling", "refusals")

    def state_dict(self) -> dict:
        """The generator (and its seed: secret by default, a checkpoint is the server's own)
        and the refusals so far: what a resumed run needs to sample as the run would have."""
        return {name: getattr(self, name) for name in self.STATE}

    def load_state_dict(self, state: dict) -> dict:
        """Take this sampler's part of a checkpoint's ``state``; returns the rest."""
        rest = dict(state)
        for name in self.STATE:
            if name in rest:
                setattr(self, name, rest.pop(name))
        return rest

    def sample_line(self) -> str:
        """How clients are sampled, for the log (never the secret seed)."""
        if self.sampling["secret"] and self.private:
            return "secret (a seed from OS entropy; dp: results.json withholds it)"
        if self.sampling["secret"]:
            return "secret (a seed from OS entropy; results.json records it)"
        line = f"reproducible (sample-seed {self.sampling['seed']}: every client can predict it"
        if self.private:
            line += "; dp: accounted without amplification"
        return line + ")"

    @property
    def refused(self) -> dict[int, str]:
        """The nodes never sampled now, with the reason."""
        return {**self.fact_refusals, **self.duplicates}

    def wait_for_nodes(self, grid: Grid, timeout: float, settle: float = 1.0) -> list[int]:
        """The connected nodes once at least ``min_available_nodes`` are and the set has not
        changed for ``settle`` seconds (or ``timeout`` has passed)."""
        deadline = time.monotonic() + timeout
        nodes, since = sorted(grid.get_node_ids()), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = sorted(grid.get_node_ids())
            if now != nodes:
                nodes, since = now, time.monotonic()
            elif len(nodes) >= self.min_available_nodes and time.monotonic() - since >= settle:
                break
        return nodes

    def learn_partitions(self, grid: Grid, timeout: float = 60.0) -> None:
        """The start-up query, once: ask every node for its ``partition-id`` and node facts
        (with ``query_num_train`` also its number of training examples: PFLEGO's alpha),
        settle the federation's facts and refuse the nodes that differ (class docstring).

        Node ids are random in each run; ordering nodes by partition id makes a seeded
        sample the same clients in every run. A node that does not answer is ordered after
        the others by its node id. Waits first until the set of connected nodes has been
        stable for ``settle`` seconds (nodes of a simulation or a federation register over a
        moment; asking too early would leave some unordered).
        """
        nodes = self.wait_for_nodes(grid, timeout)
        self._query_timeout = timeout
        answered = self._ask(grid, nodes, timeout)
        self._federation = self._settle(answered, len(nodes))
        for node in answered:
            self._check_facts(node)
        self._check_duplicates(nodes)
        if answered and all(n in self.refused for n in answered):
            raise ConfigError(
                "start-up handshake: every node that answered was refused: "
                + "; ".join(f"node {n}: {r}" for n, r in sorted(self.refused.items())[:5])
            )

    def _ask(self, grid: Grid, nodes: Sequence[int], timeout: float | None) -> list[int]:
        """Send the start-up query to ``nodes``; keep each answer's partition id, facts and
        (PFLEGO) num-train; return the nodes that answered."""
        self._asked_nodes.update(nodes)
        questions = [PARTITION_ID, NODE_FACTS] + ([NUM_TRAIN] if self.query_num_train else [])
        content = RecordDict({CONFIG: ConfigRecord({QUERY: ",".join(questions)})})
        messages = [
            Message(content=content, message_type=MessageType.QUERY, dst_node_id=n) for n in nodes
        ]
        sizes: dict[int, int] = {}
        asked, answered = set(nodes), {}  # (a dict: the answers in their order)
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error() or METRICS not in reply.content:
                continue
            node = reply.metadata.src_node_id
            if node not in asked or node in answered:  # not asked, or a second answer
                continue
            answered[node] = True
            metrics = reply.content[METRICS]
            pid = _count(metrics.get(PARTITION_ID))
            if pid is not None:
                self.partition_of[node] = pid
            else:
                log.warning("node %d: no usable partition-id; it is sampled after the rest", node)
            size = _count(metrics.get(NUM_TRAIN))
            if size:
                sizes[node] = size
            facts = reply.content.config_records.get(NODE_FACTS)
            self.facts_of[node] = {
                NUM_PARTITIONS: _count(metrics.get(NUM_PARTITIONS)),
                **{k: _fact((facts or {}).get(k)) for k in (DATA_KIND, MODEL_FINGERPRINT)},
            }
        # a start-up claim is its node's first claim: it weighs every round (PFLEGO's
        # sum_j N_j) as the claim bound weighs it, never above 10 x the lower median of the
        # nodes' first claims (``checks.ClaimBound``), whatever it says
        self.num_train_of.update(sizes)
        return list(answered)

    def _settle(self, answered: Sequence[int], connected: int) -> dict:
        """The facts every node must share: the server's own (``expected_facts``), else the
        value most of the start-up answers report; ``num-partitions`` always by the answers
        (a tie: the number of nodes connected)."""
        settled: dict = {}
        for key in (DATA_KIND, MODEL_FINGERPRINT):
            if key in self.expected_facts:
                settled[key] = (self.expected_facts[key], "the server's")
            else:
                value = _plurality(self.facts_of[n][key] for n in answered)
                if value is not None:
                    settled[key] = (value, "most nodes'")
        partitions = _plurality((self.facts_of[n][NUM_PARTITIONS] for n in answered), connected)
        if partitions is not None:
            settled[NUM_PARTITIONS] = (partitions, "the federation's")
        return settled

    def _check_facts(self, node: int) -> None:
        """Refuse ``node`` if a fact it reported differs from the federation's."""
        facts, reason = self.facts_of[node], ""
        for key, (expected, whose) in self._federation.items():
            value = facts[key]
            if value is None and key not in self.expected_facts:
                continue  # a fact this node does not report, which only the nodes settled
            if key == DATA_KIND and value == OWN_LOADERS:
                continue  # a user's own loaders (PersonalizedClient): nothing to compare
            if value != expected:
                said = "none" if value is None else repr(value)
                reason = f"{key} {said} ({whose}: {expected!r})"
                break
        pid, partitions = self.partition_of.get(node), self._federation.get(NUM_PARTITIONS)
        if not reason and pid is not None and partitions and pid >= partitions[0]:
            reason = f"partition-id {pid} outside 0..{partitions[0] - 1} (num-partitions)"
        if reason:
            self.fact_refusals[node] = reason
            self._record(node, reason)

    def _check_duplicates(self, online: Iterable[int]) -> None:
        """Refuse every connected node whose partition id another one (not refused for its
        facts) claims too, for as long as both are connected."""
        claims: dict[int, list[int]] = {}
        for node in online:
            pid = self.partition_of.get(node)
            if pid is not None and node not in self.fact_refusals:
                claims.setdefault(pid, []).append(node)
        self.duplicates = {}
        for pid, group in sorted(claims.items()):
            if len(group) > 1:
                names = ", ".join(str(n) for n in sorted(group))
                for node in group:
                    self.duplicates[node] = (
                        f"partition-id {pid} claimed by {len(group)} nodes ({names}): "
                        "the server cannot tell which holds it"
                    )
                    self._record(node, self.duplicates[node])

    def _record(self, node: int, reason: str) -> None:
        """Log and list a refusal once."""
        if any(r["node"] == node and r["reason"] == reason for r in self.refusals):
            return
        log.warning("node %d refused at the handshake, never sampled: %s", node, reason)
        self.refusals.append(
            {"node": node, "partition-id": self.partition_of.get(node), "reason": reason}
        )

    def _admit(self, grid: Grid, online: Sequence[int]) -> None:
        """Ask the nodes that joined after the start-up query (once), then recheck the
        partition-id claims of the nodes connected now."""
        if self._query_timeout is None:  # no start-up query ran (a sampler built by hand)
            return
        new = [n for n in online if n not in self._asked_nodes]
        if new:
            for node in self._ask(grid, new, self._query_timeout):
                self._check_facts(node)
        self._check_duplicates(online)

    def in_order(self, replies: Iterable[Message]) -> list[Message]:
        """Replies in partition-id order (the order the nodes were sampled in)."""
        return sorted(replies, key=lambda m: self._rank(m.metadata.src_node_id))

    def _rank(self, node: int) -> tuple[int, int]:
        return (self.partition_of.get(node, 1 << 62), node)

    def ordered(self, nodes: Iterable[int]) -> list[int]:
        """The nodes that may be sampled (none refused at the handshake), in partition-id
        order (a node of no known partition after the rest, by node id)."""
        refused = self.refused
        return sorted((n for n in nodes if n not in refused), key=self._rank)

    def sample(
        self, grid: Grid, fraction: float, everyone: bool = False, train: bool = False
    ) -> list[int]:
        """Uniform sample without replacement of ``max(1, round(fraction * N))`` of the N
        eligible nodes, drawn from ``rng`` over them in partition-id order (see
        ``learn_partitions``); [] when no node is eligible."""
        online = list(grid.get_node_ids())
        while len(online) < self.min_available_nodes:
            log.info("waiting for nodes: %d of %d connected", len(online), self.min_available_nodes)
            time.sleep(1)
            online = list(grid.get_node_ids())
        self._admit(grid, online)
        nodes = self.ordered(online)
        if everyone:
            return nodes
        if train and self.holdout_fraction:  # held-out partitions never train
            held = self.held_out(nodes)
            nodes = [n for n in nodes if n not in held]
        if not nodes:
            log.warning("no node may be sampled: %d connected, all refused", len(online))
            return []
        if train:  # the population this round sampled from (DP's q: nodes join and leave)
            self.sampled_from = len(nodes)
        if train and self.poisson:  # dp-sampling = "poisson": a coin per node, may be none
            return [n for n in nodes if self.rng.random() < fraction]
        return self.ordered(self.rng.sample(nodes, max(1, round(fraction * len(nodes)))))

    def held_out(self, nodes: Sequence[int]) -> set[int]:
        """The nodes whose partition id is among the top ``holdout_fraction`` of the ids."""
        num = len(nodes)
        cutoff = num - round(self.holdout_fraction * num)
        return {n for n in nodes if self.partition_of.get(n, -1) >= cutoff}
