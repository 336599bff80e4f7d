"""Where a client's personal state lives between rounds (and runs).

A store maps a key (e.g. ``"personal"``) to a dict of named tensors: personal parameters
and per-client algorithm state (scalars as 0-d tensors). Two backends:

- ``DirectoryStore`` (here): one ``<key>.pt`` file per key in a directory on the device
  (node config ``state-dir``). Every save is atomic (temporary file + ``os.replace``), so a
  crash never leaves a half-written file; a file that cannot be read is reported and treated
  as missing (``ScopedStore`` then resumes from the version before it, if it has one), so the
  client never crashes on it.
- ``ContextStore`` (``pflower/context_store.py``, next to the ClientApp: it is Flower's):
  Flower's ``context.state``, the default.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger("flwr.pflower")
_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")

#: stored values larger than this many times the scale of the values they must match are
#: refused (``load_matching``)
STATE_BOUND = 1e4


class UnreadableState(Exception):
    """A stored entry that exists but cannot be read (``DirectoryStore.read``)."""


def check_key(key: str) -> str:
    if not _KEY.match(key):
        raise ValueError(f"store key {key!r} must match {_KEY.pattern}")
    return key


class Store(Protocol):
    """Where a client's personal state lives between its messages.

    ``load`` returns tensors the caller owns: new ones, never a store's own (the client
    halves train them in place). ``save`` keeps the values as they are at the call: it
    serializes or copies them, as ``ContextStore`` (into a record's bytes) and
    ``DirectoryStore`` (into a file) do, since the tensors it is given may be the model's
    own parameters, which the next message overwrites. (One copy in each direction, not two.)"""

    def load(self, key: str) -> dict[str, torch.Tensor] | None: ...

    def save(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None: ...


class DirectoryStore:
    """Personal state as ``<directory>/<key>.pt`` files, written atomically."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / f"{check_key(key)}.pt"

    def read(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry ``key``; ``None`` if there is none; ``UnreadableState`` (with the reason)
        if its file cannot be read as a dict of tensors."""
        path = self.path(key)
        if not path.exists():
            return None
        if not path.is_file():
            raise UnreadableState("not a file")
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict) or not all(
                isinstance(v, torch.Tensor) for v in loaded.values()
            ):
                raise ValueError("not a dict of tensors")
        except Exception as err:  # noqa: BLE001 - any unreadable file means: start afresh
            first = (str(err).strip().splitlines() or [""])[0]  # one line in the log
            reason = f"{type(err).__name__}: {first[:120]}" if first else type(err).__name__
            raise UnreadableState(reason) from err
        return loaded

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry ``key``; ``None`` if there is none or it is unreadable (reported)."""
        try:
            return self.read(key)
        except UnreadableState as err:
            log.warning(
                "personal state %s is unreadable (%s); re-initialising", self.path(key), err
            )
            return None

    def save(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        path = self.path(key)
        if path.exists() and not path.is_file():  # e.g. a directory in the file's place
            aside = path.with_name(f"{path.name}.not-a-file-{os.getpid()}")
            log.warning("personal state %s is not a file; moved aside to %s", path, aside)
            path.rename(aside)
        save_atomic({n: _own_storage(t.detach().cpu()) for n, t in tensors.items()}, path)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a compact copy where it is a view into a larger storage (``torch.save``
    writes a tensor's whole storage: a parameter that is a slice of a flat buffer would
    write the buffer)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def save_atomic(obj: object, path: Path) -> None:
    """``torch.save(obj, path)`` so that a crash leaves the old file or the new one, never
    half of one: a temporary file beside it, fsync, then ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_matching(
    store: Store,
    key: str,
    template: Mapping[str, torch.Tensor],
    *,
    scale: float | Callable[[], float] = 1.0,
) -> dict[str, torch.Tensor] | None:
    """Load ``key`` if it has exactly the template's names, shapes and dtypes and sane
    values; otherwise ``None``, with one warning line naming the key and what was wrong.

    A mismatch (another model or split than the one that saved the state, a file edited
    or corrupted) is treated as no state, so the algorithm initialises afresh. Sane values
    are finite and, in the floating-point tensors, bounded::

        max |stored value| <= STATE_BOUND * max(scale, max |template value|)

    with ``STATE_BOUND`` = 1e4 and ``scale`` at least 1 (``ClientJob.load`` passes the
    largest magnitude of the shared parameters just received, so the bound follows the
    model's own scale). The template is what the state starts from or must match (the
    personal init, the current model for APFL's v and L2GD's x_m, zeros for Scaffold's c_i
    and APFL's alpha), so an honest state, even one that starts at zero, is far inside the
    bound; a state 1e4 times larger than everything the model holds can only come from a
    diverged run or a tampered file, and loading it would poison its owner forever: every
    reply computed from it is dropped by the server's value checks, round after round.
    (What stays inside the bound yet makes the replies dropped is the server's to end:
    ``personal-reset``, ``pflower.context_store``.) Integer tensors (counters) are not
    bounded here; their owner checks them. ``scale`` may be a function, called only for a
    state beyond the template's own bound (``ClientJob.load``'s is a pass over every shared
    parameter: ~60 us per message for a 200 k-value MLP).
    """
    loaded = store.load(key)
    if loaded is None:
        return None
    expected = {n: (tuple(t.shape), t.dtype) for n, t in template.items()}
    found = {n: (tuple(t.shape), t.dtype) for n, t in loaded.items()}
    if expected != found:
        log.warning("stored state %r does not match this model/split; re-initialising", key)
        return None
    floats = [t for t in loaded.values() if t.is_floating_point() and t.numel()]
    extents = [_extent(t) for t in floats]
    if not all(math.isfinite(e) for e in extents):
        log.warning("stored state %r holds NaN or Inf; re-initialising", key)
        return None
    largest = max(extents, default=0.0)
    # the bound is STATE_BOUND x max(1, template's scale, scale): a state within STATE_BOUND
    # is inside it whatever they are, so the template's scale (a pass over it) is measured
    # only beyond that
    reference = 1.0
    if largest > STATE_BOUND * reference:
        reference = max(1.0, magnitude(template.values()))
    if largest > STATE_BOUND * reference:  # only then the (larger) scale it may be within
        reference = max(scale() if callable(scale) else scale, reference)
    if largest > STATE_BOUND * reference:
        log.warning(
            "stored state %r holds values up to %.3g, beyond %.0e x the model's scale %.3g: "
            "re-initialising",
            key,
            largest,
            STATE_BOUND,
            reference,
        )
        return None
    return loaded


def magnitude(tensors: Iterable[torch.Tensor]) -> float:
    """The largest finite |value| in the floating-point ``tensors`` (0 if there is none):
    the scale ``load_matching`` bounds stored state by."""
    largest = 0.0
    for t in tensors:
        if t.is_floating_point() and t.numel():
            value = _extent(t)
            if not math.isfinite(value):  # rare: only then the copy without NaN / Inf
                finite = t.detach()[torch.isfinite(t.detach())]
                value = float(finite.abs().max()) if finite.numel() else 0.0
            largest = max(largest, value)
    return largest


def _extent(t: torch.Tensor) -> float:
    """``max |t|`` of a non-empty floating-point tensor, ``inf`` if it holds a NaN or an Inf:
    its largest and smallest values, which propagate NaN, read in place in one pass
    (``aminmax``). (``isfinite`` then ``abs().max()`` made two temporaries and cost ~0.25 ms
    per 0.6 MB layer, on every load of a client's state.)"""
    low, high = (float(v) for v in torch.aminmax(t.detach()))  # one pass for both
    if not (math.isfinite(high) and math.isfinite(low)):
        return math.inf
    return max(abs(high), abs(low))
