"""Which parameters are personal, and moving the shared and personal parts in and out.

A split partitions a model's parameter names into **shared** (trained by the federation,
the only ones that cross the wire) and **personal** (never leave the client). Presets:

- ``none``: nothing personal (FedAvg).
- ``head``: the output layer, i.e. the last ``nn.Linear`` of the model.
- ``input``: the first layer, i.e. the first ``nn.Conv2d`` or ``nn.Linear``.
- ``adapter``: every adapter module plus all normalisation layers (Pillutla et al. 2022);
  the model must be built with ``adapters=True``.
- ``full``: everything personal (each client alone).

Or a list of glob patterns over parameter names (``fnmatch``), e.g. ``["fc.*", "layer4.*"]``.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import increment_version

from pflower.task.models import ConvAdapter, MLPAdapter

_NORMS = (nn.GroupNorm, nn.LayerNorm)


@dataclass(frozen=True)
class Split:
    """Parameter names in model order, partitioned into shared and personal."""

    shared: tuple[str, ...]
    personal: tuple[str, ...]
    num_shared: int  # number of scalar parameters
    num_personal: int

    @property
    def personal_fraction(self) -> float:
        return self.num_personal / max(1, self.num_shared + self.num_personal)

    def describe(self) -> str:
        return (
            f"{len(self.personal)} personal tensors ({self.num_personal:,} parameters, "
            f"{100 * self.personal_fraction:.2f}%), {len(self.shared)} shared tensors "
            f"({self.num_shared:,} parameters)"
        )


def _module_params(model: nn.Module, keep) -> list[str]:
    names = []
    for mod_name, module in model.named_modules():
        if keep(module):
            prefix = f"{mod_name}." if mod_name else ""
            names += [prefix + n for n, _ in module.named_parameters(recurse=True)]
    return names


def _preset(model: nn.Module, preset: str) -> set[str]:
    every = [n for n, _ in model.named_parameters()]
    if preset == "none":
        return set()
    if preset == "full":
        return set(every)
    if preset in ("head", "input"):
        layers = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d)) and not _inside_adapter(model, name)
        ]
        if not layers:
            raise ValueError(f"split {preset!r}: the model has no linear or conv layer")
        if preset == "head":
            linears = [lm for lm in layers if isinstance(lm[1], nn.Linear)]
            name, _ = linears[-1]
        else:
            name, _ = layers[0]
        return {f"{name}.{n}" for n, _ in model.get_submodule(name).named_parameters()}
    if preset == "adapter":
        adapters = _module_params(model, lambda m: isinstance(m, (ConvAdapter, MLPAdapter)))
        if not adapters:
            raise ValueError("split 'adapter': the model has no adapters (build it with adapters)")
        return set(adapters) | set(_module_params(model, lambda m: isinstance(m, _NORMS)))
    raise ValueError(f"unknown split preset {preset!r}")


def _inside_adapter(model: nn.Module, name: str) -> bool:
    parts = name.split(".")
    return any(
        isinstance(model.get_submodule(".".join(parts[:i])), (ConvAdapter, MLPAdapter))
        for i in range(1, len(parts))
    )


def make_split(model: nn.Module, preset: str = "head", patterns: Sequence[str] = ()) -> Split:
    """Split ``model``'s parameters by ``patterns`` (when given) or by ``preset``."""
    named = dict(model.named_parameters())
    if patterns:
        personal: set[str] = set()
        for pattern in patterns:
            hits = fnmatch.filter(named, pattern)
            if not hits:
                sample = ", ".join(list(named)[:6])
                raise ValueError(
                    f"split pattern {pattern!r} matches no parameter; names look like: {sample}, …"
                )
            personal.update(hits)
    else:
        personal = _preset(model, preset)
    shared = tuple(n for n in named if n not in personal)
    personal_names = tuple(n for n in named if n in personal)
    return Split(
        shared=shared,
        personal=personal_names,
        num_shared=sum(named[n].numel() for n in shared),
        num_personal=sum(named[n].numel() for n in personal_names),
    )


def get_tensors(
    model: nn.Module, names: Iterable[str], params: Mapping[str, nn.Parameter] | None = None
) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the named parameters, in the given order (``params``: the
    model's ``named_parameters`` as a dict, where the caller holds it already)."""
    params = dict(model.named_parameters()) if params is None else params
    return {n: params[n].detach().to("cpu", copy=True) for n in names}


def set_tensors(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    params: Mapping[str, nn.Parameter] | None = None,
) -> None:
    """Copy ``tensors`` into the model's parameters of the same names (shapes must match;
    ``params`` as in ``get_tensors``).

    Values may be tensors or NumPy arrays, read-only views of a message's bytes included
    (``wire.array_view``): an array of the parameter's dtype goes straight into a CPU
    parameter, one pass over the values instead of a writable copy and then the copy in;
    anything else is cast as ``Tensor.to`` casts."""
    params = dict(model.named_parameters()) if params is None else params
    with torch.no_grad():
        for name, value in tensors.items():
            if name not in params:
                raise KeyError(f"the model has no parameter {name!r}")
            param = params[name]
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(param.shape)}, got {tuple(value.shape)}"
                )
            if not isinstance(value, np.ndarray):
                param.copy_(value.to(param.device, param.dtype))
            elif param.device.type == "cpu" and value.dtype == _numpy_dtype(param.dtype):
                np.copyto(param.detach().numpy(), value)
                increment_version(param)  # as param.copy_ would: autograd sees the write
            else:  # another dtype or byte order, or a device: through a native copy
                native = value.astype(value.dtype.newbyteorder("="), copy=True)
                param.copy_(torch.from_numpy(native).to(param.device, param.dtype))


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The native NumPy dtype of a torch dtype (None for one NumPy lacks, e.g. bfloat16)."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        return None


def parameters(
    model: nn.Module, names: Iterable[str], params: Mapping[str, nn.Parameter] | None = None
) -> list[nn.Parameter]:
    """The parameter objects of the given names (for an optimizer over a subset; ``params``
    as in ``get_tensors``)."""
    params = dict(model.named_parameters()) if params is None else params
    return [params[n] for n in names]
