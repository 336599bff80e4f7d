"""Personalized inference on a device: the server's final shared weights + this device's own
personal layers.

A run writes ``outputs/<run>/final-shared.pt`` (the shared parameters) and ``config.json``
(its run config); a SuperNode started with ``state-dir`` keeps its personal layers in
``<state-dir>/personal.pt``. ``personal_model`` puts the two together into the run's model::

    from pflower.predict import personal_model
    model = personal_model("outputs/20261121-120000-fedalt", "/var/lib/pflower/state")
    logits = model(x)

or, from a shell, evaluated on the device's own test split (its node config's partition)::

    python -m pflower.predict --run outputs/20261121-120000-fedalt \\
        --state-dir /var/lib/pflower/state --partition-id 0 --num-partitions 2

A device without stored layers (it never trained) gets the run's seeded personal init — what
a new client starts from — and is told so.

**Only the run's own state.** Every entry a device stores records what wrote it
(``pflower.context_store``: the scope — experiment, algorithm, model, data set, partition,
the personal part's layout — and the server's run tag and round); the run's ``config.json``
records its run tag. The shared weights of run A with the layers of a later run B, or of
another experiment, make a model neither run trained, and score like one: so the layers
loaded are the newest version run A wrote on this device (its ``personal.pt``, or the
version before it, ``personal.prev.pt``, if a later run of the same scope has written since),
and a device holding none is refused with ``StateMismatch``, naming what the run expects and
what the device holds. A run directory from before the tag was recorded is matched by scope
alone, with a warning. Algorithms whose personal state is not the
personal parameters themselves (APFL's v and alpha, L2GD's model) store it under their own
keys; this entry point serves the personal-parameter algorithms (FedAlt, FedSim, FFGG with
``ffgg-init = stored``, PFLEGO's head, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from pflower.config import Config
from pflower.context_store import Scope, StoredEntry, describe_scope, stored_entries
from pflower.report import SHARED_FILE
from pflower.strategies import build_run_model, wire_split
from pflower.strategies.client import PERSONAL
from pflower.task.split import get_tensors, set_tensors
from pflower.task.state import DirectoryStore

log = logging.getLogger("flwr.pflower")

#: ``config.json`` of a run from before the run tag was recorded: matched by scope alone
UNRECORDED = object()


class StateMismatch(ValueError):
    """The device holds no personal state written by the run whose shared weights were asked
    for (another run's, another experiment's, or state without a record of its writer)."""


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())


def run_config(run_dir: str | Path) -> Config:
    return Config.from_run_config(_record(Path(run_dir).expanduser())["run-config"])


def personal_model(
    run_dir: str | Path,
    state_dir: str | Path | None,
    partition_id: int | None = None,
    num_partitions: int | None = None,
) -> nn.Module:
    """The run's model with the final shared weights and this device's personal layers,
    those the run itself wrote (module docstring; else ``StateMismatch``). ``partition_id``
    and ``num_partitions`` (the device's node config) are part of the scope when given."""
    run_dir = Path(run_dir).expanduser()
    record = _record(run_dir)
    cfg = Config.from_run_config(record["run-config"])
    torch.manual_seed(cfg.seed)  # the seeded init every client shares, for a new device
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    shared = torch.load(run_dir / SHARED_FILE, map_location="cpu", weights_only=True)
    missing = set(split.shared) - set(shared)
    if missing:
        raise ValueError(f"{run_dir / SHARED_FILE} lacks shared tensors {sorted(missing)[:3]}")
    set_tensors(model, {k: shared[k] for k in split.shared})
    expected = get_tensors(model, split.personal)
    partition = None if partition_id is None else f"{partition_id}/{num_partitions}"
    run = record.get("run-tag", UNRECORDED)
    personal = (
        run_personal(run_dir, state_dir, cfg, run, expected, partition) if state_dir else None
    )
    if personal is None:
        log.warning("no personal layers in %s: using the run's initial ones", state_dir)
    else:
        wrong = [k for k in expected if k not in personal or personal[k].shape != expected[k].shape]
        if wrong:
            raise ValueError(f"personal layers in {state_dir} do not fit this model: {wrong[:3]}")
        set_tensors(model, {k: personal[k] for k in split.personal})
    return model.eval()


def run_personal(
    run_dir: Path,
    state_dir: str | Path,
    cfg: Config,
    run: object,
    template: dict[str, torch.Tensor],
    partition: str | None,
) -> dict[str, torch.Tensor] | None:
    """The newest personal layers in ``state_dir`` that run ``run`` (its tag; ``UNRECORDED``:
    any run) of ``cfg``'s scope wrote; ``None`` if the device stores none at all (it never
    trained); ``StateMismatch`` if it stores only others'."""
    unreadable: dict[str, str] = {}
    entries = stored_entries(DirectoryStore(state_dir), PERSONAL, unreadable)
    for slot, why in unreadable.items():
        log.warning("personal state %r in %s is unreadable (%s)", slot, state_dir, why)
    if not entries:
        return None
    # the device's partition is whatever it trained on unless the caller names it
    scope = {**asdict(Scope.of(cfg, 0, 0, template)), "partition": partition}
    untagged = run is UNRECORDED
    if untagged:
        log.warning(
            "%s records no run tag (written by an older pflower): the personal layers are "
            "matched by their scope alone, not by the run that wrote them",
            run_dir / "config.json",
        )

    def written_by_this_run(entry: StoredEntry) -> bool:
        stored = entry.scope
        if stored is None or set(stored) != set(scope):
            return False
        if any(v is not None and stored[k] != v for k, v in scope.items()):
            return False
        return untagged or entry.run == (run or "")

    ours = [e for e in entries if written_by_this_run(e)]
    if not ours:
        wanted = "any run" if untagged else f"run {run or '(untagged)'}"
        described = describe_scope({**scope, "partition": partition or "any"})
        raise StateMismatch(
            f"the personal layers in {state_dir} were not written by the run of {run_dir}: "
            f"it expects {wanted}, {described}; the device holds "
            + "; and ".join(f"{e.slot!r} of {e.describe()}" for e in entries)
            + ". Predict with the run that trained this device's layers (its outputs "
            "directory), or leave state-dir out to use the run's initial personal layers"
        )
    chosen = max(ours, key=lambda e: e.round)
    if chosen is not entries[0]:
        log.warning(
            "the newest personal layers in %s were written by %s; using %r, this run's of round %d",
            state_dir,
            entries[0].describe(),
            chosen.slot,
            chosen.round,
        )
    return chosen.tensors


def main(argv: list[str] | None = None) -> None:
    from pflower.task.data import load_client_data
    from pflower.task.train import evaluate

    parser = argparse.ArgumentParser(prog="python -m pflower.predict", description=__doc__)
    parser.add_argument("--run", required=True, help="the run's output directory")
    parser.add_argument("--state-dir", default=None, help="this device's state-dir")
    parser.add_argument("--partition-id", type=int, required=True)
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument("--data-path", default=None, help="this device's data (dataset 'node')")
    args = parser.parse_args(argv)
    cfg = run_config(args.run)
    try:
        model = personal_model(args.run, args.state_dir, args.partition_id, args.num_partitions)
    except StateMismatch as err:  # the message says it all: no traceback
        parser.exit(2, f"{parser.prog}: {err}\n")
    _, test = load_client_data(
        cfg, args.partition_id, args.num_partitions, data_path=args.data_path
    )
    result = evaluate(model, test, torch.device("cpu"))
    print(json.dumps({k: float(v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
