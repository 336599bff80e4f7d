"""The synthetic problem of Mishchenko et al. §3.1 (``dataset = model = "synthetic-linear"``).

Client m's loss is ``f_m(theta, w) = 1/2 ||H_m theta - b_m||^2 + 1/2 ||A_m theta + B_m w - y_m||^2``
with H_m, A_m in R^{n x d_theta}, B_m in R^{n x d_w}, b_m, y_m in R^n; every entry i.i.d.
U[0, 1], then H_m and A_m divided by d_theta and B_m by d_w (the paper leaves b_m, y_m
unspecified; U[0, 1] is the natural reading). Defaults n = 10000, d_theta = 100, d_w = 50.

As data: 2n rows per client, ``[h_j, 0] -> b_j`` and ``[a_j, B_j] -> y_j``; the model predicts
``theta . p + w . q`` for a row ``[p, q]`` with the squared-error loss, so the mean loss over a
client's rows is ``f_m / (2n)``: every client has the same n, so theta* is unchanged and every
gradient is the paper's divided by 2n. Client m's data is generated from ``(seed, m)`` alone.

Closed form (``P_m = I - B_m B_m^+``, scaled by 1/(2n) like the loss):
``F_m(theta) = [H_m^T (H_m theta - b_m) + A_m^T P_m (A_m theta - y_m)] / (2n)`` and theta*
solves ``sum_m (H_m^T H_m + A_m^T P_m A_m) theta = sum_m (H_m^T b_m + A_m^T P_m y_m)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

THETA = "theta.weight"  # the shared parameter's name in SyntheticLinear


@dataclass(frozen=True)
class LinearClient:
    """One client's matrices (float64)."""

    H: np.ndarray
    A: np.ndarray
    B: np.ndarray
    b: np.ndarray
    y: np.ndarray

    @property
    def n(self) -> int:
        return len(self.b)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The 2n rows ``[h_j, 0]`` and ``[a_j, B_j]`` with targets ``b_j`` and ``y_j``."""
        top = np.hstack([self.H, np.zeros((self.n, self.B.shape[1]))])
        bottom = np.hstack([self.A, self.B])
        return np.vstack([top, bottom]), np.concatenate([self.b, self.y])

    def _projected(self) -> tuple[np.ndarray, np.ndarray]:
        """``P A`` and ``P y`` with ``P = I - B B^+`` (by least squares, never forming P)."""
        pa = self.A - self.B @ np.linalg.lstsq(self.B, self.A, rcond=None)[0]
        py = self.y - self.B @ np.linalg.lstsq(self.B, self.y, rcond=None)[0]
        return pa, py

    def operator(self, theta: np.ndarray) -> np.ndarray:
        """F_m(theta), the theta-gradient at the exact personal minimiser, scaled by 1/(2n)."""
        pa, py = self._projected()
        g = self.H.T @ (self.H @ theta - self.b) + pa.T @ (pa @ theta - py)
        return g / (2 * self.n)

    def best_w(self, theta: np.ndarray) -> np.ndarray:
        """argmin_w f_m(theta, w) = B^+ (y - A theta) (minimum norm)."""
        return np.linalg.lstsq(self.B, self.y - self.A @ theta, rcond=None)[0]


def make_client(m: int, *, n: int, d_theta: int, d_w: int, seed: int = 0) -> LinearClient:
    rng = np.random.default_rng([seed, 7919, m])
    return LinearClient(
        H=rng.uniform(size=(n, d_theta)) / d_theta,
        A=rng.uniform(size=(n, d_theta)) / d_theta,
        B=rng.uniform(size=(n, d_w)) / d_w,
        b=rng.uniform(size=n),
        y=rng.uniform(size=n),
    )


def optimum(clients: list[LinearClient]) -> np.ndarray:
    """theta* of the federation (every client with the same n)."""
    d = clients[0].H.shape[1]
    lhs, rhs = np.zeros((d, d)), np.zeros(d)
    for c in clients:
        pa, py = c._projected()
        lhs += c.H.T @ c.H + pa.T @ pa
        rhs += c.H.T @ c.b + pa.T @ py
    return np.linalg.solve(lhs, rhs)


def operator(clients: list[LinearClient], theta: np.ndarray) -> np.ndarray:
    """F(theta) = mean_m F_m(theta)."""
    return np.mean([c.operator(theta) for c in clients], axis=0)


@dataclass(frozen=True)
class Reference:
    """F as an affine map, ``F(theta) = J theta - c`` (J, c: means over clients, scaled by
    1/(2n)), its solution theta*, and the smoothness constants the paper's step sizes use:
    ``L_F`` (of F: largest eigenvalue of J) and ``L_f`` (max over clients of the largest
    eigenvalue of the Hessian of the mean loss in (theta, w))."""

    J: np.ndarray
    c: np.ndarray
    theta_star: np.ndarray
    L_F: float
    L_f: float

    @classmethod
    def build(cls, clients: list[LinearClient]) -> Reference:
        d = clients[0].H.shape[1]
        J, c, L_f = np.zeros((d, d)), np.zeros(d), 0.0
        for m in clients:
            pa, py = m._projected()
            J += (m.H.T @ m.H + pa.T @ pa) / (2 * m.n)
            c += (m.H.T @ m.b + pa.T @ py) / (2 * m.n)
            x, _ = m.rows()
            L_f = max(L_f, float(np.linalg.eigvalsh(x.T @ x / (2 * m.n))[-1]))
        J, c = J / len(clients), c / len(clients)
        return cls(J, c, np.linalg.solve(J, c), float(np.linalg.eigvalsh(J)[-1]), L_f)

    def metrics(self, theta: np.ndarray) -> dict[str, float]:
        """``theta-error`` = ||theta - theta*||^2 and ``operator-norm`` = ||F(theta)||^2."""
        theta = np.asarray(theta, dtype=np.float64).reshape(-1)
        return {
            "theta-error": float(np.sum((theta - self.theta_star) ** 2)),
            "operator-norm": float(np.sum((self.J @ theta - self.c) ** 2)),
        }


class SyntheticLinear(nn.Module):
    """theta . p + w . q for rows [p, q]; squared-error loss. theta (``theta.weight``) is the
    shared part and w (``w.weight``, the last linear layer: the ``head`` split) the personal
    one. Both start at zero (theta^0 = 0)."""

    def __init__(self, d_theta: int, d_w: int) -> None:
        super().__init__()
        self.d_theta = d_theta
        # float64: the experiments converge to ~1e-20, far below float32's resolution
        self.theta = nn.Linear(d_theta, 1, bias=False, dtype=torch.float64)
        self.w = nn.Linear(d_w, 1, bias=False, dtype=torch.float64)
        nn.init.zeros_(self.theta.weight)
        nn.init.zeros_(self.w.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float64)
        return (self.theta(x[:, : self.d_theta]) + self.w(x[:, self.d_theta :])).squeeze(-1)

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        per_row = 0.5 * (out - target.to(out.dtype)) ** 2
        return per_row.sum() if reduction == "sum" else per_row.mean()
