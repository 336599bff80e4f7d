"""What an algorithm registers: how the app builds its strategy and client half, which
parameters cross the wire, its settings and its defaults. Each algorithm's file declares its own
``ALGORITHMS`` entries; ``pflower.strategies`` collects them. The contract sits at the bottom
of the layers with ``pflower.settings``: it imports no algorithm and no strategy code."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pflower.settings import Settings

if TYPE_CHECKING:
    from pflower.strategies.client import ClientHalf


@dataclass(frozen=True)
class Algorithm:
    """An algorithm of the app: how to build its strategy, its client half, its wire split.

    ``strategy``: the server half's class; ``strategy.from_config(cfg, **base_settings)``
    builds it from the run config, and its class attributes ``defaults`` (the values this
    algorithm uses for run-config keys left at ``auto``, ``settings.AUTO``) and ``defence``
    (its default defence where it is not adaptive clipping) are the registration's.
    ``wire_split``: ``"config"`` uses the run config's ``split`` (the personal part stays
    on the client); ``"none"`` shares every parameter (FedAvg); ``"full"`` shares none
    (local training). ``personal_split``: the split whose personal part the personalized
    model adapts (differs from the wire split for FedAvg + fine-tuning). ``settings``: its
    own keys (``settings.Settings`` subclasses), composed into ``Config``.
    ``numpy_client``: whether ``pflower.numpy_client`` can run its client half.
    """

    strategy: type
    client: ClientHalf
    wire_split: str = "config"
    personal_split: str = "config"
    settings: tuple[type[Settings], ...] = ()
    #: whether its client half runs behind ``PersonalizedNumPyClient`` (one ``arrays`` reply
    #: in the user's own split)
    numpy_client: bool = False

    @property
    def defaults(self) -> Mapping[str, Any]:
        """The values this algorithm uses for run-config keys left at ``auto``."""
        return self.strategy.defaults

    @property
    def defence(self) -> Mapping[str, Any]:
        """Its default defence where it is not adaptive clipping: values for the robust keys
        left at ``auto``, taken only in runs that leave ``robust-aggregator`` at ``auto`` and
        have no differential privacy (``settings.RunSettings.resolved``)."""
        return self.strategy.defence
