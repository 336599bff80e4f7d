"""A run's files: ``config.json`` (with what produced it), ``results.json``, ``clients.csv``,
``final-shared.pt``, and the plots (``plots.py``), in a new output directory.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pflower.report.plots import (
    _plot_clients,
    _plot_convergence,
    _plot_diagnostic,
    _plot_labels,
    _plot_rounds,
)

if TYPE_CHECKING:
    from pflower.config import Config

log = logging.getLogger("flwr.pflower")


@dataclasses.dataclass
class RunReport:
    """What a run produced, in the form the files and the table are written from."""

    cfg: Config
    split: str
    num_nodes: int
    rounds: list  # of RoundLog
    clients: list[dict]
    seconds: float
    #: the final shared parameters (saved as ``final-shared.pt``), if known
    shared: dict | None = None
    #: where ``write`` put the files
    path: Path | None = None
    #: the server's run tag, with which the devices stamp the personal state this run wrote
    #: (``context_store``): ``pflower.predict`` pairs the shared weights with that state only
    run_tag: str = ""
    #: the SHA-256 hash of the FAB the run came from (``flwr run``), "" for a run in process
    fab_hash: str = ""
    #: the generator clients were sampled from: its seed (secret unless ``sample-seed`` >= 0,
    #: so in ``results.json``, the server's own file, and never in ``config.json``; under
    #: ``dp`` not there either: ``released_sampling``), whether it was secret, its kind
    #: (``strategies.nodes.sample_stream``)
    sampling: dict | None = None
    #: the nodes the start-up handshake refused: node, partition id, reason
    refused: list = dataclasses.field(default_factory=list)

    @property
    def final(self) -> dict:
        evaluated = [r.evaluate for r in self.rounds if r.evaluate]
        return evaluated[-1] if evaluated else {}

    @property
    def privacy(self) -> dict | None:
        """The run's differential privacy as spent (``dp`` not ``none``): mode, clip, noise
        multiplier, (epsilon, delta) after the last training round (epsilon ``None``: clipping
        only, no guarantee; the tightest valid accountant's), each accountant's epsilon for
        the run's sampling and neighbour relation, for a fixed-size sample the Poisson
        accounting of the same rounds as a comparison, and the canary estimate if asked."""
        spent = [r.train for r in self.rounds if "dp-epsilon" in r.train]
        if self.cfg.dp == "none" or not spent:
            return None
        last = spent[-1]
        amplified = bool(last.get("dp-amplified", 1.0))
        by_accountant = {
            k.removeprefix("dp-epsilon-"): v for k, v in last.items() if k.startswith("dp-epsilon-")
        }
        if self.cfg.dp == "local":
            sampling = "no amplification, per client (the most sampled), replace-one neighbours"
        elif self.cfg.dp_sampling == "poisson":
            sampling = (
                "Poisson (each client with probability fraction-train), add/remove neighbours"
            )
        else:
            sampling = "fixed-size sample without replacement, replace-one neighbours"
        if self.cfg.dp == "central" and not amplified:
            sampling += (
                "; the sample is reproducible: no amplification, each client's rounds "
                "composed, the most sampled client's"
            )
        out = {
            "mode": self.cfg.dp,
            "epsilon": _finite(last["dp-epsilon"]),
            "delta": self.cfg.dp_delta,
            "noise-multiplier": last["dp-noise"],
            "clip": last["dp-clip"],
            "adaptive-clip": self.cfg.dp_adaptive_clip,
            "training-rounds": len(spent),
            "sampling": sampling,
            "amplified": amplified and self.cfg.dp == "central",
            "accountant": "dp-accounting, the tightest of: "
            + ", ".join(k for k in by_accountant if not k.startswith("poisson-")),
            "epsilon-by-accountant": {
                k: _finite(v) for k, v in by_accountant.items() if not k.startswith("poisson-")
            },
        }
        compared = {
            k.removeprefix("poisson-"): _finite(v)
            for k, v in by_accountant.items()
            if k.startswith("poisson-")
        }
        if compared:
            out["comparison-poisson-add-remove"] = {
                **compared,
                "note": "the same rounds had each client been sampled on its own coin at q = m / N "
                "(dp-sampling = 'poisson'); not this run's guarantee",
            }
        if "dp-canary-epsilon" in last:
            out["canary-epsilon"] = _finite(last["dp-canary-epsilon"])
            out["canaries"] = self.cfg.dp_canaries
        return out

    @property
    def released_sampling(self) -> dict | None:
        """``sampling`` as ``results.json`` holds it. Under ``dp`` a secret sample's seed is
        withheld: it replays who was sampled in every round, and the accountant's
        amplification by sampling assumes that no one who sees the released model knows
        that (the checkpoints, the server's own state, still hold it). A
        reproducible sample's seed is in the run config anyway (and accounted without
        amplification)."""
        if self.sampling is None or self.cfg.dp == "none" or not self.sampling.get("secret"):
            return self.sampling
        return {**self.sampling, "seed": None, "seed-withheld": WITHHELD}

    @property
    def dropped(self) -> int:
        return sum(sum(r.dropped.values()) for r in self.rounds)


#: why a dp run's ``results.json`` holds no sampling seed (``RunReport.released_sampling``)
WITHHELD = (
    "dp: the secret sample's seed would tell who was sampled in every round, which the "
    "accountant's amplification assumes no one knows; the checkpoints (the server's own) hold it"
)
SHARED_FILE = "final-shared.pt"
#: clients.csv's column of a client's test examples (its evaluation's ``num-examples``): beside
#: ``num-train``, a column named ``num-examples`` would not say which examples it counts
NUM_TEST = "num-test"


def provenance(fab_hash: str = "") -> dict:
    """What produced a run: versions, pflower's git commit (None outside a checkout), the
    hash of the FAB the run came from (None for a run in process), the machine. Under
    ``flwr run`` the code runs from Flower's installed copy of the FAB, not a checkout, so
    there is no git commit and the FAB's hash (``flwr ls`` lists it with the run) is what
    identifies the code."""
    import platform
    import subprocess

    import pflower
    from pflower.flower import flower_version

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(pflower.__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "pflower": pflower.__version__,
        "flwr": flower_version(),  # the module's own: flwr-nightly installs it as flwr
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git-commit": commit,
        "fab-hash": fab_hash or None,
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
    }


#: where a relative ``outputs-dir`` resolves for a run from a FAB (``flwr run``): Flower runs
#: the ServerApp in the working directory of the SuperLink that took the run, which may be
#: any project's (the one ``flwr run`` first started the local SuperLink in), so the working
#: directory is no place to look for results
FAB_OUTPUTS_HOME = Path("~/pflower")


def outputs_root(cfg: Config, fab_hash: str = "") -> Path:
    """The directory that holds a run's output directories: ``outputs-dir`` when absolute;
    a relative one against the working directory for a run in process (``pflower
    experiment``, ``run_local``: where the command was typed), against ``FAB_OUTPUTS_HOME``
    for a run from a FAB (``fab_hash`` set: ``flwr run``)."""
    return resolve(cfg.outputs_dir, fab_hash)


def resolve(path: str | os.PathLike, fab_hash: str = "") -> Path:
    """A path a user gave a run (``outputs-dir``, ``resume-from``), resolved as the run's
    outputs are: as it is when absolute; a relative one against the working directory for a
    run in process, against ``FAB_OUTPUTS_HOME`` for a run from a FAB (``flwr run``). So
    ``resume-from='outputs/<run>'`` finds the directory ``outputs-dir = "outputs"`` made."""
    resolved = Path(path).expanduser()
    if not resolved.is_absolute() and fab_hash:
        resolved = FAB_OUTPUTS_HOME.expanduser() / resolved
    return resolved.resolve()


def output_dir(cfg: Config, fab_hash: str = "") -> Path:
    """A new directory ``<outputs_root>/<timestamp>-<algorithm>`` for one run."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = outputs_root(cfg, fab_hash) / f"{stamp}-{cfg.algorithm}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = path.with_name(f"{stamp}-{cfg.algorithm}-{suffix}")
    path.mkdir(parents=True)
    return path


def write(report: RunReport, out: Path | None = None) -> Path:
    """Write every output file (into ``out``, or a new output directory); return it."""
    out = out or output_dir(report.cfg)
    report.path = out
    if report.shared is not None:  # what a device loads next to its personal layers
        torch.save(report.shared, out / SHARED_FILE)
    (out / "config.json").write_text(
        json.dumps(
            {
                "run-config": report.cfg.to_flat(),
                "seed": report.cfg.seed,
                "split": report.split,
                "num-nodes": report.num_nodes,
                "run-tag": report.run_tag or None,
                "produced-by": provenance(report.fab_hash),
            },
            indent=2,
        )
    )
    (out / "results.json").write_text(
        json.dumps(
            {
                "rounds": [dataclasses.asdict(r) for r in report.rounds],
                "final": report.final,
                "dropped-replies": report.dropped,
                "seconds": report.seconds,
                "privacy": report.privacy,
                "sampling": report.released_sampling,
                "refused-nodes": report.refused,
            },
            indent=2,
        )
    )
    if report.clients:
        by_partition = sorted(report.clients, key=lambda r: r.get("partition-id", 0))
        rows = [_csv_row(client) for client in by_partition]
        keys = sorted({k for row in rows for k in row}, key=_column_order)
        with open(out / "clients.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    try:  # plots are the one optional output: the extra 'plots' (in 'app') draws them
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        log.warning("pflower: no plots (matplotlib missing: pip install 'pflower[plots]')")
        return out
    _plot_rounds(report, out / "accuracy.png")
    _plot_clients(report, out / "clients.png")
    _plot_labels(report, out / "labels.png")
    if any("grad-norm-mean" in r.train for r in report.rounds):
        _plot_diagnostic(report, out / "split-diagnostic.png")
    if any("theta-error" in r.server for r in report.rounds):
        _plot_convergence(report, out / "convergence.png")
    return out


def _finite(value: float) -> float | None:
    """An epsilon for JSON: ``None`` for infinity (no guarantee)."""
    return None if value == float("inf") else value


def _csv_row(client: dict) -> dict:
    """A client's final metrics as clients.csv names them (``NUM_TEST``)."""
    return {(NUM_TEST if k == "num-examples" else k): v for k, v in client.items()}


def _column_order(key: str) -> tuple[int, str]:
    first = ["partition-id", "num-train", NUM_TEST, "personal-accuracy", "global-accuracy"]
    return (first.index(key), key) if key in first else (len(first), key)
