"""One source of defaults (issue 31, item 1): a strategy built by hand runs what the app runs
for its algorithm when no key is set. tests/test_personal_client.py checks that each public
strategy so built learns in a plain Flower project."""

from __future__ import annotations

import pytest

import pflower.strategies as strategies
from pflower.config import Config
from pflower.strategies import ALGORITHMS, make_strategy

#: the app refuses l2gd at the default fraction-train 0.5
KEYS = {"l2gd": {"fraction-train": 1.0}}


def settings(strategy) -> dict:
    """A strategy's settings: its plain attributes, server optimizer and robust rule."""
    plain = {
        k: v
        for k, v in vars(strategy).items()
        if isinstance(v, (int, float, str, bool, tuple, type(None)))
        and k not in ("serves", "settings_fingerprint")  # the handshake: the app's own
    }
    robust = strategy.robust.name if strategy.robust is not None else None
    pipeline, nodes = strategy.pipeline, strategy.nodes
    stages = {
        "combine": pipeline.combine.describe(),
        "byzantine": pipeline.combine.byzantine,
        "clip": vars(pipeline.combine.clip) if pipeline.combine.clip is not None else None,
        "max-update-norm": (pipeline.bound.norm.factor, pipeline.bound.norm.growth),
        "max-num-examples": pipeline.bound.claims.max_num_examples,
        "max-failed-rounds": pipeline.settle.max_failed_rounds,
        "privacy": pipeline.privacy is not None,
        "nodes": (nodes.holdout_fraction, nodes.min_available_nodes, nodes.poisson),
        "steps": vars(strategy.steps),
        "evaluation": vars(strategy.evaluation),
        "exchange": vars(strategy.exchange),
    }
    return {**plain, **stages, "server": strategy.server_optimizer.describe(), "robust": robust}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_strategy_built_with_no_argument_is_the_app_s(name):
    """The strategy the app builds from a run config that sets only the algorithm is the
    class built with no argument: every setting, the server optimizer, the robust rule."""
    app = make_strategy(Config.from_run_config({"algorithm": name, **KEYS.get(name, {})}))
    assert settings(type(app)()) == settings(app)


def test_the_algorithms_own_defaults_reach_the_classes():
    assert strategies.PFLEGO().server_optimizer.describe().startswith("Adam(lr=0.003")
    assert strategies.PFLEGO.serves == ("pflego",)  # its handshake names its own clients
    assert strategies.AsyncFFGG().server_optimizer.lr == pytest.approx(0.2)
    assert strategies.BRFFGG().robust.name == "bucketing(median, s=2)"
    assert strategies.L2GD().p == pytest.approx(0.1)  # 1 / L2GD's local-steps
    assert strategies.FedAlt().fraction_train == Config().fraction_train
    with pytest.raises(ValueError, match="L2GD needs 1.0"):
        strategies.L2GD(fraction_train=0.5)
