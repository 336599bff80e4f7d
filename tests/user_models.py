"""Models and a loss "of a user's own", imported by path (``model = "user_models:..."``) in
tests/test_bring_your_own.py. Nothing here comes from pflower."""

from __future__ import annotations

import torch
from torch import nn

#: size of SharedPlusPersonal's personal coefficient vector
D_PERSONAL = 3


class SharedPlusPersonal(nn.Module):
    """Linear regression on rows ``[p, q]``: ``p . body_coefficients + q . per_user_offset``,
    in float64, both vectors starting at zero. ``per_user_offset`` (the last ``D_PERSONAL``
    features) is meant to be personal."""

    def __init__(self, input_shape):
        super().__init__()
        self.d_shared = input_shape[0] - D_PERSONAL
        self.body_coefficients = nn.Parameter(torch.zeros(self.d_shared, dtype=torch.float64))
        self.per_user_offset = nn.Parameter(torch.zeros(D_PERSONAL, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float64)
        p, q = x[:, : self.d_shared], x[:, self.d_shared :]
        return p @ self.body_coefficients + q @ self.per_user_offset


def half_squared_error(out: torch.Tensor, target: torch.Tensor, reduction: str = "mean"):
    """1/2 (out - target)^2 per example; the mean or the sum over the batch."""
    per_example = 0.5 * (out - target.to(out.dtype)) ** 2
    return per_example.sum() if reduction == "sum" else per_example.mean()


class OddNames(nn.Module):
    """A small classifier whose parameter names follow no torch layer convention:
    ``encoder_kernel``, ``encoder_shift``, ``readout.matrix``, ``readout.offset``."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        flat = 1
        for s in input_shape:
            flat *= s
        self.encoder_kernel = nn.Parameter(torch.randn(flat, 16) / flat**0.5)
        self.encoder_shift = nn.Parameter(torch.zeros(16))
        self.readout = nn.ParameterDict(
            {
                "matrix": nn.Parameter(torch.randn(16, num_classes) / 4.0),
                "offset": nn.Parameter(torch.zeros(num_classes)),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(x.flatten(1) @ self.encoder_kernel + self.encoder_shift)
        return hidden @ self.readout["matrix"] + self.readout["offset"]


class TinyMLP64(nn.Module):
    """A float64 classifier: body ``Linear -> tanh`` and a linear head ``head`` (the last
    ``nn.Linear``: PFLEGO's and the ``head`` split's personal part). In float64 every update
    rule can be checked to ~1e-12 end to end."""

    def __init__(self, input_shape, num_classes, hidden: int = 8):
        super().__init__()
        flat = 1
        for s in input_shape:
            flat *= s
        self.body = nn.Linear(flat, hidden, dtype=torch.float64)
        self.head = nn.Linear(hidden, num_classes, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x.flatten(1).to(torch.float64))))
