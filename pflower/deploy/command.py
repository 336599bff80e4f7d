r"""The deployment kit: credentials (a self-signed CA, the SuperLink's TLS certificate, one EC
key pair per SuperNode for node authentication), the ``flwr`` CLI's connection, a Fleet
gateway, and a federation on loopback started and stopped by process id.

    python -m pflower.deploy credentials --out deploy/credentials --supernodes 2
    python -m pflower.deploy connection --credentials deploy/credentials --address 127.0.0.1:9094
    python -m pflower.deploy gateway --listen 0.0.0.0:9093 --superlink 127.0.0.1:9094 \
        --credentials deploy/credentials
    python -m pflower.deploy up --dir deploy --supernodes 2     # all of it, on loopback
    python -m pflower.deploy down --dir deploy

Security model (docs/deploy.md, "Who can do what"): the SuperLink listens on loopback only, since
Flower 1.41 serves its Control API (register SuperNode keys, submit runs, whose code then runs
on every device), Runtime API and Fleet API on one port without account authentication
(Flower Enterprise's OIDC aside). Devices reach the Fleet API through the gateway, which
forwards ``/v1/fleet/*`` and refuses everything else.

Files under ``--out``: ``ca.crt`` (give it to every SuperNode and to the ``flwr`` CLI),
``server.pem`` / ``server.key`` (the certificate of the SuperLink and the gateway for
``--host`` names, signed by the CA; the key never leaves the server), ``supernode-<i>`` /
``supernode-<i>.pub`` (SuperNode i's private key, OpenSSH PEM, stays on the device; its public
key is what the operator registers with ``flwr supernode register``). For prototyping and
loopback tests; production deployments should use their organisation's PKI.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from pflower.deploy.credentials import connection, credentials
from pflower.deploy.federation import MAX_TASK_POLL_S, MIN_TASK_POLL_S, Federation
from pflower.deploy.gateway import gateway

#: the run ``up`` prints the ``flwr run`` line for when not given one: a first run of a few
#: seconds on the loopback federation (docs/deploy.md, step 7); the app's default job
#: (mnist-5k for 10 clients, 20 rounds) is ``--run-config ""``
FIRST_RUN = "algorithm='fedalt' dataset='digits' pretrain-rounds=0 num-server-rounds=3"


def submit_line(flwr_home: str | os.PathLike, name: str, run_config: str) -> str:
    """The ``flwr run`` command ``up`` prints for the federation, with ``run_config`` as the
    shell reads it back (double quotes, as the docs write run configs, where it can)."""
    command = f"FLWR_HOME={flwr_home} flwr run . {name} --stream"
    if not run_config.strip():
        return command
    plain = not any(c in run_config for c in '"$`\\!')
    return command + " --run-config " + (f'"{run_config}"' if plain else shlex.quote(run_config))


def main(argv: list[str] | None = None) -> None:
    parser = command_parser()
    args = parser.parse_args(argv)
    run(parser, args)


def command_parser() -> argparse.ArgumentParser:
    """``python -m pflower.deploy``'s arguments: every option described (its ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m pflower.deploy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cred = sub.add_parser("credentials", help="CA, SuperLink certificate, SuperNode keys")
    cred.add_argument("--out", required=True, help="the directory to write them into")
    cred.add_argument(
        "--supernodes", type=int, default=2, help="SuperNode key pairs to make (default: 2)"
    )
    cred.add_argument(
        "--hosts",
        nargs="*",
        default=["localhost", "127.0.0.1", "::1"],
        help="names and addresses the SuperLink's certificate is valid for "
        "(default: localhost 127.0.0.1 ::1)",
    )
    conn = sub.add_parser("connection", help="a SuperLink connection for the flwr CLI")
    conn.add_argument("--credentials", required=True, help="the directory with ca.crt")
    conn.add_argument("--address", default="127.0.0.1:9094", help="the SuperLink's address")
    conn.add_argument(
        "--name",
        default="pflower-deployment",
        help="the connection's name, as flwr run names it (default: pflower-deployment)",
    )
    conn.add_argument(
        "--flwr-home",
        default=os.environ.get("FLWR_HOME", "~/.flwr"),
        help="the Flower home whose config.toml gets the connection (default: $FLWR_HOME, "
        "else ~/.flwr)",
    )
    gate = sub.add_parser("gateway", help="serve the SuperLink's Fleet API only, on an address")
    gate.add_argument("--listen", required=True, help="host:port the devices reach")
    gate.add_argument("--superlink", default="127.0.0.1:9094", help="the SuperLink (loopback)")
    gate.add_argument("--credentials", required=True, help="ca.crt, server.pem, server.key")
    up = sub.add_parser("up", help="credentials, SuperLink, gateway, registered SuperNodes")
    up.add_argument(
        "--dir",
        default="deploy",
        help="where the federation lives: credentials, the Flower home, state, logs, "
        "pids.json (default: deploy; git-ignored, so flwr run never packs it)",
    )
    up.add_argument("--supernodes", type=int, default=2, help="SuperNodes to start (default: 2)")
    up.add_argument("--port", type=int, default=9093, help="the gateway's (devices') port")
    up.add_argument(
        "--run-config",
        default=FIRST_RUN,
        help=f'the run config of the flwr run line it prints (default: "{FIRST_RUN}", a '
        'first run of seconds; "": the app\'s default job)',
    )
    up.add_argument(
        "--warm",
        action="store_true",
        help="each SuperNode with a warm SuperExec (pflower.deploy.warm_exec): every message "
        "in a fork of a process that imported torch and the app once, not a fresh process",
    )
    up.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="each SuperNode asks for its next message at most this many seconds apart "
        "(pflower.deploy.supernode; default: Flower's own 3 s). 0.2: a round waits ~0.1 s "
        "for its SuperNodes instead of ~1.5 s, for one request per node every 0.2 s",
    )
    up.add_argument(
        "--superlink-state",
        choices=["sqlite", "memory"],
        default="sqlite",
        help="where the SuperLink keeps runs, registered keys and messages: <dir>/superlink.db "
        "(a restarted SuperLink resumes from it) or Flower's memory (forgotten when it stops; "
        "a round on the 2-device loopback costs the SuperLink about half the CPU)",
    )
    up.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads each SuperNode's ClientApps compute with (default: this machine's cores "
        "shared out among the SuperNodes, unless OMP_NUM_THREADS etc. are set)",
    )
    up.add_argument(
        "--task-poll-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how often each SuperNode's SuperExec asks it for a task (default: 0.05 s, "
        "stretched by SuperNodes per core beyond one; Flower's own is 1 s)",
    )
    down = sub.add_parser("down", help="stop what 'up' started (<dir>/pids.json, checked)")
    down.add_argument("--dir", default="deploy", help="the directory 'up' used (default: deploy)")
    return parser


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Carry out the parsed command."""
    if args.command == "credentials":
        out = credentials(args.out, args.supernodes, tuple(args.hosts))
        print(f"credentials in {out}: ca.crt, server.pem, server.key, supernode-<i>[.pub]")
    elif args.command == "connection":
        path = connection(
            args.flwr_home, args.name, args.address, str(Path(args.credentials) / "ca.crt")
        )
        print(f"SuperLink connection {args.name!r} -> {args.address} written to {path}")
    elif args.command == "gateway":
        gateway(args.listen, args.superlink, Path(args.credentials).expanduser())
    elif args.command == "up":
        if args.poll_interval is not None:
            from pflower.flower.waits import FLOWER_IDLE_POLL_S, MIN_WAIT_S

            if not MIN_WAIT_S <= args.poll_interval <= FLOWER_IDLE_POLL_S:
                parser.error(
                    f"--poll-interval {args.poll_interval}: must be in [{MIN_WAIT_S}, "
                    f"{FLOWER_IDLE_POLL_S:g}] seconds"
                )
        if args.threads is not None and args.threads < 1:
            parser.error(f"--threads {args.threads}: must be >= 1")
        poll = args.task_poll_interval
        if poll is not None and not MIN_TASK_POLL_S <= poll <= MAX_TASK_POLL_S:
            parser.error(
                f"--task-poll-interval {poll}: must be in [{MIN_TASK_POLL_S}, "
                f"{MAX_TASK_POLL_S:g}] seconds"
            )
        fed = Federation(
            args.dir, args.supernodes, args.port, warm=args.warm,
            poll_interval=args.poll_interval, superlink_state=args.superlink_state,
            threads=args.threads, task_poll_interval=poll,
        )  # fmt: skip
        try:
            fed.up(say=lambda line: print(line, flush=True))
        except RuntimeError as err:  # Flower's own words, then what was started is stopped
            print(f"up failed: {err}", file=sys.stderr)
            fed.stop_all()
            sys.exit(1)
        print(
            f"SuperLink on 127.0.0.1:{fed.superlink_port} (operator side: Control API), "
            f"Fleet gateway on {fed.fleet_address} (devices), {args.supernodes} SuperNodes "
            f"(pids in {fed.root / 'pids.json'}, logs in {fed.logs}). Submit with:\n"
            f"  {submit_line(fed.flwr_home, fed.name, args.run_config)}\n"
            f"Stop with: python -m pflower.deploy down --dir {args.dir}"
        )
    else:
        fed = Federation(args.dir)
        if not fed.entries:
            print(f"nothing recorded in {fed.root / 'pids.json'}")
        for label in sorted(fed.entries, key=lambda k: (k == "superlink", k == "gateway")):
            if label not in fed.entries:  # a warm SuperExec, stopped with its SuperNode
                continue
            pid = fed.entries[label]["pid"]
            if fed.running(label):
                beside = f"warm-exec-{label.removeprefix('supernode-')}"
                with_exec = label.startswith("supernode-") and fed.running(beside)
                fed.stop(label)
                print(
                    f"stopped {label} (pid {pid}) and the processes below it"
                    + (f", and {beside} beside it" if with_exec else "")
                )
            else:
                print(f"{label}: pid {pid} is no longer this federation's process; left alone")
                fed.entries.pop(label)
                fed._save_pids()
