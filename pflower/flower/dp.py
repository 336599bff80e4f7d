"""Flower's differential-privacy pieces that pflower's mechanism (``strategies/privacy.py``)
is built on, loaded when a DP run needs them, never when ``pflower`` is imported.

Flower 1.41 exports its privacy accountants from ``flwr.serverapp`` but not the helpers its
DP wrappers clip and noise with (``flwr.supercore.differential_privacy``:
``clip_inputs_inplace``, ``compute_stdv``, ``compute_adaptive_noise_params``), nor the budget
exception (``flwr.serverapp.exception.PrivacyBudgetExhausted``). pflower uses Flower's own,
not copies, so that its noise is the wrappers' noise. There is no fallback for the helpers:
a DP run whose Flower moved them is refused at start (``FlowerDrift``, naming the module),
where silently noising differently would make the reported epsilon a lie; a run without DP
never loads them. The budget exception falls back to a class of pflower's of the same name.
"""

from __future__ import annotations

import importlib
from functools import cache

from pflower.flower import FlowerDrift

MODULE = "flwr.supercore.differential_privacy"


@cache
def helpers():
    """``(clip_inputs_inplace, compute_adaptive_noise_params, compute_stdv)``, Flower's."""
    try:
        flower = importlib.import_module(MODULE)
        return flower.clip_inputs_inplace, flower.compute_adaptive_noise_params, flower.compute_stdv
    except (ImportError, AttributeError) as err:
        raise FlowerDrift(
            f"differential privacy needs Flower's clip and noise helpers ({MODULE}: "
            f"clip_inputs_inplace, compute_stdv, compute_adaptive_noise_params), which this "
            f"Flower does not have where 1.41 has them ({type(err).__name__}: {err}); "
            "install a Flower pflower was checked on, or run with dp = 'none'"
        ) from err


class _BudgetExhausted(RuntimeError):
    """Stands for Flower's ``PrivacyBudgetExhausted`` where Flower has none."""


@cache
def budget_exhausted() -> type[Exception]:
    """Flower's ``PrivacyBudgetExhausted`` (its exit code in ``flwr run``), else pflower's."""
    try:
        from flwr.serverapp.exception import PrivacyBudgetExhausted

        return PrivacyBudgetExhausted
    except ImportError:
        return _BudgetExhausted


def clip_inputs_inplace(arrays, clip: float) -> None:
    helpers()[0](arrays, clip)


def compute_adaptive_noise_params(noise: float, m: int, count_std: float):
    return helpers()[1](noise, m, count_std)


def compute_stdv(noise: float, clip: float, m: int) -> float:
    return helpers()[2](noise, clip, m)
