"""Third-party messages that ``console = "compact"`` leaves out, in the ServerApp's process and
in every ClientApp's (a simulation's Ray workers print theirs through the driver):

- Ray's ``FutureWarning`` "Tip: In future versions of Ray, Ray will no longer override
  accelerator visible devices env var ..." (printed once at ``ray.init``; nothing to act on);
- flwr-datasets' ``UserWarning``s (e.g. the pathological partitioner's "Classes: [...] will NOT
  be used", the label plot's "The verbose names can not be established"): the run's
  ``labels.png`` shows each client's classes;
- Flower's "Manually terminating ClientAppActor" as the simulation shuts its workers down.

``console = "flower"`` leaves them all in. The filters are narrow (these categories from these
packages, this one log line) and stay for the life of the process once a compact run
installed them: the Ray tip and the actors' shutdown line come after the run's own code ran.
Standard library only: the device entry imports this.
"""

from __future__ import annotations

import logging
import warnings

#: the start of Ray's accelerator tip (``ray._private.worker``)
RAY_TIP = r"Tip: In future versions of Ray"
#: Flower's log line when the simulation stops a worker (``flwr.simulation.ray_transport``)
ACTOR_TERMINATING = "Manually terminating %s"


class _FlowerShutdown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != ACTOR_TERMINATING


def third_party() -> None:
    """Leave out the messages of the module docstring, in this process (idempotent)."""
    warnings.filterwarnings("ignore", message=RAY_TIP, category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"flwr_datasets(\.|$)")
    flower = logging.getLogger("flwr")
    if not any(isinstance(f, _FlowerShutdown) for f in flower.filters):
        flower.addFilter(_FlowerShutdown())
