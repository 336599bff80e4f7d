"""What an algorithm registers: how the app builds its strategy and client half, which
parameters cross the wire, its settings and its defaults. Each algorithm's file declares its own
``ALGORITHMS`` entries; ``pflower.strategies`` collects them. The contract sits at the bottom
of the layers with ``pflower.settings``: it imports no algorithm and no strategy code."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pflower.settings import Settings

if TYPE_CHECKING:
    from pflower.strategies.client import ClientHalf


@dataclass(frozen=True)
class Algorithm:
    """An algorithm of the app: how to build its strategy, its client half, its wire split.

    ``strategy(cfg, **base_settings)`` builds the server half from the run config.
    ``wire_split``: ``"config"`` uses the run config's ``split`` (the personal part stays
    on the client); ``"none"`` shares every parameter (FedAvg); ``"full"`` shares none
    (local training). ``personal_split``: the split whose personal part the personalized
    model adapts (differs from the wire split for FedAvg + fine-tuning). ``defaults``: the
    values this algorithm uses for run-config keys left at ``auto`` (``settings.AUTO``).
    ``settings``: its own keys (``settings.Settings`` subclasses), composed into ``Config``.
    ``numpy_client``: whether ``pflower.numpy_client`` can run its client half.
    """

    strategy: Callable[..., Any]
    client: ClientHalf
    wire_split: str = "config"
    personal_split: str = "config"
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: its default defence where it is not adaptive clipping: values for the robust keys
    #: left at ``auto``, taken only in runs that leave ``robust-aggregator`` at ``auto`` and
    #: have no differential privacy (whose clipping is the defence there;
    #: ``settings.RunSettings.resolved``)
    defence: Mapping[str, Any] = field(default_factory=dict)
    settings: tuple[type[Settings], ...] = ()
    #: whether its client half runs behind ``PersonalizedNumPyClient`` (one ``arrays`` reply
    #: in the user's own split)
    numpy_client: bool = False
