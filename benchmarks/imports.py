"""What a device pays to import pflower's ClientApp, and what each install weighs.

Import time: fresh interpreters, alternating, ``import pflower.client_app`` (the device
entry) against ``import torch, flwr.clientapp`` (what any Flower + PyTorch ClientApp
imports); wall seconds of each process and CPU seconds of the child (``RUSAGE_CHILDREN``).
Target: the device entry at most 1.3 x the baseline.

Installed size: the files of every distribution in the dependency closure of the core
install (``pflower``) and of the full app (``pflower[app]``), as installed in this
environment (``importlib.metadata``; a package shared by both counts in both).

    python benchmarks/imports.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import resource
import statistics
import subprocess
import sys
import time
from importlib import metadata

BASELINE = "import torch, flwr.clientapp"
DEVICE = "import pflower.client_app"
HEAVY = ("torchvision", "matplotlib", "ray", "datasets", "pyarrow", "pandas", "sklearn")


def timed(code: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def closure(requirement: str, seen: dict[str, metadata.Distribution]) -> None:
    """Every installed distribution ``requirement`` (``name[extra,...]``) pulls in."""
    match = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", requirement)
    name, extras = match.group(1), {e.strip() for e in (match.group(2) or "").split(",") if e}
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return
    key = dist.metadata["Name"].lower()
    if key in seen and not extras:
        return
    seen[key] = dist
    for req in dist.requires or []:
        spec, _, marker = req.partition(";")
        wanted = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if wanted and not set(wanted) & extras:
            continue
        closure(spec.strip().split(" ")[0], seen)


def size_mb(requirement: str) -> float:
    seen: dict[str, metadata.Distribution] = {}
    closure(requirement, seen)
    total = 0
    for dist in seen.values():
        for file in dist.files or []:
            with contextlib.suppress(OSError):
                total += file.locate().stat().st_size
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-c", DEVICE], check=True)  # warm the file cache
    runs: dict[str, list[tuple[float, float]]] = {BASELINE: [], DEVICE: []}
    for _ in range(args.repeats):
        for code in runs:
            runs[code].append(timed(code))
    probe = f"import sys; {DEVICE}; print([m for m in {HEAVY!r} if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    print(f"{args.repeats} fresh interpreters each, alternating; median seconds")
    print("| import | wall s | CPU s |\n|---|---|---|")
    med = {}
    for code, values in runs.items():
        med[code] = (
            statistics.median(w for w, _ in values),
            statistics.median(c for _, c in values),
        )
        print(f"| `{code}` | {med[code][0]:.2f} | {med[code][1]:.2f} |")
    ratio_wall = med[DEVICE][0] / med[BASELINE][0]
    ratio_cpu = med[DEVICE][1] / med[BASELINE][1]
    print(f"\ndevice entry / baseline: {ratio_wall:.2f}x wall, {ratio_cpu:.2f}x CPU (target 1.3x)")
    print(f"heavy modules the device entry loads: {loaded.stdout.strip()}")
    print("\n| install | installed size (MB) |\n|---|---|")
    for requirement in ("pflower", "pflower[app]"):
        print(f"| `{requirement}` | {size_mb(requirement):,.0f} |")


if __name__ == "__main__":
    main()
