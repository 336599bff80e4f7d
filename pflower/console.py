"""The ``pflower`` console script: ``pflower run [APP] [SUPERLINK] [flwr run options]``,
``pflower check-config [APP] --run-config "..."``, ``pflower experiment FILE [options]``.

Light on purpose: ``pflower --help`` and a mistyped command answer at once, without the
seconds torch and the algorithms take to import; a command imports its module when it runs.
"""

from __future__ import annotations

import importlib
import sys

#: the commands: name -> (module, function, what it does)
COMMANDS = {
    "run": ("pflower.launch", "run", "flwr run --stream; exit 0 only if the run completed"),
    "check-config": ("pflower.launch", "check", "validate a run config offline"),
    "experiment": ("pflower.experiment.command", "main", "run an experiment file"),
    "algorithms": ("pflower.strategies", "list_algorithms", "the algorithms and their own keys"),
}

def usage() -> str:
    """``pflower --help``: the commands, the algorithms, where the keys are documented."""
    commands = "\n".join(f"  pflower {name:<13} {what}" for name, (*_, what) in COMMANDS.items())
    return (
        "usage: pflower COMMAND [options]   (pflower COMMAND --help: its options)\n\n"
        f"commands:\n{commands}\n\n"
        "algorithms (run-config key algorithm): pflower algorithms lists them\n\n"
        "every run-config key, its default and what it allows: docs/reference/run-config.md,\n"
        "or pyproject.toml's [tool.flwr.app.config]; an unknown key or value is named by\n"
        '  pflower check-config --run-config "key=value ..."\n'
        "the deployment kit (TLS SuperLink, SuperNodes, gateway): python -m pflower.deploy --help"
    )


def cli() -> None:
    """Dispatch ``pflower COMMAND ...`` to its module; no command, an unknown one or
    ``--help``: the usage (exit 2 on stderr, or 0 on stdout when asked)."""
    argv = sys.argv[1:]
    if not argv or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help", "help")
        print(usage(), file=sys.stdout if asked else sys.stderr)
        if argv and not asked:
            print(f"pflower: unknown command {argv[0]!r}", file=sys.stderr)
        raise SystemExit(0 if asked else 2)
    module, function, _ = COMMANDS[argv[0]]
    raise SystemExit(getattr(importlib.import_module(module), function)(argv[1:]))
