"""``tracking = "tensorboard"``: every round's numbers as TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pflower.strategies.history import RoundLog

if TYPE_CHECKING:
    from pflower.config import Config


class Tracker:
    """``tracking = "tensorboard"``: every round's training, evaluation, wire and timing
    numbers as TensorBoard scalars (``torch.utils.tensorboard``, event files in
    ``<run>/tensorboard/``; ``tensorboard --logdir outputs`` shows every run side by side).
    Nothing leaves the machine. ``"none"``: does nothing. A context manager: the writer is
    opened before the first round (a missing package fails then, naming the extra) and
    closed after the last."""

    def __init__(self, cfg: Config, out: Path) -> None:
        self.cfg, self.out, self.writer = cfg, out, None

    def __enter__(self) -> Tracker:
        if self.cfg.tracking == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                from pflower.config import ConfigError

                raise ConfigError(
                    "key 'tracking' = 'tensorboard': needs the tensorboard package "
                    f"({err}): pip install 'pflower[tracking]', or tracking 'none'"
                ) from None
            self.writer = SummaryWriter(log_dir=str(self.out / "tensorboard"))
            self.writer.add_text(
                "run-config", "\n".join(f"    {k} = {v!r}" for k, v in self.cfg.to_flat().items())
            )
        return self

    def add_round(self, entry: RoundLog) -> None:
        if self.writer is None:
            return
        groups = {
            "train": entry.train,
            "evaluate": entry.evaluate,
            "server": entry.server,
            "wire": entry.wire,
            "dropped": entry.dropped,
        }
        for group, values in groups.items():
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{group}/{key}", value, entry.round)
        self.writer.add_scalar("round/seconds", entry.seconds, entry.round)

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()
