"""Flower's SuperNode with shorter waits: ``flower-supernode`` as it is, except that its
loop's sleeps (3 s when there is no message, 0.5 s between checks for a reply) and the first
retry of its object pulls (1 s) are capped at ``--poll-interval`` seconds
(``pflower.flower.waits``: what these waits are, and why they were most of a round).

    python -m pflower.deploy.supernode --poll-interval 0.2 --root-certificates ca.crt \\
        --superlink 192.0.2.1:9093 ...      # everything else: flower-supernode's arguments

What it costs: an idle SuperNode asks the SuperLink for a message once per
``--poll-interval`` instead of every 3 s, one small request each, and the SuperLink answers
each (``benchmarks/deploy_rounds.py`` measures the idle CPU of both). Everything else —
authentication, TLS, the Runtime API, the isolation mode, the heartbeat, what it stores —
is Flower's, unchanged. A Flower whose SuperNode loop no longer has these waits is refused at
start, naming what changed.
"""

from __future__ import annotations

import argparse
import sys

from pflower.flower.waits import FLOWER_IDLE_POLL_S, cap_pull_backoff, cap_supernode_polls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pflower.deploy.supernode",
        description=__doc__.split("\n\n")[0],
        epilog="Every other argument is flower-supernode's.",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        required=True,
        metavar="SECONDS",
        help=f"the longest wait of the SuperNode's loop ({FLOWER_IDLE_POLL_S:g}: Flower's own)",
    )
    args, flower_args = parser.parse_known_args(argv)
    try:
        cap_supernode_polls(args.poll_interval)
        cap_pull_backoff(args.poll_interval)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    from pflower.flower import FlowerDrift
    from pflower.flower.cli import flower_supernode

    try:
        flower = flower_supernode()
    except FlowerDrift as err:
        parser.error(str(err))
    sys.argv = ["flower-supernode", *flower_args]
    sys.exit(flower())


if __name__ == "__main__":
    main()
