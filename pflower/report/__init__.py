"""Run outputs: ``<outputs-dir>/<timestamp>-<algorithm>/`` (``outputs_root``: a relative
``outputs-dir`` against the working directory in process, against ``~/pflower`` under
``flwr run``) and the summary table.

- ``config.json``: the run config (flat dashed keys), the split actually used, the run tag
  the devices stamp the personal state of this run with (``pflower.predict`` loads only
  that), and what produced the run: pflower / flwr / torch / Python versions, the git commit
  of pflower's source tree if it is one, the hash of the FAB under ``flwr run``, the machine;
- ``results.json``: per round: train aggregates, evaluate aggregates, dropped replies with
  reasons, seconds, array bytes sent and received (``wire``); and the final evaluation;
- ``clients.csv``: final per-client personalized and global metrics;
- ``accuracy.png``: pooled personalized/global test accuracy per evaluated round with the
  p10..p90 band over clients, and the training loss of every round beside the test losses;
  a vertical line where pre-training ends;
- ``clients.png``: each client's personalized against its global accuracy (hurt clients
  marked);
- ``labels.png``: the label counts of every client's partition (flwr-datasets);
- ``split-diagnostic.png`` (FFGG family): mean and max ||Delta_m|| per round.
"""

from __future__ import annotations

from pflower.report.plots import LABEL_PLOT_MAX_CLIENTS
from pflower.report.results import (
    FAB_OUTPUTS_HOME,
    SHARED_FILE,
    RunReport,
    output_dir,
    outputs_root,
    provenance,
    resolve,
    write,
)
from pflower.report.terminal import (
    console,
    human_bytes,
    loss_note,
    round_line,
    summary_table,
    wire_per_round,
)
from pflower.report.tracking import Tracker

__all__ = [
    "FAB_OUTPUTS_HOME",
    "LABEL_PLOT_MAX_CLIENTS",
    "SHARED_FILE",
    "RunReport",
    "Tracker",
    "console",
    "human_bytes",
    "output_dir",
    "outputs_root",
    "provenance",
    "resolve",
    "loss_note",
    "round_line",
    "summary_table",
    "wire_per_round",
    "write",
]
