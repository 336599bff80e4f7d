"""``floor.py`` at two checkouts of pflower, side by side: before and after a change.

On a shared box the CPU seconds of the same round vary by 10-40% from run to run, more than
most per-message changes are worth; one ``floor.py`` run per commit cannot tell them apart.
This runs, per algorithm and repeat, one process at each checkout (the order alternating
between repeats), each doing the bare loop's rounds and then pflower's on ``LocalGrid``
(``floor.bare_round_cpu``, ``floor.pflower_round_cpu`` with ``--breakdown``'s cost centres,
from that checkout's own ``benchmarks/floor.py``), and pools every round of every repeat per
side: the table gives the lower quartile of the pooled rounds (what a round costs when the box
is quiet) and each side's ratio to the bare rounds of its own processes.

    git worktree add /tmp/before <commit>; git worktree add /tmp/after HEAD
    python benchmarks/floor_ab.py /tmp/before /tmp/after --repeats 3 --out results.jsonl

``--unprotected`` is a diagnostic, not a comparison of checkouts: the second side is the
first checkout again with the server's per-reply protections taken out (the update-norm
bound off by run config, ``max-update-norm = 0``; the finiteness check and the float64 mean
patched into a no-op and a float32 sum): what pflower's ratio would be if it protected
nothing, which tells the protections' share of it from the rest of the per-message cost.

    python benchmarks/floor_ab.py . . --unprotected --algorithms fedavg fedalt

``--set-before`` / ``--set-after`` add run-config keys to one side's pflower runs (its bare
loop runs the preset as it is): one checkout against itself under another setting, e.g. a
default defence against the plain mean it replaced (the sides are labelled with their keys).

    python benchmarks/floor_ab.py . . --algorithms ffgg fedavg --set-before robust-aggregator=none

One JSON line per process (``--out``), then a Markdown table on stdout: CPU seconds per
training round and the cost centres in microseconds per message (the median over a process's
rounds, the smallest over its repeats).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ALGORITHMS = ["fedavg", "local", "fedalt", "fedsim", "apfl", "pflego", "ffgg"]

#: run in a fresh process at a checkout: that checkout's floor.py and pflower
ONE_SIDE = """
import json, logging, sys
import torch
root, algorithm, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = json.loads(sys.argv[4])
unprotected = sys.argv[5:] == ["unprotected"]
sys.path[:0] = [root, root + "/benchmarks"]
import floor
torch.set_num_threads(1)
logging.disable(logging.WARNING)
run, nodes = floor.settings("mnist-5c", algorithm, rounds)
if unprotected:  # the diagnostic (module docstring): no bound, no finiteness, float32 mean
    import numpy as np
    from pflower.strategies import admit, combine
    run["max-update-norm"] = 0.0
    admit.all_finite = lambda tensors: True
    def float32_mean(arrays, weights):  # sum_i w_i a_i in the arrays' dtype, as the bare loop
        w = np.asarray(list(weights), dtype=np.float64)
        w = w / w.sum()
        out = {k: np.zeros_like(first) for k, first in arrays[0].items()}
        for wi, a in zip(w, arrays):
            for k, acc in out.items():
                acc += np.float32(wi) * a[k]
        return out
    combine.weighted_mean = float32_mean
bare = floor.bare_round_cpu(run, nodes, rounds)[1:]
ours = floor.pflower_round_cpu({**run, **keys}, nodes, "/tmp/pflower-floor-ab", True)
side = root + (" (unprotected)" if unprotected else "")
side += "".join(f" {k}={v}" for k, v in keys.items())
print(json.dumps({"algorithm": algorithm, "root": side, "bare": bare,
                  "pflower": ours["round"][1:], "train": ours["train"][1:],
                  "outside": ours["client_outside_train"][1:], "centres": ours["centres"][1:],
                  "clients-per-round": max(1, round(run["fraction-train"] * nodes))}))
"""


def one_side(
    root: str, algorithm: str, rounds: int, unprotected: bool = False, keys: dict | None = None
) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ONE_SIDE, root, algorithm, str(rounds), json.dumps(keys or {})]
        + (["unprotected"] if unprotected else []),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_config(items: list[str]) -> dict:
    """KEY=VALUE arguments as run-config values (numbers and booleans as TOML reads them)."""
    import tomllib

    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:  # a bare word: a string
            out[key] = value
    return out


def quartile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def table(rows: list[dict], roots: list[str]) -> str:
    by = collections.defaultdict(list)
    for r in rows:
        by[(r["algorithm"], r["root"])].append(r)
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))

    def pooled(algorithm, root, key):
        return quartile([x for r in by[(algorithm, root)] for x in r[key]])

    lines = [
        "| algorithm | bare (before) | pflower before | ratio before | bare (after) | "
        "pflower after | ratio after | after: training | after: ClientApp outside it | "
        "after: server |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    before, after = roots
    for a in algorithms:
        bb, pb = pooled(a, before, "bare"), pooled(a, before, "pflower")
        ba, pa = pooled(a, after, "bare"), pooled(a, after, "pflower")
        tr, out = pooled(a, after, "train"), pooled(a, after, "outside")
        lines.append(
            f"| {a} | {bb:.4f} | {pb:.4f} | {pb / bb:.2f} | {ba:.4f} | {pa:.4f} | "
            f"**{pa / ba:.2f}** | {tr:.4f} | {out:.4f} | {pa - tr - out:.4f} |"
        )
    centres = list(rows[0]["centres"][0])
    lines += ["", "| algorithm | " + " | ".join(centres) + " |", "|---" * (len(centres) + 1) + "|"]
    for a in algorithms:
        cells = []
        for k in centres:
            us = [
                min(
                    statistics.median(c[k] for c in r["centres"]) * 1e6 / r["clients-per-round"]
                    for r in by[(a, root)]
                )
                for root in roots
            ]
            cells.append(f"{us[0]:.0f} → {us[1]:.0f}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="a checkout of pflower (e.g. a git worktree)")
    p.add_argument("after", help="another checkout")
    p.add_argument("--algorithms", nargs="+", default=ALGORITHMS, choices=ALGORITHMS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=21, help="per process; round 1 is not counted")
    p.add_argument("--out", default=None, help="append each process's JSON line to this file")
    p.add_argument(
        "--unprotected",
        action="store_true",
        help="diagnostic: the second side is the first checkout without the per-reply "
        "protections (module docstring); AFTER is ignored",
    )
    for side in ("before", "after"):
        p.add_argument(
            f"--set-{side}",
            nargs="+",
            default=[],
            metavar="KEY=VALUE",
            help=f"run-config keys for the {side} side's pflower runs",
        )
    args = p.parse_args(argv)
    roots = [str(Path(r).resolve()) for r in (args.before, args.after)]
    keys = [run_config(args.set_before), run_config(args.set_after)]
    sides = [(roots[0], False, keys[0]), (roots[1], False, keys[1])]
    if args.unprotected:
        sides = [(roots[0], False, keys[0]), (roots[0], True, keys[0])]
    rows = []
    for rep in range(args.repeats):
        for algorithm in args.algorithms:
            for root, unprotected, side_keys in sides if rep % 2 == 0 else sides[::-1]:
                row = one_side(root, algorithm, args.rounds, unprotected, side_keys)
                rows.append(row)
                done = f"repeat {rep + 1}: {algorithm} at {row['root']}"
                print(done, file=sys.stderr, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(table(rows, list(dict.fromkeys(r["root"] for r in rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
