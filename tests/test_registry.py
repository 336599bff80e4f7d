"""The registry collects the algorithm files itself, and everything else reads it: an
algorithm added in a file of its own (here an installed package's, through the entry-point
group ``pflower.algorithms``) is seen by the console, the run config and its check, the
shared tests parametrized over the registry and the docs' key reference, with no edit
anywhere else."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import pflower.strategies as strategies
from pflower.strategies.registry import Algorithm

ROOT = Path(__file__).resolve().parents[1]
PFLOWER = str(Path(sys.executable).with_name("pflower"))

PROBE = '''
"""A probe algorithm: FedAvg under a name of its own, with one key of its own."""

from pydantic import Field

from pflower.settings import Settings
from pflower.strategies.fedavg import FedAvg, FedAvgClient
from pflower.strategies.registry import Algorithm


class ProbeSettings(Settings):
    probe_strength: float = Field(
        1.0, alias="probe-strength", gt=0, description="the probe's own key"
    )


class Probe(FedAvg):
    """The probe's server: FedAvg's mean."""

    serves = ("probe",)


ALGORITHMS = {
    "probe": Algorithm(Probe, FedAvgClient(), "none", "none", settings=(ProbeSettings,))
}
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    """An installed package with one algorithm file: its module and its entry point."""
    site = tmp_path_factory.mktemp("site")
    (site / "probe_algorithm.py").write_text(PROBE)
    info = site / "probe_algorithm-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-algorithm\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pflower.algorithms]\nprobe = probe_algorithm\n")
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "FLWR_TELEMETRY_ENABLED": "0"}


def run(env: dict, *argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(argv), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_package_files_are_collected_in_file_order_and_a_name_is_registered_once():
    modules = [m.__name__ for m in strategies.algorithm_modules()]
    package = [m for m in modules if m.startswith("pflower.strategies.")]
    assert package == sorted(package) and "pflower.strategies.ffgg" in package
    assert "pflower.strategies.server" not in package  # a module without registrations
    assert set(strategies.collect(strategies.algorithm_modules())) == set(strategies.ALGORITHMS)

    class Twice:
        __name__ = "elsewhere"
        ALGORITHMS = {"fedavg": strategies.ALGORITHMS["fedavg"]}

    with pytest.raises(ValueError, match="'fedavg' registered twice"):
        strategies.collect([*strategies.algorithm_modules(), Twice])


def test_a_registration_reads_its_defaults_and_defence_from_the_strategy_class():
    ffgg = strategies.ALGORITHMS["ffgg"]
    assert ffgg.defence is strategies.FFGG.defence and ffgg.defence["robust_aggregator"]
    assert strategies.ALGORITHMS["pflego"].defaults is strategies.PFLEGO.defaults
    entry = Algorithm(strategies.FedAvg, strategies.FedAvgClient())
    assert entry.defaults == {} and entry.defence == {}


def test_an_algorithm_in_a_file_of_its_own_is_seen_everywhere(probe, tmp_path):
    listed = run(probe, PFLOWER, "algorithms")
    assert listed.returncode == 0, listed.stderr
    assert "\nprobe\n" in f"\n{listed.stdout}" and "probe-strength" in listed.stdout
    # the run config: its key parsed and checked where it runs
    code = (
        "from pflower.config import Config, ConfigError\n"
        "cfg = Config.from_run_config({'algorithm': 'probe', 'probe-strength': 2.0})\n"
        "print(cfg.probe_strength)\n"
        "try:\n    Config.from_run_config({'algorithm': 'probe', 'probe-strength': -1})\n"
        "except ConfigError as err:\n    print(err)\n"
    )
    parsed = run(probe, sys.executable, "-c", code)
    assert parsed.returncode == 0, parsed.stderr
    assert parsed.stdout.startswith("2.0\n") and "probe-strength" in parsed.stdout.split("\n")[1]
    # the [tool.flwr.app.config] check: pflower's own pyproject now lacks the probe's key
    checked = run(
        probe,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "tests/test_config.py::test_default_run_config_in_pyproject_parses",
    )
    assert checked.returncode == 1 and "probe-strength" in checked.stdout, checked.stdout[-2000:]
    # ... and an app that declares it passes pflower check-config with it
    app = tmp_path / "app"
    app.mkdir()
    text = (ROOT / "pyproject.toml").read_text()
    marker = "[tool.flwr.app.config]\n"
    (app / "pyproject.toml").write_text(text.replace(marker, marker + "probe-strength = 1.0\n"))
    assert (
        "probe-strength"
        in tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    )
    config = "algorithm='probe' probe-strength=3.0"
    ok = run(probe, PFLOWER, "check-config", str(app), "--run-config", config)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # the docs' key reference, generated from the settings models
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, "docs/hooks")
        import run_config
        rows = [r for r in run_config.key_rows() if r.key == "probe-strength"]
        print(rows[0].algorithms, "probe-strength" in run_config.reference_markdown())
        """
    )
    docs = run(probe, sys.executable, "-c", code)
    assert docs.returncode == 0, docs.stderr
    assert docs.stdout.strip() == "('probe',) True"


def test_the_shared_tests_run_a_new_algorithm(probe):
    """The tests parametrized over the registry take the probe as one of theirs: what crosses
    the wire, a strategy built by hand against the app's, a client served after another."""
    shared = ["tests/test_wire.py", "tests/test_strategy_defaults.py", "tests/test_isolation.py"]
    argv = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
    done = run(probe, *argv, *shared, "-k", "probe", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " 4 passed" in done.stdout or "4 passed" in done.stdout.splitlines()[-1], done.stdout
