"""Where a client's personal state lives between rounds (and runs).

A store maps a key (e.g. ``"personal"``) to a dict of named tensors: personal parameters
and per-client algorithm state (scalars as 0-d tensors). Two backends:

- ``DirectoryStore`` (here): one ``<key>.pt`` file per key in a directory on the device
  (node config ``state-dir``). Every save is atomic (temporary file + ``os.replace``), so a
  crash never leaves a half-written file; a file that cannot be read is reported and treated
  as missing, so the client re-initialises instead of crashing.
- ``ContextStore`` (``pflower/context_store.py``, next to the ClientApp: it is Flower's):
  Flower's ``context.state``, the default.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger("flwr.pflower")
_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_key(key: str) -> str:
    if not _KEY.match(key):
        raise ValueError(f"store key {key!r} must match {_KEY.pattern}")
    return key


class Store(Protocol):
    def load(self, key: str) -> dict[str, torch.Tensor] | None: ...

    def save(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None: ...


class DirectoryStore:
    """Personal state as ``<directory>/<key>.pt`` files, written atomically."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / f"{check_key(key)}.pt"

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        path = self.path(key)
        if not path.exists():
            return None
        if not path.is_file():
            log.warning("personal state %s is not a file; re-initialising", path)
            return None
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict) or not all(
                isinstance(v, torch.Tensor) for v in loaded.values()
            ):
                raise ValueError("not a dict of tensors")
        except Exception as err:  # noqa: BLE001 - any unreadable file means: start afresh
            log.warning("personal state %s is unreadable (%s); re-initialising", path, err)
            return None
        return loaded

    def save(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        path = self.path(key)
        if path.exists() and not path.is_file():  # e.g. a directory in the file's place
            aside = path.with_name(f"{path.name}.not-a-file-{os.getpid()}")
            log.warning("personal state %s is not a file; moved aside to %s", path, aside)
            path.rename(aside)
        save_atomic({n: t.detach().cpu() for n, t in tensors.items()}, path)


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
    store: Store, key: str, template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Load ``key`` if it has exactly the template's names, shapes and dtypes and finite
    values; otherwise ``None``.

    A mismatch (another model or split than the one that saved the state, a file edited
    or corrupted to NaN) is reported and treated as no state, so the algorithm initialises
    afresh.
    """
    loaded = store.load(key)
    if loaded is None:
        return None
    expected = {n: (tuple(t.shape), t.dtype) for n, t in template.items()}
    found = {n: (tuple(t.shape), t.dtype) for n, t in loaded.items()}
    if expected != found:
        log.warning("stored state %r does not match this model/split; re-initialising", key)
        return None
    if not all(torch.isfinite(t).all() for t in loaded.values() if t.is_floating_point()):
        log.warning("stored state %r holds NaN or Inf; re-initialising", key)
        return None
    return loaded
