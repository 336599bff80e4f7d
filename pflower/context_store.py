"""Personal state in Flower's ``context.state``, the default store of the ClientApp, and the
scoping that keeps a device's state to the run configuration that produced it.

``context.state`` (a ``RecordDict``) lives as long as the node process, across the rounds of
one run, in simulation and deployment. With node config ``state-dir`` the ClientApp keeps the
state in a directory on the device instead (``pflower.task.state.DirectoryStore``).

**Scoped state** (``ScopedStore``, what every client half reads and writes through): each
entry records what produced it (``Scope``: experiment name, algorithm, model, data set, the
partition and a fingerprint of the personal part's names, shapes and dtypes) and when (the
server's run tag and round). A client loads an entry only if its scope is this run's: a head
a PFLEGO run left behind is never the start of a FedAlt run whose head happens to have the
same shape. With ``personal-state = "experiment"`` (the default) state carries across runs of
the same scope; with ``"run"`` a run only continues what it wrote itself (after a resume).

**Versioned by round.** A device may train in a round whose aggregate the server never
committed (the SuperLink died before its checkpoint). The resumed run sends that round again;
the device must start it from the state it had before, or it would apply that round's
personal step twice. So every key keeps the newest entry and the one before it
(``<key>.prev``); training in round r loads the newest entry of this run written *before*
round r (evaluation in round r: up to r), and a save in a round this run already wrote
replaces that entry instead of pushing the committed one out. If the newest entry's file is
unreadable, the client resumes from the previous one and says so.

**Reset by the server.** A node whose replies the server dropped for their values in
consecutive rounds (non-finite, or an update beyond the norm bound) may be wedged by its own
stored state: every round starts from it, so every reply is dropped again. The server then
sets ``personal-reset`` in that node's training message; the node starts the round from its
personal init as a new client would (``ScopedStore.load`` returns nothing), and what the round
saves becomes the newest entry, which the next rounds start from. Stored values that are
absurd on their face (non-finite, or far beyond the model's scale) never get this far:
``pflower.task.state.load_matching`` refuses them at load.

**Inference** (``pflower.predict``) pairs a run's final shared weights with the entry that run
wrote (its run tag, recorded in the run's ``config.json``, and its scope), never with one a
later run or another experiment left on the device (``stored_entries``, ``describe_scope``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from flwr.app import RecordDict

from pflower.task.state import DirectoryStore, Store, UnreadableState, check_key
from pflower.wire import PERSONAL_RESET, RUN_TAG, SERVER_ROUND, array_view, to_record, to_torch

if TYPE_CHECKING:
    from pflower.strategies.client import ClientJob

log = logging.getLogger("flwr.pflower")

#: the tensor of a stored entry that records its scope, run tag and round (UTF-8 JSON bytes)
META = "pflower-meta"
#: suffix of the entry one version older than the newest
PREVIOUS = ".prev"


class ContextStore:
    """Personal state in Flower's ``context.state`` under ``pflower.<key>``."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        record = self.state.get(f"pflower.{check_key(key)}")
        if record is None:
            return None
        return to_torch(record)

    def save(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        state_dict = {n: t.detach().cpu() for n, t in tensors.items()}
        self.state[f"pflower.{check_key(key)}"] = to_record(state_dict)

    def copy(self, source: str, target: str) -> bool:
        """Store entry ``source`` again as ``target``, as it is: the same record, whose
        arrays are immutable bytes (every save stores a new record), not decoded and encoded
        again. False if there is no ``source``."""
        record = self.state.get(f"pflower.{check_key(source)}")
        if record is None:
            return False
        self.state[f"pflower.{check_key(target)}"] = record
        return True

    def entry(self, key: str) -> tuple[dict | None, Callable[[], dict]] | None:
        """Entry ``key`` as (its meta, read alone; a function that decodes its tensors), or
        None: a scoped load decodes only the version it chooses."""
        record = self.state.get(f"pflower.{check_key(key)}")
        if record is None:
            return None
        meta = _parse_meta(array_view(record[META]).tobytes()) if META in record else None

        def tensors() -> dict[str, torch.Tensor]:
            return {n: t for n, t in to_torch(record).items() if n != META}

        return meta, tensors


def open_store(state: RecordDict, node_config: Mapping[str, object]) -> Store:
    """The node's store: a ``DirectoryStore`` if node config sets ``state-dir``, else context."""
    state_dir = node_config.get("state-dir")
    if state_dir:
        return DirectoryStore(str(state_dir))
    return ContextStore(state)


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """A short hash of the names, shapes and dtypes of ``tensors`` (not their values)."""
    return _layout_hash(
        tuple(sorted((n, tuple(t.shape), str(t.dtype)) for n, t in tensors.items()))
    )


@functools.lru_cache(maxsize=64)
def _layout_hash(layout: tuple) -> str:
    # every message of a client scopes its store by this hash of the same layout: hashed
    # once (the JSON and SHA-256 were ~20 us a message). JSON writes the tuples
    # as the lists it wrote before, so stored scopes still match.
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Scope:
    """What produced a client's state; state is loaded only by a run of the same scope."""

    experiment: str
    algorithm: str
    model: str
    dataset: str
    partition: str  # "<partition-id>/<num-partitions>": the device's data
    personal: str  # fingerprint of the personal part (names, shapes, dtypes)

    @classmethod
    def of(cls, cfg, partition_id: int, num_partitions: int, personal: Mapping) -> Scope:
        """The scope of a client of run config ``cfg`` whose personal part is ``personal``."""
        return cls(
            experiment=cfg.experiment_name,
            algorithm=cfg.algorithm,
            model=cfg.model,
            dataset=cfg.dataset,
            partition=f"{partition_id}/{num_partitions}",
            personal=fingerprint(personal),
        )

    def differences(self, other: Mapping) -> str:
        """How a stored scope differs from this one, e.g. ``algorithm 'pflego' (this run:
        'fedalt')``; '' if it does not."""
        mine = asdict(self)
        return ", ".join(
            f"{k} {other.get(k)!r} (this run: {v!r})" for k, v in mine.items() if other.get(k) != v
        )


@dataclass
class StoredEntry:
    """One stored version of a key: its tensors and what wrote it (``meta``: the scope, the
    run tag and the round). ``read`` (optional) decodes the tensors on first use."""

    slot: str  # the raw store's key
    _tensors: dict[str, torch.Tensor] | None
    meta: dict | None  # None: written without a scope (an older pflower, a hand-made file)
    read: Callable[[], dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self.read() if self.read is not None else {}
        return self._tensors

    @property
    def run(self) -> str:
        return str(self.meta.get("run", "")) if self.meta else ""

    @property
    def round(self) -> int:
        return int(self.meta.get("round", 0)) if self.meta else 0

    @property
    def scope(self) -> dict | None:
        scope = self.meta.get("scope") if self.meta else None
        return scope if isinstance(scope, dict) else None

    def describe(self) -> str:
        """What wrote this entry, in words (error messages name it beside the expected one)."""
        if self.scope is None:
            return "no record of what wrote it (an older pflower or a hand-made file)"
        return f"run {self.run or '(untagged)'}, round {self.round}, {describe_scope(self.scope)}"


def describe_scope(scope: Mapping) -> str:
    """A scope as ``experiment 'x', algorithm 'fedalt', ...`` (every field, in order)."""
    return ", ".join(f"{k} {scope.get(k)!r}" for k in Scope.__dataclass_fields__)


def stored_entries(
    raw: Store, key: str, unreadable: dict[str, str] | None = None
) -> list[StoredEntry]:
    """The stored versions of ``key`` in ``raw`` (the newest, then ``<key>.prev``), newest
    first; the slots whose file cannot be read go into ``unreadable`` (slot: reason), not
    into the list."""
    entries = []
    # DirectoryStore.read raises on an unreadable file where its load logs a fresh start
    read = raw.read if isinstance(raw, DirectoryStore) else raw.load
    for slot in (check_key(key), key + PREVIOUS):
        if isinstance(raw, ContextStore):  # the meta alone; tensors decoded if chosen
            found = raw.entry(slot)
            if found is not None:
                entries.append(StoredEntry(slot, None, found[0], read=found[1]))
            continue
        try:
            tensors = read(slot)
        except UnreadableState as err:
            if unreadable is not None:
                unreadable[slot] = str(err)
            continue
        if tensors is None:
            continue
        meta_tensor = tensors.pop(META, None)
        meta = None
        if meta_tensor is not None:
            meta = _parse_meta(meta_tensor.to(torch.uint8).numpy().tobytes())
        entries.append(StoredEntry(slot, tensors, meta))
    return entries


def _parse_meta(raw: bytes) -> dict | None:
    """A stored entry's meta (UTF-8 JSON of a dict), or None if it is not one."""
    try:
        meta = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


class ScopedStore:
    """A ``Store`` whose entries record their ``Scope``, run tag and round (module docstring).

    Parameters
    ----------
    raw : Store
        Where the entries live (``ContextStore`` or ``DirectoryStore``).
    scope : Scope
        This client's scope; entries of another scope are never loaded.
    run : str (default: "")
        The server's run tag (``RUN_TAG`` in the message config; a resumed run keeps it).
        Empty: no versioning, the newest entry of this scope is loaded.
    server_round : int (default: 0)
        The message's round.
    training : bool (default: True)
        A training message (loads state written before ``server_round``) or an evaluation
        (loads state written up to ``server_round``, i.e. by this round's training).
    carry : bool (default: True)
        Whether state written by other runs of the same scope may be loaded
        (``personal-state = "experiment"``).
    reset : bool (default: False)
        The server's ``personal-reset``: load nothing (every key starts from the init); what
        is saved replaces the stored state as in any other round.
    """

    def __init__(
        self,
        raw: Store,
        scope: Scope,
        *,
        run: str = "",
        server_round: int = 0,
        training: bool = True,
        carry: bool = True,
        reset: bool = False,
    ) -> None:
        self.raw, self.scope, self.run = raw, scope, run
        self.server_round, self.training, self.carry = server_round, training, carry
        self.reset = reset
        # per key, what the newest entry's meta is, as this message last read or wrote it
        # (None: no newest entry): a save after a load does not read the entries again
        self._newest: dict[str, dict | None] = {}
        # compared with every entry read, written with every save; its fields are strings,
        # so the flat copy is ``asdict``'s (which copies recursively: ~10 us a message)
        self._scope = dict(vars(scope))

    def _entries(self, key: str, unreadable: dict[str, str] | None = None) -> list[StoredEntry]:
        entries = stored_entries(self.raw, key, unreadable)
        newest = next((e for e in entries if e.slot == key), None)
        if not (unreadable and key in unreadable):  # an unreadable newest is not known
            self._newest[key] = newest.meta if newest is not None else None
        return entries

    def _mine(self, entry: StoredEntry) -> bool:
        return entry.meta is not None and entry.meta.get("scope") == self._scope

    def _usable(self, entry: StoredEntry) -> bool:
        """Whether this message may start from ``entry`` (same scope assumed)."""
        if not self.run:
            return True
        if entry.run == self.run:  # this run's: only what committed rounds before this wrote
            last = self.server_round - 1 if self.training else self.server_round
            return entry.round <= last
        return self.carry

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        if self.reset:  # personal-reset from the server (logged once, by scope_job)
            return None
        unreadable: dict[str, str] = {}
        entries = self._entries(key, unreadable)
        chosen = self._choose(entries)
        where = f" in {self.raw.directory}" if isinstance(self.raw, DirectoryStore) else ""
        for slot, why in unreadable.items():
            if chosen is None:
                done = "re-initialising"
            elif chosen.slot == key + PREVIOUS:
                done = f"resumed from the previous version {chosen.slot!r} of round {chosen.round}"
            else:
                done = "the newest version is used"
            log.warning("personal state %r%s is unreadable (%s); %s", slot, where, why, done)
        if chosen is not None:
            return chosen.tensors
        self._report_foreign(key, entries)
        return None

    def _choose(self, entries: list[StoredEntry]) -> StoredEntry | None:
        """The entry this message starts from, if any."""
        usable = [e for e in entries if self._mine(e) and self._usable(e)]
        own = [e for e in usable if self.run and e.run == self.run]
        if own:  # this run's own state wins over any other run's
            return max(own, key=lambda e: e.round)
        if usable:  # the newest of another run of this scope (or, without a run tag, any)
            return usable[0]
        return None

    def _report_foreign(self, key: str, entries: list[StoredEntry]) -> None:
        foreign = [e for e in entries if not self._mine(e)]
        if foreign and len(foreign) == len(entries):
            newest = foreign[0]
            why = (
                self.scope.differences(newest.meta.get("scope", {}))
                if newest.meta
                else "no record of what wrote it (an older pflower or a hand-made file)"
            )
            log.warning(
                "personal state %r was written by another configuration: %s; starting fresh",
                key,
                why,
            )

    def save(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        if key in self._newest:  # read (or written) by this message already
            known = self._newest[key]
            newest = None if known is None else StoredEntry(key, {}, known)
        else:
            newest = next((e for e in self._entries(key) if e.slot == key), None)
        meta = {"scope": self._scope, "run": self.run, "round": self.server_round}
        # keep the newest entry as the previous one, unless it is this run's from this round
        # or a later one (written in a round the server never committed): that one is
        # replaced, so the state before the round stays available
        superseded = (
            newest is not None
            and self._mine(newest)
            and self.run
            and newest.run == self.run
            and newest.round >= self.server_round
        )
        if newest is not None and self._mine(newest) and not superseded:
            self._keep_as_previous(key)
        tensors = {n: t.detach().cpu() for n, t in tensors.items()}
        self.raw.save(key, {**tensors, META: _meta_tensor(meta)})
        self._newest[key] = meta

    def _keep_as_previous(self, key: str) -> None:
        """The newest entry of ``key``, as stored, becomes ``<key>.prev``: moved as it is by a
        store that can (``ContextStore.copy``: ~0.3 ms less per message for a 0.6 MB state),
        else read and written again."""
        if isinstance(self.raw, ContextStore) and self.raw.copy(key, key + PREVIOUS):
            return
        newest = next((e for e in stored_entries(self.raw, key) if e.slot == key), None)
        if newest is not None:
            self.raw.save(key + PREVIOUS, {**newest.tensors, META: _meta_tensor(newest.meta)})


def _meta_tensor(meta: Mapping) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)


def scope_job(job: ClientJob, config: Mapping, training: bool) -> None:
    """Put ``job``'s store behind the ``ScopedStore`` of this message: the client's scope,
    the server's run tag and round, ``personal-state``, and the server's ``personal-reset``
    (a training message only: this round starts from the personal init)."""
    raw = job.store.raw if isinstance(job.store, ScopedStore) else job.store
    reset = training and config.get(PERSONAL_RESET, False) is True
    if reset:
        log.warning("personal-reset from the server: starting this round from the personal init")
    job.store = ScopedStore(
        raw,
        Scope.of(job.cfg, job.partition_id, job.num_partitions, job.init_personal),
        run=str(config.get(RUN_TAG, "")),
        server_round=int(config.get(SERVER_ROUND, 0)),
        training=training,
        carry=job.cfg.personal_state == "experiment",
        reset=reset,
    )
