"""APFL's alpha, client by client and round by round, and the two parts of its gradient
(issue 47): the default run (pyproject.toml's config, ``algorithm = "apfl"``, no
pre-training, 10 rounds, 10 nodes on a LocalGrid) or it with keys changed.

    python benchmarks/apfl_alpha.py                                   # the default
    python benchmarks/apfl_alpha.py --set apfl-mix-with='"local"'     # Algorithm 1's mixing

Every local step's alpha gradient <v - m, g> (g = grad f_i(v_bar) on the step's minibatch, m
the w that v_bar mixes) is split at the round's received global w_bar into v's pull
<v - w_bar, g> (negative: v beats w_bar on the client, alpha should rise) and w's drift
-<m - w_bar, g> (zero when v_bar mixes w_bar itself; positive when the client's moving copy
w_i fits the data faster than v). Prints, per sampled client and round, alpha at the round's
start and end and the two parts' means per step; then the final evaluation per client
(personalized, v alone, global, alpha). The parts are recomputed beside the client's own
step (an extra gradient per step), which is not changed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import tomllib
from pathlib import Path

import torch
from torch.func import functional_call

from pflower.strategies import apfl
from pflower.task import train as training
from pflower.testbed.local_grid import run_local

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """Wraps ``APFLClient.local_steps`` and ``_mixed_loss`` to log each round's alpha and
    the two parts of each step's alpha gradient, by (partition id, APFL round)."""

    def __init__(self) -> None:
        self.rounds: dict[tuple[int, int], dict] = {}
        self.key: tuple[int, int] | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.local_steps = apfl.APFLClient.local_steps
        self.mixed_loss = apfl.APFLClient._mixed_loss

    def install(self) -> None:
        recorder = self

        def local_steps(half, job, v, alpha, **kwargs):
            if kwargs.get("train_w", True):  # a training round, not a new client's fitting
                recorder.key = (job.partition_id, int(job.config.get(apfl.ROUND, 0)))
                recorder.received = {n: p.detach().clone() for n, p in job.model.named_parameters()}
                recorder.rounds[recorder.key] = {"start": alpha, "pull": [], "drift": []}
            out = recorder.local_steps(half, job, v, alpha, **kwargs)
            if recorder.key is not None:
                recorder.rounds[recorder.key]["end"] = out[0]
            recorder.key = None
            return out

        def mixed_loss(half, job, v, alpha, w, x, y):
            if recorder.key is not None:
                recorder.parts(job, v, float(alpha), w, x, y)
            return recorder.mixed_loss(half, job, v, alpha, w, x, y)

        apfl.APFLClient.local_steps = local_steps
        apfl.APFLClient._mixed_loss = mixed_loss

    def parts(self, job, v, alpha: float, m, x, y) -> None:
        names = list(v)
        with torch.enable_grad():
            bar = {
                n: (alpha * v[n].detach() + (1 - alpha) * m[n].detach()).requires_grad_(True)
                for n in names
            }
            loss = training.loss_fn(job.model)(functional_call(job.model, bar, (x,)), y)
            grads = torch.autograd.grad(loss, [bar[n] for n in names])
        w_bar = self.received
        pull = sum(float(((v[n].detach() - w_bar[n]) * g).sum()) for n, g in zip(names, grads))
        drift = -sum(float(((m[n].detach() - w_bar[n]) * g).sum()) for n, g in zip(names, grads))
        self.rounds[self.key]["pull"].append(pull)
        self.rounds[self.key]["drift"].append(drift)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE",
        help="run-config keys on top of the default APFL run (TOML values)",
    )  # fmt: skip
    args = parser.parse_args()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    config = {
        **pyproject["tool"]["flwr"]["app"]["config"],
        "algorithm": "apfl",
        "pretrain-rounds": 0,
        "outputs-dir": "/tmp/pflower-apfl-alpha",
        **tomllib.loads("\n".join(args.set)),
    }
    recorder = Recorder()
    recorder.install()
    logging.disable(logging.CRITICAL)
    with contextlib.redirect_stdout(io.StringIO()):
        report = run_local(config, args.nodes)
    print(f"APFL, the default run with {' '.join(args.set) or 'nothing'} changed")
    print("| client | round | steps | α start → end | v's pull / step | w's drift / step |")
    print("|---|---|---|---|---|---|")
    for (pid, rnd), r in sorted(recorder.rounds.items()):
        steps = len(r["pull"])
        print(
            f"| {pid} | {rnd} | {steps} | {r['start']:.3f} → {r['end']:.3f} | "
            f"{sum(r['pull']) / steps:+.3f} | {sum(r['drift']) / steps:+.3f} |"
        )
    rows = list(recorder.rounds.values())
    pull = sorted(sum(r["pull"]) / len(r["pull"]) for r in rows)
    drift = sorted(sum(r["drift"]) / len(r["drift"]) for r in rows)
    print(
        f"\n{len(rows)} client-rounds: pull < 0 in {sum(p < 0 for p in pull)}, drift > 0 in "
        f"{sum(d > 0 for d in drift)}, alpha fell in {sum(r['end'] < r['start'] for r in rows)}; "
        f"median pull {pull[len(pull) // 2]:+.3f}, median drift {drift[len(drift) // 2]:+.3f}"
    )
    print("\n| client | personalized % | v alone % | global % | α |")
    print("|---|---|---|---|---|")
    for c in sorted(report.clients, key=lambda c: c["partition-id"]):
        print(
            f"| {int(c['partition-id'])} | {100 * c['personal-accuracy']:.1f} | "
            f"{100 * c['local-part-accuracy']:.1f} | {100 * c['global-accuracy']:.1f} | "
            f"{c['alpha']:.3f} |"
        )
    final = report.final
    print(
        f"\npooled: personalized {100 * final['personal-accuracy']:.2f}%, v alone "
        f"{100 * final['local-part-accuracy']:.2f}%, global {100 * final['global-accuracy']:.2f}%"
        f", α mean {final['alpha-mean']:.2f} [min {final['alpha-min']:.2f}, max "
        f"{final['alpha-max']:.2f}]"
    )


if __name__ == "__main__":
    main()
