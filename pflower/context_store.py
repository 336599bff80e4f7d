"""Personal state in Flower's ``context.state``, the default store of the ClientApp.

``context.state`` (a ``RecordDict``) lives as long as the node process, across the rounds of
one run, in simulation and deployment. With node config ``state-dir`` the ClientApp keeps the
state in a directory on the device instead (``pflower.task.state.DirectoryStore``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from flwr.app import ArrayRecord, RecordDict

from pflower.task.state import DirectoryStore, Store, check_key


class ContextStore:
    """Personal state in Flower's ``context.state`` under ``pflower.<key>``."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        record = self.state.get(f"pflower.{check_key(key)}")
        if record is None:
            return None
        return dict(record.to_torch_state_dict())

    def save(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        state_dict = {n: t.detach().cpu() for n, t in tensors.items()}
        self.state[f"pflower.{check_key(key)}"] = ArrayRecord(state_dict)


def open_store(state: RecordDict, node_config: Mapping[str, object]) -> Store:
    """The node's store: a ``DirectoryStore`` if node config sets ``state-dir``, else context."""
    state_dir = node_config.get("state-dir")
    if state_dir:
        return DirectoryStore(str(state_dir))
    return ContextStore(state)
