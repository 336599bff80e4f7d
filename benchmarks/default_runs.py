"""Every algorithm's default run: the app's default config (``[tool.flwr.app.config]`` in
pyproject.toml) with only ``algorithm`` changed, as ``flwr run . --run-config
"algorithm='X'"`` runs it, here on a ``LocalGrid`` of 10 nodes (the README's
``num-supernodes=10``; same trajectories as the simulation engine).

    python benchmarks/default_runs.py                       # every algorithm, ~5 min
    python benchmarks/default_runs.py --algorithms pflego apfl
    python benchmarks/default_runs.py --set classes-per-client=5 \
        --out benchmarks/results/default-runs-5c.md   # the tests' second setting

Writes a Markdown table (personalized / the personal part alone / global pooled test
accuracy, APFL's alpha over the clients, rounds, seconds) to
``benchmarks/results/default-runs.md``. The sample is pinned to ``sample-seed`` 0 (the stream
the table was measured with), so that the table reproduces; ``flwr run .`` samples in secret
(``sample-seed = -1``, the default) and its numbers vary from run to run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import time
import tomllib
from pathlib import Path

from pflower.config import ALGORITHMS
from pflower.testbed.local_grid import run_local

ROOT = Path(__file__).resolve().parent.parent
#: the one key each of these needs besides the default run's (refused at start otherwise)
NEEDS = {"l2gd": {"fraction-train": 1.0}, "async-ffgg": {"pretrain-rounds": 0}}


def default_config() -> dict:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(pyproject["tool"]["flwr"]["app"]["config"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS))
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/default-runs.md"))
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE",
        help="run-config keys on top of the default run (TOML values), e.g. classes-per-client=5",
    )  # fmt: skip
    args = parser.parse_args()
    extra = tomllib.loads("\n".join(args.set))  # "k=v" lines are TOML
    logging.disable(logging.CRITICAL)
    rows = [
        "| algorithm | personalized (%) | local part alone (%) | global (%) | α mean [min, max] "
        "| rounds | seconds (wall) | CPU s | ε spent | rounds run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm in args.algorithms:
        config = {
            **default_config(),
            "algorithm": algorithm,
            "sample-seed": 0,  # a reproducible table (flwr run . samples in secret)
            "outputs-dir": "/tmp/pflower-defaults",
            **extra,
        }
        config.update(NEEDS.get(algorithm, {}))
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # each run's own summary table
                report = run_local(config, args.nodes)
        except Exception as err:  # noqa: BLE001 - a table row says what happened
            rows.append(f"| {algorithm} | error: {err} | | | | | | | | |")
            print(rows[-1], flush=True)
            continue
        final = report.final
        pers = 100 * final.get("personal-accuracy", float("nan"))
        glob = 100 * final.get("global-accuracy", float("nan"))
        part = 100 * final.get("local-part-accuracy", float("nan"))
        alpha = (
            f"{final['alpha-mean']:.2f} [{final['alpha-min']:.2f}, {final['alpha-max']:.2f}]"
            if "alpha-mean" in final
            else "–"
        )
        rounds = f"{report.cfg.pretrain_rounds} + {report.cfg.num_server_rounds}"
        if algorithm in NEEDS:
            rounds += " (" + ", ".join(f"{k}={v}" for k, v in NEEDS[algorithm].items()) + ")"
        # under DP, the ε the run spent (its last training round's accounting)
        spent = [r.train for r in report.rounds if "dp-epsilon" in r.train]
        eps = f"{spent[-1]['dp-epsilon']:.3g}" if spent else "–"
        rows.append(
            f"| {algorithm} | {pers:.2f} | {part:.2f} | {glob:.2f} | {alpha} | {rounds} | "
            f"{time.perf_counter() - wall:.1f} | {time.process_time() - cpu:.1f} | {eps} | "
            f"{len(report.rounds)} |"
        )
        print(rows[-1], flush=True)
    said = f"the default run with {', '.join(args.set)}" if args.set else "the default run"
    table = f"{said}, {args.nodes} nodes, LocalGrid\n\n" + "\n".join(rows)
    print("\n" + table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
