"""Config: defaults parse, bad values fail at start naming key, value and what is allowed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pflower.config import ALGORITHMS, Config, ConfigError
from pflower.strategies import ALGORITHMS as REGISTERED

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def test_default_run_config_in_pyproject_parses():
    run_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    cfg = Config.from_run_config(run_config)
    assert cfg.dataset == "mnist-5k"  # offline by default
    # every key is listed: `flwr run --run-config` refuses keys that are not
    assert set(run_config) == set(cfg.to_flat())


def test_every_config_algorithm_is_registered():
    assert set(ALGORITHMS) == set(REGISTERED)


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("algorithm", "fedavgg", "'fedavg'"),
        ("model", "resnet50", "'resnet18-gn'"),
        ("split", "tail", "'head'"),
        ("dataset", "cifar10", "hf:"),
        ("partitioner", "shards", "'dirichlet'"),
        ("class-assignment", "greedy", "'random'"),
        ("device", "tpu", "'cuda'"),
        ("fraction-train", 0.0, "greater than 0"),
        ("fraction-train", 1.5, "less than or equal to 1"),
        ("fraction-evaluate", -0.1, "greater than 0"),
        ("num-server-rounds", 0, "greater than or equal to 1"),
        ("lr", 0.0, "greater than 0"),
        ("lr", -1.0, "greater than 0"),
        ("batch-size", 0, "greater than or equal to 1"),
        ("local-epochs", 0, "greater than or equal to 1"),
        ("dirichlet-alpha", 0.0, "greater than 0"),
        ("test-fraction", 1.0, "less than 1"),
        ("classes-per-client", 11, "has 10 classes"),
        ("split-patterns", "fc.*, ,head", "glob patterns"),
        ("no-such-key", 1, "unknown key"),
    ],
)
def test_bad_value_names_key_value_and_rule(key, value, allowed):
    with pytest.raises(ConfigError) as err:
        Config.from_run_config({key: value})
    message = str(err.value)
    assert f"'{key}'" in message
    assert repr(value) in message or str(value) in message
    assert allowed in message


def test_classes_per_client_checked_against_synthetic_classes():
    with pytest.raises(ConfigError, match="classes-per-client"):
        Config.from_run_config(
            {"dataset": "synthetic-leaf", "synthetic-classes": 5, "classes-per-client": 6}
        )
    # not checked when the partitioner does not deal classes
    Config.from_run_config({"classes-per-client": 11, "partitioner": "iid"})


def test_hub_and_disk_sources_accepted():
    assert Config.from_run_config({"dataset": "hf:ylecun/mnist"}).dataset == "hf:ylecun/mnist"
    assert Config.from_run_config({"dataset": "disk:/data/x"}).dataset == "disk:/data/x"


def test_to_flat_roundtrip():
    cfg = Config.from_run_config({"lr": 0.1, "split": "input"})
    assert Config.from_run_config(cfg.to_flat()) == cfg


def _readme_key_table() -> dict[str, tuple[str, str]]:
    """README's run-config key table: key -> (default as written, whole row)."""
    import re

    text = (PYPROJECT.parent / "README.md").read_text()
    table = text[text.index("### Run-config keys") : text.index("### Byzantine clients")]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cols = line.split("|")
            keys = re.findall(r"`([a-z0-9-]+)`", cols[1])
            defaults = re.findall(r"`([^`]*)`", cols[2])
            for key, default in zip(keys, defaults):
                rows[key] = (default, line)
    return rows


def _same(written: str, value) -> bool:
    if isinstance(value, bool):
        return written == str(value).lower()
    if isinstance(value, str):
        return written.strip('"') == value
    try:
        return float(written) == float(value)
    except ValueError:
        return False


def test_pyproject_config_and_readme_agree_on_every_key_and_default():
    """One list of keys in three places: a key missing from pyproject is refused by `flwr
    run`, one missing from the README is undocumented; their defaults must be Config's
    (pyproject's few default-run overrides are named in the README row)."""
    defaults = Config().to_flat()
    run_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    readme = _readme_key_table()
    assert set(readme) == set(defaults), set(readme) ^ set(defaults)
    assert set(run_config) == set(defaults), set(run_config) ^ set(defaults)
    for key, value in defaults.items():
        written, row = readme[key]
        assert _same(written, value), (key, written, value)
        if run_config[key] != value:  # the default run differs: the README says so
            assert f"`{run_config[key]}` in the default run" in row, (key, run_config[key])
