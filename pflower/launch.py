"""``pflower run`` and ``pflower check-config``: Flower's ``flwr run`` with an exit status that
says how the run ended, and the run config checked before anything starts.

Flower 1.41's ``flwr run --stream`` exits 0 however the run ends: it streams the run's log and
never reads the run's status (a ServerApp that raised prints "Exit Code: 700" in the log, and
the command still exits 0). And the SuperLink refuses a key the app does not declare with
"[code: 15] Invalid run configuration" without naming the key. So::

    pflower check-config --run-config "robust-aggregator='krun'"    # offline, < 1 s
    pflower run . --run-config "num-server-rounds=5"                 # flwr run . --stream, then

``pflower run`` checks the run config offline first (for pflower's own app: the ServerApp
component ``pflower.server_app:app``), runs ``flwr run <app> [<superlink>] --stream ...`` with
the same arguments, reads the run's final status (``flwr ls --run-id N --format json``), and
exits with the codes below. ``pflower run .`` is the README's main job: unless the user says
otherwise it runs the README's federation (``DEFAULT_FEDERATION_CONFIG``) with its environment
(``FLOWER_ENV``), and its console reduces each traceback to the line that explains it
(``ConsoleLog``; the whole log goes to ``~/pflower/logs``). It exits with

- 0: the run finished ``completed``;
- 1: it finished ``failed`` or ``stopped`` (one line: Flower's status details, e.g. the
  ServerApp's refusal of a key or ``RunFailed``'s "3 consecutive training rounds applied no
  reply"), or its status could not be read;
- 2: the run config was refused before anything started (one line: key, value, what is
  allowed), or the arguments are wrong;
- ``flwr run``'s own non-zero exit code when Flower refused the run (it printed why).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from pflower.config import Config, ConfigError
from pflower.flower import FlowerDrift
from pflower.flower.cli import (
    FOREIGN_STATE,
    ErrorBox,
    found_local_superlink,
    home,
    own_home,
    project_superlink,
    superlink_failure,
    with_own_bin,
)

#: the ServerApp component of pflower's own app (pyproject's [tool.flwr.app.components])
PFLOWER_SERVERAPP = "pflower.server_app:app"
#: exit codes (module docstring)
COMPLETED, FAILED, REFUSED = 0, 1, 2
#: how long a run's status may take to read "finished" after its log stream ended
STATUS_WAIT_S = 30.0
#: what the README's main command sets for Flower's processes, set by ``pflower run`` unless
#: the user's environment sets them: no telemetry (no connection outside this machine), and no
#: per-run environment (Flower 1.41's local SuperLink otherwise runs ``uv sync`` for every run
#: and installs the app's dependencies afresh: 38 s and another torch than the pinned one)
FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
#: the README's federation, ``pflower run``'s when the user names none (no SuperLink
#: connection, ``--federation`` or ``--federation-config``): 10 simulated SuperNodes, as the
#: app's data is partitioned for 10 clients; Flower's own default is 2 (1 trained per round at
#: fraction-train 0.5: numbers that mean nothing)
DEFAULT_FEDERATION_CONFIG = "num-supernodes=10 client-resources-num-cpus=1"


def _flwr() -> str:
    """Flower's CLI: next to this Python first (the virtual environment's bin/)."""
    here = Path(sys.executable).parent / "flwr"
    return str(here) if here.exists() else (shutil.which("flwr") or "flwr")


def _project(app: str | Path) -> tuple[dict, Path]:
    path = Path(app).expanduser() / "pyproject.toml"
    try:
        return tomllib.loads(path.read_text()), path
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"cannot read the app's configuration {path}: {err}") from None


def app_config(app: str | Path) -> tuple[dict, str | None]:
    """The app's run config as ``[tool.flwr.app.config]`` declares it (flat dashed keys) and its
    ServerApp component, from ``<app>/pyproject.toml``."""
    from pflower.flower.cli import flatten_dict

    flwr_app = _project(app)[0].get("tool", {}).get("flwr", {}).get("app", {})
    return flatten_dict(flwr_app.get("config", {})), flwr_app.get("components", {}).get("serverapp")


def app_algorithms(app: str | Path) -> tuple[str, ...] | None:
    """The algorithms a user's own ServerApp serves, as its ``pyproject.toml`` declares them
    (``[tool.pflower] algorithms = ["fedalt", "apfl"]``; None: not declared). Flower's run
    config holds scalars only, and which strategies a ServerApp builds is in its code: the
    declaration lets ``pflower check-config`` / ``pflower run`` refuse another before the run
    starts (``examples/quickstart``)."""
    project, path = _project(app)
    declared = project.get("tool", {}).get("pflower", {}).get("algorithms")
    if declared is None:
        return None
    if not (isinstance(declared, list) and all(isinstance(a, str) for a in declared)):
        raise ConfigError(f"{path}: [tool.pflower] algorithms = {declared!r}: a list of names")
    return tuple(declared)


def overrides_of(run_config: Sequence[str]) -> dict:
    """``--run-config`` arguments as ``flwr run`` parses them ("k=v k2='s'" strings, or one
    TOML file)."""
    from pflower.flower.cli import parse_config_args

    try:
        return parse_config_args(list(run_config) or None)
    except FlowerDrift:
        raise
    except Exception as err:  # click's exception for bad TOML, OSError for a missing file
        message = getattr(err, "message", None) or str(err)
        raise ConfigError(f"--run-config {' '.join(run_config)!r}: {message}") from None


def pflower_keys() -> set[str]:
    """The run-config keys that are pflower's (field names and their dashed aliases)."""
    return set(Config.model_fields) | {f.alias for f in Config.model_fields.values()}


def check_config(app: str | Path, run_config: Sequence[str]) -> Config:
    """The run config ``flwr run <app> --run-config ...`` would give the app's ServerApp,
    validated: a ``ConfigError`` names the key, the value and what is allowed, also for a key
    Flower's SuperLink would refuse without naming it (one the app does not declare).

    pflower's own app (``PFLOWER_SERVERAPP``): every key is pflower's, an unknown one is named.
    A user's own app (``docs/library.md``): the keys it declares that are pflower's are checked
    as pflower's (they reach pflower's strategies and client halves), its own keys
    (``hidden-units``) are left alone, and ``algorithm`` must be one its ServerApp serves
    (``app_algorithms``) and pflower knows."""
    defaults, serverapp = app_config(app)
    overrides = overrides_of(run_config)
    merged = {**defaults, **overrides}
    if serverapp not in (PFLOWER_SERVERAPP, None):
        serves = app_algorithms(app)
        algorithm = merged.get("algorithm")
        if serves is not None and algorithm is not None and algorithm not in serves:
            raise ConfigError(
                f"key 'algorithm' = {algorithm!r}: this app's ServerApp ({serverapp}) serves "
                f"{', '.join(map(repr, serves))} ([tool.pflower] algorithms in "
                f"{Path(app) / 'pyproject.toml'})"
            )
        pflowers = pflower_keys()
        merged = {k: v for k, v in merged.items() if k in pflowers}
    cfg = Config.from_run_config(merged)  # unknown keys named here
    undeclared = [k for k in overrides if k not in defaults]
    if undeclared:  # a pflower key the app's pyproject.toml leaves out
        key = undeclared[0]
        raise ConfigError(
            f"key {key!r} = {overrides[key]!r}: not declared in {Path(app) / 'pyproject.toml'}'s "
            "[tool.flwr.app.config], so Flower refuses it ('[code: 15] Invalid run "
            "configuration'); add it there with its default"
        )
    return cfg


#: where ``pflower run`` keeps each run's whole streamed log (its console leaves tracebacks out)
LOG_DIR = Path("~/pflower/logs")
#: colour codes of Flower's log levels
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: a Flower log record's first line: its level, then a colon
LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*")
#: lines that open or continue a Python or Ray traceback, with or without a level
TRACEBACK = re.compile(
    r"^(Traceback \(most recent call last\):|The above exception was the direct cause|"
    r"During handling of the above exception|An exception was raised when processing a "
    r"message by \w+Backend|ray::\w+\.\w+\(\)|Exception \w+ occurred\. Message:)"
)
#: an exception's own line: its (dotted) type, a colon, its message
EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Mismatch|Failed|Exit))"
                       r"(?:\([\w.]*\))?:\s*(.*)$")  # fmt: skip
#: exceptions that only wrap the ClientApp's own (its message repeats the cause's)
WRAPPERS = ("ClientAppException", "RayTaskError")
#: Flower 1.41's warning at every simulation run, whatever its size
DEFAULT_SIZE_WARNING = "default simulated SuperNodes changed from 10 to 2"


class ConsoleLog:
    """``pflower run``'s console: the streamed log with each Python / Ray traceback reduced to
    the one line that explains it (the exception's own line, the first time it is seen;
    a ClientApp's error in Flower's simulation engine is 60-odd lines, once per message), and
    every line, tracebacks included, in the file ``path``. With the federation's size given
    (``sized``), Flower 1.41's warning that its default size changed is left out too: it is
    printed whatever the size, and the next line states the run's."""

    def __init__(self, path: Path, sized: bool = False) -> None:
        self.path, self.sized = path, sized
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("w")
        self.in_traceback = False
        self.explained: set[str] = set()
        self.left_out = 0

    def shown(self, line: str) -> str | None:
        """What the console shows of a log line (``None``: nothing); the file gets it all."""
        self.file.write(line)
        plain = ANSI.sub("", line).rstrip("\n")
        body = LEVEL.sub("", plain)
        if self.sized and DEFAULT_SIZE_WARNING in body:
            return None
        noise = bool(TRACEBACK.match(body)) or (
            self.in_traceback and plain == body and (not plain.strip() or plain[:1].isspace())
        )
        found = EXCEPTION.match(body) if (noise or self.in_traceback) else None
        if not (noise or found):
            # a log record may arrive inside a traceback (the engine's threads interleave):
            # only a line of the run's own output ends it
            self.in_traceback = self.in_traceback and plain != body
            return line
        self.in_traceback = True
        self.left_out += 1
        if found and not found.group(1).endswith(WRAPPERS):
            said = f"{found.group(1)}: {found.group(2)}".strip()
            if said not in self.explained:
                self.explained.add(said)
                return f"pflower run: raised (traceback left out): {said}\n"
        return None

    def close(self) -> str | None:
        """The closing line naming the file, where tracebacks were left out."""
        self.file.close()
        if not self.left_out:
            return None
        return f"pflower run: {self.left_out} traceback lines left out; the whole log: {self.path}"


#: how Flower 1.35-1.41 announce the run they submitted (``flwr run``); ``newest_run`` where not
RUN_STARTED = re.compile(r"Successfully started run (\d+)")


def newest_run(superlink: str | None) -> int:
    """The id of the run the SuperLink received last (``flwr ls --format json``: the greatest
    ``pending-at``, an ISO time)."""
    command = [_flwr(), "ls", *([superlink] if superlink else []), "--format", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    runs = json.loads(done.stdout or "{}").get("runs") or []
    if not runs:
        raise RuntimeError(f"flwr ls lists no run ({(done.stdout + done.stderr).strip()[:200]})")
    return int(max(runs, key=lambda r: str(r.get("pending-at", "")))["run-id"])


def run_status(run_id: int, superlink: str | None) -> dict:
    """The run's entry of ``flwr ls --run-id N --format json`` (status, status-details, ...),
    once its status is ``finished:*`` (or after ``STATUS_WAIT_S``)."""
    command = [_flwr(), "ls", *([superlink] if superlink else []), "--run-id", str(run_id)]
    deadline = time.monotonic() + STATUS_WAIT_S
    while True:
        done = subprocess.run(
            [*command, "--format", "json"], capture_output=True, text=True, timeout=120
        )
        try:
            answer = json.loads(done.stdout)
        except json.JSONDecodeError:
            answer = {"success": False, "error-message": (done.stdout + done.stderr).strip()}
        if not answer.get("success") or not answer.get("runs"):
            said = " ".join(str(answer.get("error-message", "no such run")).split())
            raise RuntimeError(f"flwr ls --run-id {run_id}: {said}")
        run = answer["runs"][0]
        if str(run.get("status", "")).startswith("finished") or time.monotonic() > deadline:
            return run
        time.sleep(1.0)


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pflower run",
        description="flwr run --stream, exiting 0 only if the run completed (pflower.launch)",
    )
    p.add_argument("app", nargs="?", default=".", help="the Flower app (default: .)")
    p.add_argument("superlink", nargs="?", default=None, help="the SuperLink connection")
    p.add_argument("--run-config", "-c", action="append", default=[], help="as for flwr run")
    p.add_argument("--federation", default=None, help="as for flwr run")
    p.add_argument(
        "--federation-config",
        action="append",
        default=[],
        help=f'as for flwr run (default, with no federation named: "{DEFAULT_FEDERATION_CONFIG}")',
    )
    p.add_argument("--stream", action="store_true", help="accepted; the log is always streamed")
    p.add_argument("--no-check", action="store_true", help="skip the offline run-config check")
    p.add_argument(
        "--own-superlink",
        action="store_true",
        help="run on a local SuperLink of this project's own (a Flower home and two ports of "
        "its own: FLWR_HOME, FLWR_LOCAL_SUPERLINK_HTTP_API_PORT, FLWR_LOCAL_CONTROL_API_PORT), "
        "not on the one another project may have started (docs/getting-started.md)",
    )
    return p


#: the SuperLink connection names ``pflower run`` takes for Flower's local SuperLink
LOCAL_CONNECTIONS = (None, "local")


def local_superlink_notice(args: argparse.Namespace) -> str | None:
    """Which local SuperLink this run goes to, where one is running already (``flwr run``
    connects to whatever listens on the local port: another project's, with another Flower
    home, as readily as this one's), and how to have one's own; with ``--own-superlink``,
    the environment it sets first (``os.environ``: ``flwr run`` and ``flwr ls`` below)."""
    if args.superlink not in LOCAL_CONNECTIONS:
        return None
    lines = []
    if args.own_superlink:
        own = project_superlink(Path(args.app), os.environ)
        os.environ.update(own)
        exports = " ".join(f"{k}={v}" for k, v in own.items())
        lines.append(
            f"pflower run: a local SuperLink of this project's own ({exports}; export them "
            "for flwr ls / flwr log on it)"
        )
    found = found_local_superlink(os.environ)
    if found is not None:
        line = f"pflower run: the local SuperLink on {found.describe()} takes this run"
        if found.home and Path(found.home).resolve() != Path(home()).resolve():
            line += (
                f"; it is another Flower home's than this run's ({home()}): the run and its "
                "state are that SuperLink's. For one of this project's own: pflower run "
                "--own-superlink"
            )
        lines.append(line)
    return "\n".join(lines) or None


def flwr_command(args: argparse.Namespace) -> list[str]:
    """The ``flwr run ... --stream`` command for ``pflower run``'s arguments: the user's, and
    ``DEFAULT_FEDERATION_CONFIG`` where they name no federation (a deployment SuperLink
    ignores a federation config: Flower applies it to simulation runs only)."""
    command = [_flwr(), "run", args.app, *([args.superlink] if args.superlink else []), "--stream"]
    for item in args.run_config:
        command += ["--run-config", item]
    for item in args.federation_config:
        command += ["--federation-config", item]
    if args.federation:
        command += ["--federation", args.federation]
    if not (args.superlink or args.federation or args.federation_config):
        command += ["--federation-config", DEFAULT_FEDERATION_CONFIG]
    return command


def flower_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of ``flwr run`` and the local SuperLink it starts: ``environ`` with
    ``FLOWER_ENV``'s values where it does not set them, and this environment's ``bin/`` first
    on ``PATH`` (Flower before 1.40 starts its local SuperLink as ``flower-superlink`` from
    ``PATH``, so a venv's ``pflower run`` without the venv activated would not find it)."""
    return with_own_bin({**FLOWER_ENV, **environ})


#: ``pflower run``'s exit code when the user stopped following the log (Ctrl-C)
INTERRUPTED = 130


def _follow(command: list[str], sized: bool) -> tuple[int, int | None, str | None]:
    """Run ``flwr run ... --stream`` and follow its log on the console (``ConsoleLog``):
    its exit code (``INTERRUPTED`` after Ctrl-C), the run's id if Flower named it, and what a
    local SuperLink that did not start said (``superlink_failure``)."""
    run_id = None
    env = flower_env(os.environ)
    path = LOG_DIR.expanduser() / time.strftime("run-%Y%m%d-%H%M%S.log")
    if path.exists():  # a second try in the same second (a Flower home of its own)
        path = path.with_name(f"{path.stem}-{os.getpid()}-{time.monotonic_ns()}.log")
    console = ConsoleLog(path, sized)
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    )
    superlink_said = None  # what a local SuperLink that did not start said (its own log)
    box = ErrorBox()  # Flower's error, wrapped in a box at 80 columns
    try:
        for line in proc.stdout:
            boxed = box.feed(line)
            if boxed:
                superlink_said = superlink_failure(boxed) or superlink_said
            shown = console.shown(line)
            if shown is not None:
                sys.stdout.write(shown)
                sys.stdout.flush()
            found = RUN_STARTED.search(line)
            if found and run_id is None:
                run_id = int(found.group(1))
            superlink_said = superlink_failure(line) or superlink_said
        return proc.wait(), run_id, superlink_said
    except KeyboardInterrupt:
        proc.wait()
        where = f"run {run_id} goes on (flwr log {run_id}; flwr stop {run_id})" if run_id else ""
        print(f"\npflower run: stopped following the log; {where}".rstrip("; "), file=sys.stderr)
        return INTERRUPTED, run_id, None
    finally:
        closing = console.close()
        if closing:
            print(closing, flush=True)


def run(argv: Sequence[str] | None = None) -> int:
    """``pflower run``: the module docstring."""
    args = _run_parser().parse_args(argv)
    local = not args.app.startswith("@")  # "@account/app": a remote app, no local config
    if local and not args.no_check:
        try:
            check_config(args.app, args.run_config)
        except ConfigError as err:
            print(f"pflower run: {err}", file=sys.stderr, flush=True)
            return REFUSED
        except FlowerDrift as err:  # Flower checks the run config itself at submission
            print(
                f"pflower run: not checking the run config first: {err}; flwr run and the "
                "ServerApp check it",
                file=sys.stderr,
                flush=True,
            )
    notice = local_superlink_notice(args)
    if notice:
        print(notice, flush=True)
    command = flwr_command(args)
    if command[-2:] == ["--federation-config", DEFAULT_FEDERATION_CONFIG]:
        print(
            f'pflower run: --federation-config "{DEFAULT_FEDERATION_CONFIG}" (the README\'s '
            "federation; give --federation-config or --federation to change it)",
            flush=True,
        )
    sized = any("num-supernodes" in item for item in command[command.index("--stream") :])
    code, run_id, superlink_said = _follow(command, sized)
    if code != 0 and superlink_said and FOREIGN_STATE in superlink_said:
        home = own_home()
        if args.superlink is None and "FLWR_HOME" not in os.environ:
            # the default home holds another Flower version's state, and the user chose none:
            # run on a home of this version's own (Flower's local SuperLink listens on fixed
            # ports whatever FLWR_HOME is, and the failed one is not running)
            print(
                f"pflower run: {superlink_said.splitlines()[0]}\npflower run: ~/.flwr holds "
                f"another Flower version's state; running on a Flower home of its own, "
                f"FLWR_HOME={home} (export it to skip this first try)",
                file=sys.stderr,
                flush=True,
            )
            os.environ["FLWR_HOME"] = home  # flwr ls, below, too
            code, run_id, superlink_said = _follow(command, sized)
    if code == INTERRUPTED:
        return code
    if code != 0:
        if superlink_said:
            print(f"pflower run: {superlink_said}", file=sys.stderr, flush=True)
        return code  # Flower refused the run and said why
    if run_id is None:  # Flower's wording changed: the run is the newest the SuperLink has
        try:
            run_id = newest_run(args.superlink)
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as err:
            print(f"pflower run: cannot tell which run was started: {err}", file=sys.stderr)
            return FAILED
        print(
            f"pflower run: Flower's output did not name the run ({RUN_STARTED.pattern!r}); "
            f"following the newest run on the SuperLink, {run_id}",
            file=sys.stderr,
        )
    try:
        status = run_status(run_id, args.superlink)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        print(
            f"pflower run: run {run_id}: cannot read its status ({err}): the SuperLink may "
            "have stopped; once it is back, a run with checkpoints continues with "
            "--run-config \"resume-from='<the run's outputs directory>'\" (docs/deploy.md, "
            "Crashes)",
            file=sys.stderr,
        )
        return FAILED
    state = str(status.get("status", "unknown"))
    if state == "finished:completed":
        return COMPLETED
    details = " ".join(str(status.get("status-details") or "").split())  # one line
    print(
        f"pflower run: run {run_id} {state}" + (f": {details}" if details else ""),
        file=sys.stderr,
        flush=True,
    )
    return FAILED


def _refused(err: ConfigError | FlowerDrift) -> int:
    """``pflower check-config``'s one line for a refused config (exit 2) or a Flower it cannot
    check with (exit 1)."""
    if isinstance(err, ConfigError):
        print(f"pflower check-config: {err}", file=sys.stderr)
        return REFUSED
    print(f"pflower check-config: cannot check: {err}", file=sys.stderr)
    return FAILED


def _check_keys_alone(app: str, run_config: Sequence[str]) -> int:
    """``pflower check-config`` where ``app`` has no ``pyproject.toml``: the run config's keys
    checked as pflower's alone (every key must be one), said so."""
    try:
        given = overrides_of(run_config)
        Config.from_run_config(given)
    except (ConfigError, FlowerDrift) as err:
        return _refused(err)
    said = ", ".join(f"{k}={v!r}" for k, v in given.items()) or "pflower's defaults"
    print(
        f"no {Path(app) / 'pyproject.toml'}: checked as pflower's keys alone (an app's own keys "
        f"would be refused here). run config OK: {said}"
    )
    return COMPLETED


def check(argv: Sequence[str] | None = None) -> int:
    """``pflower check-config``: validate a run config offline."""
    p = argparse.ArgumentParser(
        prog="pflower check-config",
        description=(
            "Validate a run config offline, as pflower's ServerApp would: every key (an unknown "
            "one named, which Flower's own refusal does not) and every value"
        ),
    )
    p.add_argument("app", nargs="?", default=".", help="the Flower app (default: .)")
    p.add_argument("--run-config", "-c", action="append", default=[], help="as for flwr run")
    args = p.parse_args(argv)
    if not (Path(args.app).expanduser() / "pyproject.toml").is_file():
        return _check_keys_alone(args.app, args.run_config)
    try:
        cfg = check_config(args.app, args.run_config)
    except (ConfigError, FlowerDrift) as err:
        return _refused(err)
    declared, serverapp = app_config(args.app)
    if serverapp not in (PFLOWER_SERVERAPP, None):  # which keys are pflower's, which the app's
        pflowers = pflower_keys()
        own = sorted(k for k in {**declared, **overrides_of(args.run_config)} if k not in pflowers)
        mine = sorted(k for k in declared if k in pflowers)
        print(
            f"{serverapp}: pflower's keys (checked): {', '.join(mine) or 'none'}; the app's own "
            f"(left to it): {', '.join(own) or 'none'}"
        )
    if serverapp in (PFLOWER_SERVERAPP, None):  # what the run changes, the algorithm's too
        defaults = Config.from_run_config(declared).to_flat()
        changed = {k: v for k, v in cfg.to_flat().items() if v != defaults.get(k)}
    else:  # a user's app: what the run config changes of its declared keys
        given = overrides_of(args.run_config)
        changed = {k: v for k, v in given.items() if v != declared.get(k)}
    said = ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "the app's defaults"
    print(f"run config OK: {said}")
    return COMPLETED
