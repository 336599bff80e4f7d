"""A user's regression data, generated here with NumPy alone and saved the way a user
would (``datasets.save_to_disk``): train and test splits, columns ``x``, ``y``, ``client``.
Client m's rows are ``[p, q] -> t`` with ``t = p . theta + q . w_m + noise``: shared
features p (``D_SHARED``), personal features q (``user_models.D_PERSONAL``)."""

from __future__ import annotations

import datasets
import numpy as np
from user_models import D_PERSONAL

M, D_SHARED = 4, 4
TRAIN_ROWS = [12, 20, 31, 45]  # unequal on purpose: the two weightings then differ
TEST_ROWS = 5


def make_clients(seed: int = 7) -> list[dict[str, np.ndarray]]:
    """Per client: P (shared features), Q (personal features), t (targets), train and test,
    heterogeneous through client-specific personal coefficients and feature shifts."""
    rng = np.random.default_rng(seed)
    theta_true = rng.normal(size=D_SHARED)
    out = []
    for m, n in enumerate(TRAIN_ROWS):
        w_m = rng.normal(scale=2.0, size=D_PERSONAL)
        rows = n + TEST_ROWS
        P = rng.normal(size=(rows, D_SHARED)) + 0.3 * m
        Q = rng.normal(size=(rows, D_PERSONAL))
        t = P @ theta_true + Q @ w_m + 0.1 * rng.normal(size=rows) + m
        out.append({"P": P[:n], "Q": Q[:n], "t": t[:n], "P_test": P[n:], "t_test": t[n:]})
        out[-1]["Q_test"] = Q[n:]
    return out


def save_user_data(path, clients) -> str:
    """The user's files: a DatasetDict (train / test) with columns x, y and client."""

    def table(side: str) -> datasets.Dataset:
        suffix = "" if side == "train" else "_test"
        rows = {"x": [], "y": [], "client": []}
        for m, c in enumerate(clients):
            x = np.hstack([c["P" + suffix], c["Q" + suffix]])
            rows["x"] += x.tolist()
            rows["y"] += c["t" + suffix].tolist()
            rows["client"] += [m] * len(x)
        features = datasets.Features(
            {
                "x": datasets.Sequence(datasets.Value("float64")),
                "y": datasets.Value("float64"),
                "client": datasets.Value("int64"),
            }
        )
        return datasets.Dataset.from_dict(rows, features=features)

    datasets.DatasetDict({"train": table("train"), "test": table("test")}).save_to_disk(path)
    return str(path)
