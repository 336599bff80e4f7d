"""Every algorithm's default run learns: the app's default config (pyproject.toml) with only
``algorithm`` changed, as ``flwr run . --run-config "algorithm='X'"`` runs it (10 nodes,
offline MNIST-5k, 2 classes per client), here on a ``LocalGrid`` (same trajectories as the
simulation engine, ``test_local_grid.py``); and the same with 5 classes per client, where
collaboration matters more. ``benchmarks/default_runs.py`` prints the tables
(``benchmarks/results/default-runs.md``, ``default-runs-5c.md``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pflower.config import ALGORITHMS, ConfigError
from pflower.testbed.local_grid import run_local

DEFAULT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["flwr"][
    "app"
]["config"]
#: the app samples clients in secret (sample-seed = -1), so a default run's numbers vary; these
#: floors hold for the sample they were measured on (benchmarks/default_runs.py pins it too).
#: Under secret samples async-ffgg reached 84.68% (floor 85%) and APFL with 5 classes 90.18%
#: personalized for 81.16% global (margin 10 points) in one run each (2026-11-27); the secret path
#: itself is tested in test_sampling.py
PINNED = {"sample-seed": 0}
#: not personalized: the personalized model is the global one
GLOBAL_ONLY = {"fedavg", "fedprox", "local-gd", "scaffold"}
#: need one key the default run sets otherwise; refused at start with that key named
NEEDS = {
    "l2gd": ({"fraction-train": 1.0}, "fraction-train"),
    "async-ffgg": ({"pretrain-rounds": 0}, "pretrain-rounds"),
}
#: how far a default personalized model may fall below its own personal part alone
#: (``local-part``: APFL's v, a head method's stored head as trained) before it counts as
#: degenerate (issue 47: APFL's alpha at 0 made it the global model, 58.96% against v's ~90%)
PART_MARGIN = 0.02


def below_its_own_part(final: dict) -> float:
    """How far (accuracy) the pooled personalized model falls below the personal part alone;
    0 where it does not, or where the algorithm has no such part."""
    if "local-part-accuracy" not in final:
        return 0.0
    return max(0.0, final["local-part-accuracy"] - final["personal-accuracy"])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_default_run_learns(algorithm, tmp_path):
    config = {**DEFAULT, **PINNED, "algorithm": algorithm, "outputs-dir": str(tmp_path)}
    if algorithm in NEEDS:
        extra, key = NEEDS[algorithm]
        with pytest.raises(ConfigError, match=f"'{key}'"):
            run_local(config, 10)
        config.update(extra)
    report = run_local(config, 10)
    evaluated = [r.evaluate for r in report.rounds if r.evaluate]
    final = report.final
    assert report.dropped == 0
    # chance is 1/2 on a client's own two classes, 1/10 for a global model
    floor = 0.35 if algorithm in GLOBAL_ONLY else 0.85
    assert final["personal-accuracy"] > floor, final
    assert below_its_own_part(final) <= PART_MARGIN, final
    assert final["personal-loss"] < evaluated[0]["personal-loss"] or len(evaluated) == 1
    if algorithm not in GLOBAL_ONLY | {"local", "pflego"}:
        # PFLEGO's "global" is a new client that fits its own head first: itself personal
        assert final["personal-accuracy"] > final["global-accuracy"] + 0.2, final


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_default_run_learns_on_five_classes_per_client(algorithm, tmp_path):
    """The second setting (issue 28): the default run with ``classes-per-client = 5``, so the
    defaults learn beyond the 2-class run they were chosen on (APFL's per-step decay did
    not). Measured (benchmarks/results/default-runs-5c.md): personalized 54-94%, global-only
    methods 73-84%; chance is 1/5 on a client's own classes, 1/10 for a global model."""
    config = {
        **DEFAULT,
        **PINNED,
        "algorithm": algorithm,
        "classes-per-client": 5,
        "outputs-dir": str(tmp_path),
        **(NEEDS[algorithm][0] if algorithm in NEEDS else {}),
    }
    report = run_local(config, 10)
    final = report.final
    assert report.dropped == 0
    floor = 0.5 if algorithm in GLOBAL_ONLY else 0.45
    assert final["personal-accuracy"] > floor, final
    assert below_its_own_part(final) <= PART_MARGIN, final
    if algorithm not in GLOBAL_ONLY | {"local", "pflego"}:
        assert final["personal-accuracy"] > final["global-accuracy"] + 0.1, final


def test_apfl_default_learns_alpha_without_pretraining(tmp_path):
    """Issue 47: the default run with only ``algorithm = "apfl"`` and no pre-training, 10
    rounds, reaches 80% personalized, at least its fixed-alpha (0.5) run, and not below its
    own v alone; with Algorithm 1's mixing of the moving w_i (``apfl-mix-with = "local"``)
    alpha collapses to 0 on some clients and the personalized model falls below v alone by
    more than the margin: the check above catches such a default (measured: 58.96%)."""
    config = {
        **DEFAULT,
        **PINNED,  # three runs compared: the same sample
        "algorithm": "apfl",
        "pretrain-rounds": 0,
        "outputs-dir": str(tmp_path),
    }
    learned = run_local(config, 10).final
    fixed = run_local({**config, "apfl-adaptive": False}, 10).final
    assert learned["personal-accuracy"] >= 0.80, learned
    assert learned["personal-accuracy"] >= fixed["personal-accuracy"], (learned, fixed)
    assert below_its_own_part(learned) <= PART_MARGIN, learned
    assert learned["alpha-min"] > 0, learned
    paper = run_local({**config, "apfl-mix-with": "local"}, 10).final
    assert paper["alpha-min"] == 0.0, paper
    assert below_its_own_part(paper) > PART_MARGIN, paper
