"""Crash recovery: a checkpoint after every round, and a run that continues from one.

A SuperLink that dies takes the ServerApp with it: without a checkpoint the run is lost, and
the devices' personal state is a round ahead of anything the server kept. A checkpoint holds
everything the server's next round depends on:

- the shared parameters after round r (``arrays``) and r itself;
- the strategy's state (``strategy_state``): the client sampler's generator and its seed
  (secret by default: a checkpoint is the server's own; under ``dp`` the only place that
  holds it), the server optimizer (Adam's moments and step count), the history of rounds
  1..r, the pre-trained personal slice, each node's first ``num-examples`` claim, the final
  round's per-client rows, the run tag the devices version their state by, and what the
  algorithm keeps of its own (``checkpoint_attributes`` of its strategy: Scaffold's control
  variate c, L2GD's coin generator and iteration count);
- the run config it was written under.

Written atomically (temporary file, fsync, rename) as ``<run>/checkpoints/round-<r>.pt``;
the last ``checkpoint-keep`` are kept. ``checkpoint-every`` = 0 (auto) writes one after every
round in deployment and none in simulation (a simulated run is rerun in seconds); round 0
(the initial parameters and the run tag) is written too, so a run that dies in its first
round resumes as itself.

``resume-from`` = such a checkpoint (or the run directory: its newest one) continues the run
at round r + 1 (``continue_rounds``): the same clients are sampled, the server optimizer
resumes its moments, and the run ends with the shared parameters the uninterrupted run would
have had (``tests/test_checkpoint.py``). The devices keep their personal state; the run tag
makes a device that trained in round r + 1 before the crash start that round again from the
state it had before it (``context_store.ScopedStore``).

A checkpoint's strategy state is a Python pickle: load only checkpoints your own runs wrote
(the same trust as the code you run).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from pflower.settings import ConfigError
from pflower.task.state import save_atomic

if TYPE_CHECKING:
    from pflower.settings import RunSettings

log = logging.getLogger("flwr.pflower")

FORMAT = "pflower-checkpoint/1"
DIRECTORY = "checkpoints"
_NAME = re.compile(r"^round-(\d+)\.pt$")
#: classes a checkpoint of an older pflower pickled under another module's name
MOVED = {
    ("pflower.strategies.checks", "UpdateNormBound"): "pflower.strategies.bound",
    ("pflower.strategies.checks", "RecentNormClip"): "pflower.strategies.bound",
    ("pflower.strategies.checks", "ClaimBound"): "pflower.strategies.bound",
}
#: keys a resumed run may set differently: where and how it runs, not what it computes
OPERATIONAL_KEYS = frozenset(
    {
        "resume-from",
        "outputs-dir",
        "checkpoint-every",
        "checkpoint-keep",
        "round-timeout",
        "max-in-flight",
        "pull-interval",
        "device",
        "console",
        "tracking",
    }
)


def in_deployment(grid: Grid) -> bool:
    """Whether ``grid`` reaches real SuperNodes (not Flower's simulation engine or
    pflower's in-process ``LocalGrid``; a grid not recognised counts as deployment)."""
    from pflower.flower import grids

    return grids.engine_of(grid) not in (grids.SIMULATION, grids.LOCAL)


def interval(cfg: RunSettings, grid: Grid) -> int:
    """Rounds between checkpoints (0: none) for ``checkpoint-every`` on ``grid``."""
    if cfg.checkpoint_every == 0:  # auto
        return 1 if in_deployment(grid) else 0
    return max(0, cfg.checkpoint_every)


def strategy_state(strategy) -> dict:
    """What the strategy's next round depends on (``PersonalizedStrategy.state_dict``)."""
    return strategy.state_dict()


def _array(dtype: str, shape: tuple, stype: str, data: bytes) -> Array:
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


class _StatePickler(pickle.Pickler):
    """Pickles Flower ``Array`` objects by their four fields. An Array that went out in a
    message caches its chunks (``Array.slice_array``: memoryview slices, which pickle
    refuses), e.g. the ``personal-init`` record every client got after pre-training: a
    deployment with pre-training failed its first checkpoint with "cannot pickle
    memoryview objects" (LocalGrid and the simulation engine never deflate a message)."""

    def reducer_override(self, obj):
        if isinstance(obj, Array):
            return _array, (obj.dtype, tuple(obj.shape), obj.stype, bytes(obj.data))
        return NotImplemented


class _StateUnpickler(pickle.Unpickler):
    """Reads a strategy's state, classes that have moved since (``MOVED``) from where they
    are now."""

    def find_class(self, module: str, name: str):
        return super().find_class(MOVED.get((module, name), module), name)


def dumps_state(state: dict) -> bytes:
    """The strategy's state as pickle bytes (``_StatePickler``)."""
    buffer = io.BytesIO()
    _StatePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    return buffer.getvalue()


def _same(key: str, value):
    """A value as the computation reads it: a bucket size of 0 (resolved: no bucketing) and
    of 1 both mean no buckets, so a run written when FFGG's default had none (before its
    default took buckets of 2) resumes with ``robust-bucket-size = 1``."""
    if key == "robust-bucket-size" and value in (0, 1):
        return 1
    return value


@dataclass
class Checkpoint:
    """A checkpoint read back: after round ``round`` of ``num_rounds``."""

    path: Path
    round: int
    num_rounds: int
    arrays: dict[str, torch.Tensor]
    config: dict
    state: dict
    continuable: bool

    def check(self, cfg: RunSettings) -> None:
        """Refuse a run config that computes something else than the checkpoint's run."""
        now = {k: v for k, v in cfg.to_flat().items() if k not in OPERATIONAL_KEYS}
        then = {k: v for k, v in self.config.items() if k not in OPERATIONAL_KEYS}
        differ = sorted(
            k for k in now.keys() | then.keys() if _same(k, now.get(k)) != _same(k, then.get(k))
        )
        if differ:
            shown = ", ".join(
                f"{k!r} = {now.get(k)!r} (checkpoint: {then.get(k)!r})" for k in differ[:3]
            )
            raise ConfigError(
                f"key 'resume-from' = {str(self.path)!r}: the checkpoint's run had other "
                f"settings: {shown}; a resumed run continues the same run (only "
                f"{', '.join(sorted(OPERATIONAL_KEYS))} may change)"
            )

    def restore(self, strategy) -> None:
        """Put the strategy's state back as it was after round ``round``."""
        strategy.load_state_dict(self.state)


class Checkpointer:
    """Flower's per-round ``evaluate_fn`` hook, wrapped: after round r (and round 0) of
    ``strategy``, every ``every`` rounds and after the last, write a checkpoint into
    ``out/checkpoints`` and keep the newest ``keep``. ``continuable``: whether
    ``continue_rounds`` can continue ``strategy`` (the caller knows its round loop; this
    module imports no strategy code, since the round loop imports it)."""

    def __init__(
        self,
        cfg: RunSettings,
        out: Path,
        strategy,
        every: int,
        keep: int,
        evaluate_fn=None,
        *,
        continuable: bool,
    ):
        self.cfg, self.directory, self.strategy = cfg, Path(out) / DIRECTORY, strategy
        self.every, self.keep, self.evaluate_fn = every, keep, evaluate_fn
        self.continuable = continuable

    def __call__(self, server_round: int, arrays: ArrayRecord):
        result = self.evaluate_fn(server_round, arrays) if self.evaluate_fn else None
        if server_round % self.every == 0 or server_round == self.strategy.num_rounds:
            self.save(server_round, arrays)
        return result

    def save(self, server_round: int, arrays: ArrayRecord) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        blob = dumps_state(strategy_state(self.strategy))
        content = {
            "format": FORMAT,
            "round": server_round,
            "num-rounds": self.strategy.num_rounds,
            "arrays": dict(arrays.to_torch_state_dict()),
            "config": self.cfg.to_flat(),
            "continuable": self.continuable,
            "strategy": torch.frombuffer(bytearray(blob), dtype=torch.uint8),
        }
        path = self.directory / f"round-{server_round}.pt"
        save_atomic(content, path)
        for old in _rounds(self.directory)[: -self.keep]:
            old[1].unlink(missing_ok=True)
        return path


def _rounds(directory: Path) -> list[tuple[int, Path]]:
    """The checkpoints in ``directory``, oldest first."""
    found = [
        (int(m.group(1)), p) for p in directory.glob("round-*.pt") if (m := _NAME.match(p.name))
    ]
    return sorted(found)


def newest(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a file; else the newest ``round-<r>.pt`` in it or in its
    ``checkpoints/`` (a run directory)."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = _rounds(path) or _rounds(path / DIRECTORY)
        if not found:
            raise ConfigError(
                f"key 'resume-from' = {str(path)!r}: no round-<r>.pt checkpoint in it or in "
                f"its {DIRECTORY}/"
            )
        return found[-1][1]
    return path


def read(path: str | os.PathLike) -> Checkpoint | dict[str, torch.Tensor]:
    """The checkpoint at ``path`` (or the newest in a directory); a plain file of tensors
    (``final-shared.pt``, a pre-trained model) is returned as its dict of tensors."""
    path = newest(path)
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as err:
        raise ConfigError(f"key 'resume-from' = {str(path)!r}: cannot be read ({err})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        return content
    state = _StateUnpickler(io.BytesIO(content["strategy"].numpy().tobytes())).load()
    return Checkpoint(
        path=path,
        round=int(content["round"]),
        num_rounds=int(content["num-rounds"]),
        arrays=content["arrays"],
        config=dict(content["config"]),
        state=state,
        continuable=bool(content["continuable"]),
    )


def continue_rounds(
    strategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    first_round: int,
    num_rounds: int,
    timeout: float | None = None,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn=None,
) -> Result:
    """Rounds ``first_round``..``num_rounds`` of Flower's synchronous loop
    (``flwr.serverapp.strategy.Strategy.start``: configure and aggregate training, then
    evaluation, then the server-side ``evaluate_fn``), from ``initial_arrays``, the shared
    parameters after round ``first_round - 1``."""
    train_config = train_config or ConfigRecord()
    evaluate_config = evaluate_config or ConfigRecord()
    result, arrays, started = Result(), initial_arrays, time.time()
    result.arrays = arrays
    log.info("resuming at round %d of %d", first_round, num_rounds)
    for server_round in range(first_round, num_rounds + 1):
        log.info("")
        log.info("[ROUND %s/%s]", server_round, num_rounds)
        replies = grid.send_and_receive(
            messages=strategy.configure_train(server_round, arrays, train_config, grid),
            timeout=timeout,
        )
        new_arrays, train_metrics = strategy.aggregate_train(server_round, replies)
        if new_arrays is not None:
            result.arrays = arrays = new_arrays
        if train_metrics is not None:
            result.train_metrics_clientapp[server_round] = train_metrics
        replies = grid.send_and_receive(
            messages=strategy.configure_evaluate(server_round, arrays, evaluate_config, grid),
            timeout=timeout,
        )
        evaluate_metrics = strategy.aggregate_evaluate(server_round, replies)
        if evaluate_metrics is not None:
            result.evaluate_metrics_clientapp[server_round] = evaluate_metrics
        if evaluate_fn:
            res = evaluate_fn(server_round, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[server_round] = res
    log.log(INFO, "Strategy execution finished in %.2fs", time.time() - started)
    for line in io.StringIO(str(result)):
        log.debug("\t%s", line.strip("\n"))
    return result


def describe(checkpoint: Checkpoint) -> str:
    return f"{checkpoint.path} (after round {checkpoint.round} of {checkpoint.num_rounds})"


def check_arrays(checkpoint: Checkpoint, expected: Mapping[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose arrays are not this model's (names, shapes)."""
    wrong = sorted(
        k
        for k in checkpoint.arrays.keys() | expected.keys()
        if k not in checkpoint.arrays
        or k not in expected
        or tuple(checkpoint.arrays[k].shape) != tuple(expected[k].shape)
    )
    if wrong:
        raise ConfigError(
            f"key 'resume-from' = {str(checkpoint.path)!r}: its shared parameters do not "
            f"match this run's model (e.g. {wrong[:3]})"
        )
