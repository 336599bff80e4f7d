"""The distribution: ``python -m build`` makes a wheel and an sdist whose metadata says what
pflower needs (ranges, extras), whose version is the one in pyproject.toml, whose
wheel holds the package and nothing else, and that ``twine check`` accepts."""

from __future__ import annotations

import email
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: build with the hatchling of the test environment (no index needed)
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _metadata(dist: Path) -> email.message.Message:
    (wheel,) = dist.glob("pflower-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(zf.read(name))


def test_the_version_lives_in_pyproject_only(dist):
    import pflower

    version = _project()["version"]
    assert _metadata(dist)["Version"] == version
    assert pflower.__version__ == version  # read from the installed metadata
    assert (dist / f"pflower-{version}.tar.gz").exists()


def test_metadata_has_ranges_and_every_extra(dist):
    meta = _metadata(dist)
    assert meta["Name"] == "pflower"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().startswith("# pflower")  # the README is the long description
    requires = meta.get_all("Requires-Dist")
    pinned = [r for r in requires if "==" in r.split(";")[0]]
    assert not pinned, f"exact pins (ranges only; pins go to constraints.txt): {pinned}"
    core = [r.split(">")[0].split("<")[0].strip() for r in requires if "extra ==" not in r]
    assert {"flwr", "torch", "numpy", "pydantic"} <= set(core)
    # the device install carries none of the optional stacks
    optional = {"torchvision", "matplotlib", "ray", "mlxtend", "scikit-learn"}
    assert not (optional | {"datasets", "flwr-datasets"}) & set(core)
    extras = set(meta.get_all("Provides-Extra"))
    assert {"data", "simulation", "vision", "offline", "plots", "app", "test"} <= extras


def test_the_wheel_holds_the_package_and_nothing_else(dist):
    (wheel,) = dist.glob("pflower-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    source = {str(p.relative_to(ROOT)) for p in (ROOT / "pflower").rglob("*.py")}
    assert source <= names, sorted(source - names)
    outside = {n for n in names if not n.startswith(("pflower/", "pflower-"))}
    assert not outside, sorted(outside)


def test_the_sdist_builds_again_with_its_changelog(dist):
    (sdist,) = dist.glob("pflower-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "constraints.txt"} <= names
    assert "pflower/client_app.py" in names
    assert not any(n.startswith(("outputs/", "deploy/", ".venv/")) for n in names)


def test_twine_accepts_the_wheel_and_the_sdist(dist):
    """What PyPI would check on upload: the metadata and the README renders (--strict: a
    warning, e.g. a missing long-description content type, fails too)."""
    files = sorted(str(p) for p in dist.iterdir())
    assert len(files) == 2, files
    cmd = [sys.executable, "-m", "twine", "check", "--strict", *files]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_every_run_records_what_produced_it(tmp_path):
    import json

    import flwr
    import torch

    import pflower
    from pflower.testbed.local_grid import run_local

    run = {"dataset": "digits", "partitioner": "iid", "num-server-rounds": 1}
    report = run_local({**run, "outputs-dir": str(tmp_path)}, 2)
    produced = json.loads((report.path / "config.json").read_text())["produced-by"]
    assert produced["pflower"] == pflower.__version__ == _project()["version"]
    assert produced["flwr"] == flwr.__version__ and produced["torch"] == torch.__version__
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert produced["git-commit"] == (commit.stdout.strip() or None)
    assert "CPUs" in produced["machine"]
