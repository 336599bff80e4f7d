"""Config: defaults parse, bad values fail at start naming key, value and what is allowed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pflower.config import ALGORITHMS, Config, ConfigError, RunSettings
from pflower.strategies import ALGORITHMS as REGISTERED

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def test_default_run_config_in_pyproject_parses():
    run_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    cfg = Config.from_run_config(run_config)
    assert cfg.dataset == "mnist-5k"  # offline by default
    # every key is listed: `flwr run --run-config` refuses keys that are not
    assert set(run_config) == set(cfg.to_flat())


def test_each_algorithm_declares_its_settings_in_its_own_file():
    """Config = RunSettings + the algorithms' settings; an algorithm's keys are declared next
    to its strategy and client half, and each key belongs to one settings class."""
    assert tuple(REGISTERED) == ALGORITHMS
    owners: dict[str, type] = {}
    for name, entry in REGISTERED.items():
        # async-ffgg: its own keys beside its strategy, FFGG's beside FFGG's client half
        homes = {entry.strategy.__module__, entry.client.__class__.__module__}
        for settings in entry.settings:
            assert settings.__module__ in homes, (name, settings)
            for field in settings.model_fields:
                assert owners.setdefault(field, settings) is settings, field
    assert not set(owners) & set(RunSettings.model_fields)
    assert set(Config.model_fields) == set(RunSettings.model_fields) | set(owners)


def test_keys_of_other_algorithms_are_reported_not_dropped():
    cfg = Config.from_run_config({"algorithm": "fedalt", "ffgg-init": "zeros", "l2gd-p": 0.2})
    assert cfg.ignored_keys() == {"ffgg-init": "zeros", "l2gd-p": 0.2}
    assert not Config.from_run_config({"algorithm": "ffgg", "ffgg-init": "zeros"}).ignored_keys()
    # a key left at its default is not reported
    assert Config.from_run_config({"algorithm": "fedalt"}).ignored_keys() == {}


def test_an_algorithms_rules_apply_when_it_runs():
    # l2gd needs every client every step; other algorithms sample
    with pytest.raises(ConfigError, match="'fraction-train' = 0.5: l2gd needs 1.0"):
        Config.from_run_config({"algorithm": "l2gd", "fraction-train": 0.5})
    Config.from_run_config({"algorithm": "fedalt", "fraction-train": 0.5})
    with pytest.raises(ConfigError, match="'personal-steps' = 0: ffgg-solver 'cg'"):
        Config.from_run_config({"algorithm": "ffgg", "ffgg-solver": "cg"})
    assert Config.from_run_config({"algorithm": "apfl", "ffgg-solver": "cg"}).ignored_keys()


def test_algorithm_defaults_fill_keys_left_at_auto():
    cfg = Config.from_run_config({"algorithm": "pflego"})
    assert (cfg.server_optimizer, cfg.server_lr, cfg.local_steps) == ("adam", 0.003, 50)
    cfg = Config.from_run_config({"algorithm": "fedalt"})
    assert (cfg.server_optimizer, cfg.server_lr, cfg.local_steps) == ("sgd", 1.0, 0)
    cfg = Config.from_run_config({"algorithm": "pflego", "server-lr": 0.01, "local-steps": 5})
    assert (cfg.server_lr, cfg.local_steps) == (0.01, 5)  # set by the user: kept


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("algorithm", "fedavgg", "did you mean 'fedavg'"),
        ("ffgg-init", "zero", "did you mean 'zeros'"),
        ("apfl-mixing", "logits", "'outputs'"),
        ("pflego-alpha", "local", "'sampled'"),
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


# pyproject, Config and the docs' key reference (generated from the settings models) agree
# on every key and default, and every key has a description: tests/test_docs.py
