"""Mishchenko et al. Fig. 1 on ``synthetic-linear``: FFGG's error vs rounds (a) for tau CG
steps and (b-d) against Scaffold, Local GD and L2GD with tau local steps.

Every run goes through pflower's strategy and ClientApp on a ``LocalGrid`` (the simulation
engine's transport costs ~0.1 s a round, hundreds of times the clients' compute here); the
server's closed-form evaluation logs ||theta^r - theta*||^2 and ||F(theta^r)||^2 each round.

Step sizes (the paper's, with our losses scaled by 1/(2n); ``Reference`` computes L):
FFGG server step 1/L_F (L_F = largest eigenvalue of F's Jacobian), fine-tuner CG (a) or GD
with step 1/L_w (b-d), w from zeros (the theory's init); Scaffold outer 0.5, inner
1/(L_f tau); Local GD 1/(L_f tau); L2GD lambda = 0.1 (as 0.1 / (2n) in our scale),
p = 1/tau, alpha = M / (2 max{L_f / (1 - p), lambda / p}). Non-personalized methods are
judged by the theta block of their shared model, L2GD by that of the clients' mean.

    python benchmarks/ffgg_synthetic.py --out benchmarks/results/ffgg-fig1
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
from _pool import run_pool


def problem(args) -> dict:
    from pflower.task import linear

    clients = [
        linear.make_client(m, n=args.n, d_theta=args.dtheta, d_w=args.dw, seed=args.seed)
        for m in range(args.clients)
    ]
    ref = linear.Reference.build(clients)
    L_w = max(float(np.linalg.eigvalsh(c.B.T @ c.B / (2 * c.n))[-1]) for c in clients)
    return {
        "L_F": ref.L_F,
        "L_f": ref.L_f,
        "L_w": L_w,
        "theta_star_sq": float(ref.theta_star @ ref.theta_star),
    }


def runs(args, consts: dict) -> list[tuple[str, str, int, dict]]:
    """(figure, method, tau, run-config overrides) of every curve."""
    base = {
        "dataset": "synthetic-linear",
        "model": "synthetic-linear",
        "linear-n": args.n,
        "linear-dtheta": args.dtheta,
        "linear-dw": args.dw,
        "batch-size": 2 * args.n,  # full batch: every local step is a gradient step
        "eval-batch-size": 2 * args.n,
        "fraction-train": 1.0,
        "finetune-epochs": 1,
        "seed": args.seed,
        "outputs-dir": str(Path(tempfile.gettempdir()) / "pflower-fig1-runs"),
    }
    L_F, L_f, L_w = consts["L_F"], consts["L_f"], consts["L_w"]
    ffgg = {
        **base,
        "algorithm": "ffgg",
        "split": "head",
        "server-lr": 1 / L_F,
        "ffgg-init": "zeros",
    }
    out = []
    for tau in args.taus_a:
        cfg = {**ffgg, "ffgg-solver": "cg", "personal-steps": tau}
        out.append(("a", "FFGG (CG)", tau, {**cfg, "num-server-rounds": args.rounds_a}))
    for tau in args.taus_bd:
        r = {"num-server-rounds": args.rounds_bd, "evaluate-every": args.rounds_bd}
        gd = {"ffgg-solver": "gd", "personal-steps": tau, "personal-lr": 1 / L_w}
        out.append(("bd", "FFGG (GD)", tau, {**ffgg, **gd, **r}))
        shared = {**base, **r, "split": "none", "local-steps": tau, "lr": 1 / (L_f * tau)}
        out.append(("bd", "Scaffold", tau, {**shared, "algorithm": "scaffold", "server-lr": 0.5}))
        out.append(("bd", "Local GD", tau, {**shared, "algorithm": "local-gd"}))
        p, lam = 1 / tau, 0.1 / (2 * args.n)
        alpha = args.clients / (2 * max(L_f / (1 - p), lam / p))
        l2gd = {"algorithm": "l2gd", "lr": alpha, "l2gd-lambda": lam, "l2gd-p": p}
        out.append(("bd", "L2GD", tau, {**shared, **l2gd}))
    for *_, cfg in out:
        cfg.setdefault("evaluate-every", cfg["num-server-rounds"])
    return out


def one(job) -> dict:
    fig, method, tau, cfg, clients = job
    import torch

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from pflower.testbed.local_grid import run_local

    start = time.perf_counter()
    report = run_local(cfg, clients)
    rows = [r for r in report.rounds if "theta-error" in r.server]
    return {
        "figure": fig,
        "method": method,
        "tau": tau,
        "rounds": [r.round for r in rows],
        "theta_error": [r.server["theta-error"] for r in rows],
        "operator_norm": [r.server["operator-norm"] for r in rows],
        "seconds": time.perf_counter() - start,
        "config": cfg,
    }


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_a = [r for r in results if r["figure"] == "a"]
    if fig_a:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for r in sorted(fig_a, key=lambda r: r["tau"]):
            axes[0].semilogy(r["rounds"], r["theta_error"], label=f"tau = {r['tau']}")
            axes[1].semilogy(r["rounds"], r["operator_norm"], label=f"tau = {r['tau']}")
        for ax, title in zip(axes, ("||theta - theta*||^2", "||F(theta)||^2")):
            ax.set_xlabel("round")
            ax.set_title(f"FFGG + CG: {title}")
            ax.grid(alpha=0.3, which="both")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "fig1a.png", dpi=110)
        plt.close(fig)
    taus = sorted({r["tau"] for r in results if r["figure"] == "bd"})
    if taus:
        fig, axes = plt.subplots(1, len(taus), figsize=(5 * len(taus), 4), squeeze=False)
        for ax, tau in zip(axes[0], taus):
            for r in [r for r in results if r["figure"] == "bd" and r["tau"] == tau]:
                ax.semilogy(r["rounds"], r["theta_error"], label=r["method"])
            ax.set_title(f"tau = {tau}: ||theta - theta*||^2")
            ax.set_xlabel("round")
            ax.grid(alpha=0.3, which="both")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "fig1bcd.png", dpi=110)
        plt.close(fig)


def table(results: list[dict], consts: dict, args) -> str:
    lines = [
        f"M = {args.clients} clients, n = {args.n}, d_theta = {args.dtheta}, d_w = {args.dw}, "
        f"seed {args.seed}; ||theta*||^2 = {consts['theta_star_sq']:.3g} (the error at round 0)",
        "",
        "| figure | method | tau | rounds | final ||theta - theta*||^2 | final ||F(theta)||^2 "
        "| seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| 1{r['figure']} | {r['method']} | {r['tau']} | {r['rounds'][-1]} | "
            f"{r['theta_error'][-1]:.3e} | {r['operator_norm'][-1]:.3e} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def _label(r: dict) -> str:
    return f"1{r['figure']} | {r['method']} | tau {r['tau']}: {r['theta_error'][-1]:.3e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--n", type=int, default=1000, help="rows per block (paper: 10000)")
    parser.add_argument("--dtheta", type=int, default=100)
    parser.add_argument("--dw", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--taus-a", type=int, nargs="*", default=[5, 10, 20, 30, 40])
    parser.add_argument("--rounds-a", type=int, default=1000)
    parser.add_argument("--taus-bd", type=int, nargs="*", default=[100])
    parser.add_argument("--rounds-bd", type=int, default=150)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/ffgg-fig1")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    consts = problem(args)
    print(json.dumps(consts), flush=True)
    jobs = [(*job, args.clients) for job in runs(args, consts)]
    results = run_pool(
        one,
        jobs,
        args.workers,
        out,
        {"args": vars(args), "constants": consts},
        _label,
    )
    plot(results, out)
    (out / "table.md").write_text(table(results, consts, args) + "\n")
    print(table(results, consts, args))


if __name__ == "__main__":
    main()
