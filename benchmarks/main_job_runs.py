"""The README's main job as a user runs it, several times: ``pflower run .`` through Flower's
simulation engine (the app samples each round's clients in secret, so every run samples
others and its figures vary), each run's final pooled accuracy (personalized / global) from
its own results file, and a Markdown table of them with the commit and the command.

    python benchmarks/main_job_runs.py --runs 3 --out benchmarks/results/main-job-runs.md
    python benchmarks/main_job_runs.py --runs 1 --run-config "sample-seed=0"

A run that does not exit 0 is a row that says so (its last line); the table is written all
the same.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the line ``pflower run`` ends a completed run with: where its results went
RESULTS = re.compile(r"^results: (\S+)\s*$", re.MULTILINE)


def pflower() -> str:
    """This environment's ``pflower`` console script."""
    here = Path(sys.executable).parent / "pflower"
    return str(here) if here.exists() else (shutil.which("pflower") or "pflower")


def one_run(run_config: list[str]) -> dict:
    """One ``pflower run .``: its exit code, wall seconds and final figures (from the run's
    ``results.json``: ``final``), or its last output line where there are none."""
    command = [pflower(), "run", "."]
    for item in run_config:
        command += ["--run-config", item]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    row = {"exit": done.returncode, "wall-s": round(time.perf_counter() - started, 1)}
    found = RESULTS.findall(done.stdout)
    results = Path(found[-1]) / "results.json" if found else None
    if done.returncode == 0 and results is not None and results.is_file():
        final = json.loads(results.read_text()).get("final", {})
        row.update(
            {
                "results": str(results.parent),
                "personal-accuracy": final.get("personal-accuracy"),
                "global-accuracy": final.get("global-accuracy"),
            }
        )
    else:
        tail = (done.stderr or done.stdout).strip().splitlines()
        row["last-line"] = tail[-1] if tail else ""
    return row


def table(rows: list[dict], run_config: list[str]) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    command = "pflower run ." + "".join(f' --run-config "{c}"' for c in run_config)
    lines = [
        f"`{command}`, {len(rows)} runs, {datetime.date.today()}, commit {commit}, "
        f"{platform.platform()}, {platform.python_version()}:",
        "",
        "| run | exit | personalized (%) | global (%) | wall s | results |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        if "personal-accuracy" in r:
            pers = f"{100 * r['personal-accuracy']:.2f}"
            glob = f"{100 * r['global-accuracy']:.2f}"
            where = r["results"]
        else:
            pers = glob = "–"
            where = r.get("last-line", "")
        lines.append(f"| {i} | {r['exit']} | {pers} | {glob} | {r['wall-s']} | {where} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--run-config", action="append", default=[], help="as for pflower run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for _ in range(args.runs):
        rows.append(one_run(args.run_config))
        print(json.dumps(rows[-1]), flush=True)
    text = table(rows, args.run_config)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
