"""Stragglers: a compute-time model for comparing synchronous and asynchronous servers on wall
clock (the experiment ClientApp, ``pflower.testbed.client_app``, sleeps after training).
In a real deployment the device's own speed is
the model; nothing here runs unless configured."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pflower.config import Config


def straggler_delay(cfg: Config, node_config: Mapping) -> float:
    """Seconds this node waits before each training reply: node config ``delay-s`` if set,
    else ``straggler-delay-s``, times ``straggler-factor`` for the ``straggler-fraction`` of the
    partitions drawn by ``seed``. 0 (no wait) unless configured."""
    if "delay-s" in node_config:
        return float(node_config["delay-s"])
    if not cfg.straggler_delay_s:
        return 0.0
    n = int(node_config["num-partitions"])
    slow = random.Random(cfg.seed).sample(range(n), round(cfg.straggler_fraction * n))
    factor = cfg.straggler_factor if int(node_config["partition-id"]) in slow else 1.0
    return cfg.straggler_delay_s * factor
