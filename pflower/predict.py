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
a new client starts from — and is told so. Algorithms whose personal state is not the
personal parameters themselves (APFL's v and alpha, L2GD's model) store it under their own
keys; this entry point serves the personal-parameter algorithms (FedAlt, FedSim, FFGG with
``ffgg-init = stored``, PFLEGO's head, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from torch import nn

from pflower.config import Config
from pflower.report import SHARED_FILE
from pflower.strategies import build_run_model, wire_split
from pflower.task.split import get_tensors, set_tensors
from pflower.task.state import DirectoryStore

log = logging.getLogger("flwr.pflower")


def run_config(run_dir: str | Path) -> Config:
    data = json.loads((Path(run_dir).expanduser() / "config.json").read_text())
    return Config.from_run_config(data["run-config"])


def personal_model(run_dir: str | Path, state_dir: str | Path | None) -> nn.Module:
    """The run's model with the final shared weights and this device's personal layers."""
    run_dir = Path(run_dir).expanduser()
    cfg = run_config(run_dir)
    torch.manual_seed(cfg.seed)  # the seeded init every client shares, for a new device
    model = build_run_model(cfg)
    split = wire_split(model, cfg)
    shared = torch.load(run_dir / SHARED_FILE, map_location="cpu", weights_only=True)
    missing = set(split.shared) - set(shared)
    if missing:
        raise ValueError(f"{run_dir / SHARED_FILE} lacks shared tensors {sorted(missing)[:3]}")
    set_tensors(model, {k: shared[k] for k in split.shared})
    personal = DirectoryStore(state_dir).load("personal") if state_dir else None
    if personal is None:
        log.warning("no personal layers in %s: using the run's initial ones", state_dir)
    else:
        expected = get_tensors(model, split.personal)
        wrong = [k for k in expected if k not in personal or personal[k].shape != expected[k].shape]
        if wrong:
            raise ValueError(f"personal layers in {state_dir} do not fit this model: {wrong[:3]}")
        set_tensors(model, {k: personal[k] for k in split.personal})
    return model.eval()


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
    model = personal_model(args.run, args.state_dir)
    _, test = load_client_data(
        cfg, args.partition_id, args.num_partitions, data_path=args.data_path
    )
    result = evaluate(model, test, torch.device("cpu"))
    print(json.dumps({k: float(v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
