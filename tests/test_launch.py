"""Loud failures (#31 item 3): ``pflower check-config`` names a bad key or value offline, and
``pflower run`` exits non-zero with one line when a run is refused or applies no reply, where
Flower 1.41's ``flwr run --stream`` exits 0 however the run ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pflower import launch
from pflower.config import ConfigError

ROOT = Path(__file__).parents[1]
PFLOWER = str(Path(sys.executable).parent / "pflower")


@pytest.fixture(autouse=True)
def logs_in_tmp(tmp_path, monkeypatch):
    """``pflower run``'s whole logs in the test's directory, not the user's ~/pflower/logs."""
    monkeypatch.setattr(launch, "LOG_DIR", tmp_path / "logs")


def test_check_config_names_the_key_the_value_and_what_is_allowed(capsys):
    with pytest.raises(ConfigError, match=r"'robust-aggregator' = 'krun'.*did you mean 'krum'"):
        launch.check_config(ROOT, ["robust-aggregator='krun'"])
    # Flower's SuperLink refuses an unknown key without naming it ("[code: 15]")
    with pytest.raises(ConfigError, match=r"'num-rounds' = 5: unknown key.*'num-server-rounds'"):
        launch.check_config(ROOT, ["num-rounds=5"])
    assert launch.check(["--run-config", "lr=-1", str(ROOT)]) == launch.REFUSED
    said = capsys.readouterr().err
    assert said.startswith("pflower check-config: ") and "'lr' = -1" in said
    assert said.count("\n") == 1  # one line, no traceback
    assert launch.check([str(ROOT), "-c", "algorithm='pflego' lr=0.1"]) == launch.COMPLETED
    assert "algorithm='pflego'" in capsys.readouterr().out


def test_check_config_names_a_key_the_apps_pyproject_leaves_out(tmp_path):
    """A user's own app declaring fewer keys: Flower would refuse the others unnamed."""
    text = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text.replace('robust-aggregator = "auto"\n', "", 1))
    assert "robust-aggregator" not in launch.app_config(tmp_path)[0]
    with pytest.raises(ConfigError, match="'robust-aggregator' = 'krum': not declared in"):
        launch.check_config(tmp_path, ["robust-aggregator='krum'"])


def test_the_pflower_script_lists_its_commands():
    """``pflower --help`` answers (exit 0): the commands, the algorithms, where the keys are
    documented (issue 49, item 3); no command or an unknown one is a usage error (exit 2)."""
    from pflower.config import ALGORITHMS

    helped = subprocess.run([PFLOWER, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    commands = ("run", "check-config", "experiment", "algorithms")
    assert all(f"pflower {c}" in helped.stdout for c in commands)
    listed = subprocess.run([PFLOWER, "algorithms"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    names = [line for line in listed.stdout.splitlines() if line and not line.startswith(" ")]
    assert tuple(names) == ALGORITHMS  # the registry's, each with its keys
    assert "ffgg-solver" in listed.stdout and "pflower.strategies.pflego.PFLEGO" in listed.stdout
    assert "docs/reference/run-config.md" in helped.stdout
    for argv in ([], ["runn"]):
        wrong = subprocess.run([PFLOWER, *argv], capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 2 and "pflower run" in wrong.stderr
    assert "unknown command 'runn'" in wrong.stderr
    from pflower.console import COMMANDS
    from pflower.experiment.command import parser

    # the experiment command's own help names it as typed (in process: its module imports
    # every algorithm, seconds a subprocess would spend again)
    assert COMMANDS["experiment"][:2] == ("pflower.experiment.command", "main")
    assert parser().format_help().startswith("usage: pflower experiment")


def _pflower_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    return subprocess.run(
        [PFLOWER, "run", ".", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def _local_superlinks() -> set[int]:
    """Pids of Flower's managed local SuperLinks (``flwr run`` starts one, detached in a
    session of its own with its SuperExec, and leaves it running for the next run)."""
    from flwr.cli.local_superlink import LOCAL_CONTROL_API_ADDRESS

    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flower-superlink") for a in argv[:2]) and (
            LOCAL_CONTROL_API_ADDRESS.encode() in argv
        ):
            found.add(int(proc.name))
    return found


@pytest.fixture
def stops_the_local_superlink_it_started():
    """A local SuperLink this test started is stopped after it (its session: the SuperLink
    and its SuperExec), so a test run leaves no Flower daemon polling on the machine; one
    that was running before is left alone."""
    before = _local_superlinks()
    yield
    for pid in _local_superlinks() - before:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGTERM)


@pytest.mark.skipif(not shutil.which("flwr", path=str(Path(PFLOWER).parent)), reason="no flwr")
@pytest.mark.usefixtures("stops_the_local_superlink_it_started")
@pytest.mark.drill
def test_pflower_run_exits_with_how_the_run_ended(tmp_path):
    """On Flower's local SuperLink, as a user runs it: a refused key stops before anything
    starts (2); a run whose every reply is dropped ends failed (1) with RunFailed's one line
    and no traceback; a run that completes exits 0."""
    refused = _pflower_run("--run-config", "robust-aggregator='krun'")
    assert refused.returncode == launch.REFUSED, refused.stderr
    assert "did you mean 'krum'" in refused.stderr and "Successfully started" not in refused.stdout

    tiny = f"dataset='digits' evaluate-every=3 num-server-rounds=3 outputs-dir='{tmp_path}'"
    failed = _pflower_run("-c", f"{tiny} lr=1e30", "--federation-config", "num-supernodes=3")
    assert failed.returncode == launch.FAILED, failed.stdout[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("pflower run: run ") and "finished:failed" in last
    assert "3 consecutive training rounds applied no reply" in last
    assert "Traceback" not in failed.stdout + failed.stderr  # OneLineFailures

    done = _pflower_run("-c", tiny, "--federation-config", "num-supernodes=3")
    assert done.returncode == launch.COMPLETED, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"results: {tmp_path}" in done.stdout  # an absolute outputs-dir, as given


def test_a_local_superlink_that_does_not_start_is_explained(tmp_path, monkeypatch, capsys):
    """Issue 48, item 5: Flower's ``flwr run`` says only that its local SuperLink "exited with
    code 1"; the cause is in the SuperLink's log (an alembic "Can't locate revision" where a
    newer Flower wrote ``~/.flwr``). ``pflower run`` shows that line and how to run on a Flower
    home of its own. A fake ``flwr`` prints Flower 1.42's words and exits 1."""
    home = tmp_path / "flwr-home"
    log = home / "local-superlink" / "superlink.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "INFO :      Starting Flower SuperLink\n"
        "ERROR:      alembic.util.exc.CommandError: Can't locate revision identified by "
        "'7d1f3a2b9c4e'\n"
    )
    flwr = tmp_path / "flwr"
    flwr.write_text(
        "#!/bin/bash\necho 'Starting local SuperLink on 127.0.0.1:39093...'\n"
        'echo "Error: Failed to start local SuperLink: \\`flower-superlink\\` exited with code '
        f'1. See logs at {log}."\nexit 1\n'
    )
    flwr.chmod(0o755)
    monkeypatch.setattr(launch, "_flwr", lambda: str(flwr))
    monkeypatch.setenv("FLWR_HOME", str(home))
    code = launch.run([str(Path(__file__).parents[1])])
    err = capsys.readouterr().err
    assert code == 1
    said = "the local SuperLink said: ERROR:      alembic.util.exc.CommandError: Can't locate "
    assert said in err
    assert f"Its database in {home} was written by another Flower version" in err
    assert f"FLWR_HOME={home}-" in err
    # another failure of flwr run: its own words stand, nothing is added
    flwr.write_text("#!/bin/bash\necho 'Error: the app has no pyproject.toml'\nexit 1\n")
    assert launch.run([str(Path(__file__).parents[1])]) == 1
    assert "the local SuperLink said" not in capsys.readouterr().err


def test_pflower_run_sets_what_the_readme_s_command_sets(monkeypatch):
    """Issue 49, item 1: ``pflower run .`` is the README's main job: telemetry off and no
    per-run dependency installation unless the user's environment says otherwise, and the
    README's federation (10 simulated SuperNodes) unless the user names one."""
    env = launch.flower_env({"PATH": "/usr/bin"})
    assert env["FLWR_TELEMETRY_ENABLED"] == "0"
    assert env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    mine = launch.flower_env({"FLWR_TELEMETRY_ENABLED": "1", "PATH": ""})  # the user's stands
    assert mine["FLWR_TELEMETRY_ENABLED"] == "1"

    def command(*argv: str) -> list[str]:
        return launch.flwr_command(launch._run_parser().parse_args(argv))[1:]

    readme = ["--federation-config", "num-supernodes=10 client-resources-num-cpus=1"]
    assert command(".") == ["run", ".", "--stream", *readme]
    assert command(".", "-c", "lr=0.1") == ["run", ".", "--stream", "--run-config", "lr=0.1",
                                            *readme]  # fmt: skip
    # the user's federation, SuperLink connection or federation config: theirs alone
    mine = ["--federation-config", "num-supernodes=3"]
    assert command(".", *mine) == ["run", ".", "--stream", *mine]
    assert command(".", "my-link") == ["run", ".", "my-link", "--stream"]
    assert command(".", "--federation", "@a/b") == ["run", ".", "--stream", "--federation", "@a/b"]


def test_pflower_run_hands_flower_the_readme_s_environment_and_federation(
    tmp_path, monkeypatch, capsys
):
    """What reaches ``flwr run``: a fake ``flwr`` writes its arguments and environment, in a
    shell whose environment sets neither variable (a fresh shell, as the issue ran it)."""
    seen = tmp_path / "seen"
    flwr = tmp_path / "flwr"
    flwr.write_text(
        f'#!/bin/bash\necho "$@" > {seen}\n'
        f'echo "$FLWR_TELEMETRY_ENABLED $FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION" >> {seen}\n'
        "exit 3\n"
    )
    flwr.chmod(0o755)
    monkeypatch.setattr(launch, "_flwr", lambda: str(flwr))
    for name in launch.FLOWER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert launch.run([str(ROOT)]) == 3  # flwr run's own code
    argv, env = seen.read_text().splitlines()
    assert argv == f"run {ROOT} --stream --federation-config {launch.DEFAULT_FEDERATION_CONFIG}"
    assert env == "0 1"
    assert "the README's federation" in capsys.readouterr().out


def test_pflower_run_s_console_reduces_each_traceback_to_the_line_that_explains_it(tmp_path):
    """Issue 49, item 4: a ClientApp that raises under Flower's simulation engine fills the
    streamed log with Ray's tracebacks (60-odd lines per message, 880 in the issue's run).
    ``pflower run`` shows each distinct cause once, keeps Flower's own records (the dropped
    replies, the exit code) and writes every line to a file it names. The log is Flower
    1.41's, from ``flwr run`` on a quickstart whose server runs PFLEGO and clients FedAlt."""
    streamed = (Path(__file__).parent / "data" / "flwr_run_clientapp_error.log").read_text()
    lines = streamed.splitlines(keepends=True)
    console = launch.ConsoleLog(tmp_path / "logs" / "run.log", sized=True)
    shown = [s for s in (console.shown(line) for line in lines) if s is not None]
    closing = console.close()
    text = launch.ANSI.sub("", "".join(shown))
    assert "Traceback" not in text and 'File "' not in text and "^^^" not in text
    assert "ray::" not in text and "ClientAppException" not in text
    said = [s for s in shown if s.startswith("pflower run: raised")]
    assert [s.split(": ", 3)[2] for s in said] == [
        "pflower.wire.ConfigMismatch",
        "pflower.strategies.checks.RunFailed",  # the stored log's (Flower 1.41, pflower then)
    ]
    assert "the server runs algorithm 'pflego', this client 'fedalt'" in said[0]
    # Flower's own records stay, each once, as the log has them
    for record in ("round 1: dropped the reply of node", "Exit Code: 700",
                   "(3 simulated SuperNodes)", "round 3: no usable reply"):  # fmt: skip
        assert text.count(record) == launch.ANSI.sub("", streamed).count(record), record
    # a record that arrives inside a traceback (the engine's threads interleave) does not
    # end it: none of its blank or indented lines follow the record onto the console
    rounds = text.split("[ROUND 1/3]")[1].split("Exit Code: 700")[0].splitlines()
    assert all(launch.LEVEL.match(x) or x.startswith("pflower run: ") for x in rounds[1:])
    # the default-size warning is left out where the run names its size, shown where not
    assert launch.DEFAULT_SIZE_WARNING not in text
    unsized = launch.ConsoleLog(tmp_path / "other.log")
    assert any(launch.DEFAULT_SIZE_WARNING in (unsized.shown(x) or "") for x in lines)
    # every line in the file; the closing line counts what the console left out
    assert (tmp_path / "logs" / "run.log").read_text() == streamed
    own = len(shown) - len(said)
    assert closing == (
        f"pflower run: {len(lines) - own - 1} traceback lines left out; "
        f"the whole log: {tmp_path / 'logs' / 'run.log'}"
    )
    # a run without a traceback: the console is the log, and no closing line
    clean = launch.ConsoleLog(tmp_path / "clean.log")
    ok = ["INFO :      [ROUND 1/3]\n", "  indented output of the run itself\n", "| table |\n"]
    assert [clean.shown(x) for x in ok] == ok and clean.close() is None


def test_a_user_s_own_app_is_checked_on_pflower_s_keys_and_its_algorithms(
    tmp_path, monkeypatch, capsys
):
    """Issue 49, item 2: on a user's own app (examples/quickstart's pyproject, with a key of
    its own), ``check-config`` and ``pflower run`` check the keys that are pflower's, leave the
    app's own alone, and refuse an algorithm its ServerApp does not build a strategy for
    (``[tool.pflower] algorithms``), before anything starts."""
    quickstart = ROOT / "examples" / "quickstart"
    text = (quickstart / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text + "hidden-units = 64\n")
    assert launch.app_algorithms(tmp_path) == ("fedalt", "apfl", "pflego")
    launch.check_config(tmp_path, ["hidden-units=128 algorithm='apfl'"])  # the app's own key
    with pytest.raises(ConfigError, match=r"'lr' = -1"):  # pflower's key, pflower's rule
        launch.check_config(tmp_path, ["lr=-1"])
    with pytest.raises(ConfigError, match=r"'widht' = 3: not declared in"):
        launch.check_config(tmp_path, ["widht=3"])
    served = r"'algorithm' = 'ffgg': this app's ServerApp \(quickstart_app.server_app:app\) serves"
    with pytest.raises(ConfigError, match=served + r" 'fedalt', 'apfl', 'pflego'"):
        launch.check_config(quickstart, ["algorithm='ffgg'"])
    assert launch.check([str(tmp_path), "-c", "hidden-units=128"]) == launch.COMPLETED
    out = capsys.readouterr().out
    assert out.endswith("run config OK: hidden-units=128\n")
    assert "the app's own (left to it): hidden-units" in out
    # pflower run refuses before flwr runs (a flwr that would say otherwise is never called)
    flwr = tmp_path / "flwr"
    flwr.write_text("#!/bin/bash\necho ran\nexit 0\n")
    flwr.chmod(0o755)
    monkeypatch.setattr(launch, "_flwr", lambda: str(flwr))
    assert launch.run([str(quickstart), "-c", "algorithm='ffgg'"]) == launch.REFUSED
    out = capsys.readouterr()
    assert "ran" not in out.out and out.err.startswith("pflower run: key 'algorithm' = 'ffgg'")
    # an app that declares no algorithms: any that pflower knows
    (tmp_path / "pyproject.toml").write_text(text.replace("[tool.pflower]", "[tool.other]"))
    assert launch.app_algorithms(tmp_path) is None
    launch.check_config(tmp_path, ["algorithm='ffgg'"])
    with pytest.raises(ConfigError, match=r"'algorithm' = 'fgg'.*did you mean 'ffgg'"):
        launch.check_config(tmp_path, ["algorithm='fgg'"])


def test_a_superlink_failure_in_flower_s_error_box_is_explained(tmp_path, monkeypatch, capsys):
    """Flower 1.41 prints its error in a box wrapped at 80 columns when its output is piped
    (as under ``pflower run``): the sentence naming the SuperLink's log is split over two
    lines (seen on this machine, 2026-11-28). ``pflower run`` joins them and still shows
    the SuperLink's own error line."""
    home = tmp_path / "flwr-home"
    log = home / "local-superlink" / "superlink.log"
    log.parent.mkdir(parents=True)
    log.write_text("INFO :      Starting Flower SuperLink\nERROR:      address already in use\n")
    first = "Failed to start local SuperLink: `flower-superlink` exited with code 1. See"
    second = f"logs at {log}."
    box = [
        "╭─ Error " + "─" * 69 + "╮",
        f"│ {first:<76} │",
        f"│ {second:<76} │",
        "╰" + "─" * 78 + "╯",
    ]
    flwr = tmp_path / "flwr"
    flwr.write_text("#!/bin/bash\ncat <<'BOX'\n" + "\n".join(box) + "\nBOX\nexit 1\n")
    flwr.chmod(0o755)
    monkeypatch.setattr(launch, "_flwr", lambda: str(flwr))
    monkeypatch.setenv("FLWR_HOME", str(home))
    assert launch.run([str(ROOT)]) == 1
    captured = capsys.readouterr()
    assert "│ Failed to start local SuperLink" in captured.out  # Flower's box, as it drew it
    last = captured.err.strip().splitlines()[-1]
    assert last == "pflower run: the local SuperLink said: ERROR:      address already in use"


@pytest.mark.skipif(not (Path(PFLOWER).parent / "flower-superlink").exists(), reason="no Flower")
def test_a_state_from_another_flower_version_is_found_though_the_log_is_silent(
    tmp_path, monkeypatch, capsys
):
    """Flower 1.41 starts its local SuperLink with stderr to /dev/null: the migration's
    "Can't locate revision" never reaches the log it names, which ends at "Starting Flower
    SuperLink" (seen on this machine with a ~/.flwr another Flower wrote, 2026-11-28).
    ``pflower run`` starts a real ``flower-superlink`` on that database, on a port of its own,
    and shows the line it dies with and the FLWR_HOME fix. The database: a SQLite file whose
    alembic revision no Flower has."""
    import sqlite3

    home = tmp_path / "flwr-home"
    (home / "local-superlink").mkdir(parents=True)
    log = home / "local-superlink" / "superlink.log"
    log.write_text("INFO flwr | flower_superlink.py:472 | Starting Flower SuperLink\n")
    db = sqlite3.connect(home / "local-superlink" / "state.db")
    db.execute("create table alembic_version (version_num varchar(32) primary key)")
    db.execute("insert into alembic_version values ('7d1f3a2b9c4e')")
    db.commit()
    db.close()
    flwr = tmp_path / "flwr"
    flwr.write_text(
        "#!/bin/bash\necho 'Error: Failed to start local SuperLink: `flower-superlink` exited "
        f"with code 1. See logs at {log}.'\nexit 1\n"
    )
    flwr.chmod(0o755)
    monkeypatch.setattr(launch, "_flwr", lambda: str(flwr))
    monkeypatch.setenv("FLWR_HOME", str(home))
    assert launch.run([str(ROOT)]) == 1
    err = capsys.readouterr().err
    assert "the local SuperLink said: alembic.util.exc.CommandError: Can't locate revision " \
        "identified by '7d1f3a2b9c4e'" in err  # fmt: skip
    assert f"FLWR_HOME={home}-" in err


def test_pflower_run_uses_a_flower_home_of_its_own_where_another_version_wrote_the_default(
    tmp_path, monkeypatch, capsys
):
    """Issue 49, item 1: where ``~/.flwr`` holds another Flower version's state and the user
    set no FLWR_HOME, ``pflower run`` says so and runs again on ``~/.flwr-<version>``. A fake
    ``flwr`` fails as Flower 1.41 does on the default home and starts the run on another."""
    home = tmp_path / ".flwr"
    log = home / "local-superlink" / "superlink.log"
    log.parent.mkdir(parents=True)
    log.write_text("ERROR: alembic.util.exc.CommandError: Can't locate revision identified by "
                   "'7d1f3a2b9c4e'\n")  # fmt: skip
    seen = tmp_path / "homes"
    flwr = tmp_path / "flwr"
    flwr.write_text(
        f'#!/bin/bash\necho "${{FLWR_HOME:-default}}" >> {seen}\n'
        f'if [ -z "$FLWR_HOME" ] || [ "$FLWR_HOME" = "{home}" ]; then\n'
        "  echo 'Error: Failed to start local SuperLink: `flower-superlink` exited with code 1. "
        f"See logs at {log}.'\n  exit 1\nfi\necho 'Successfully started run 42'\n"
    )
    flwr.chmod(0o755)
    monkeypatch.setattr(launch, "_flwr", lambda: str(flwr))
    monkeypatch.setattr(launch, "run_status", lambda *a: {"status": "finished:completed"})
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FLWR_HOME", "restored after the test")
    monkeypatch.delenv("FLWR_HOME")
    from importlib.metadata import version

    own = f"{home}-{version('flwr')}"
    assert launch.run([str(ROOT)]) == launch.COMPLETED
    assert seen.read_text().split() == ["default", own]
    err = capsys.readouterr().err
    assert f"running on a Flower home of its own, FLWR_HOME={own}" in err
    # a Flower home the user chose is theirs: no second try
    monkeypatch.setenv("FLWR_HOME", str(home))
    assert launch.run([str(ROOT)]) == 1
    assert "running on a Flower home of its own" not in capsys.readouterr().err
    assert seen.read_text().split()[2:] == [str(home)]


def test_check_config_without_a_pyproject_checks_pflowers_keys_alone(tmp_path, capsys):
    """No pyproject.toml in the directory: the keys are checked as pflower's, and it says so."""
    assert launch.check([str(tmp_path), "-c", "algorithm='ditto' ditto-lambda=0.5"]) == 0
    out = capsys.readouterr().out
    assert "checked as pflower's keys alone" in out and "ditto-lambda=0.5" in out
    assert launch.check([str(tmp_path), "-c", "hidden-units=3"]) == launch.REFUSED
    assert "'hidden-units' = 3: unknown key" in capsys.readouterr().err


def test_check_config_on_a_users_app_says_which_keys_are_pflowers_and_which_its_own(
    tmp_path, capsys
):
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        '[tool.flwr.app.components]\nserverapp = "mine.server_app:app"\n'
        'clientapp = "mine.client_app:app"\n'
        "[tool.flwr.app.config]\nlr = 0.1\nlocal-epochs = 1\nhidden-units = 64\n"
    )
    assert launch.check([str(app), "-c", "lr=0.2"]) == launch.COMPLETED
    out = capsys.readouterr().out
    assert "pflower's keys (checked): local-epochs, lr" in out
    assert "the app's own (left to it): hidden-units" in out


def test_experiment_help_shows_the_file_format():
    from pflower.experiment.command import parser
    from pflower.experiment.spec import EXPERIMENT_KEYS

    text = parser().format_help()
    assert "[experiment]" in text and "[[run]]" in text and "docs/experiments.md" in text
    assert all(key in text for key in EXPERIMENT_KEYS)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not shutil.which("flower-superlink", path=str(Path(PFLOWER).parent)),
                    reason="no flower-superlink")  # fmt: skip
def test_pflower_run_names_the_local_superlink_it_found_and_whose_home_it_is(
    tmp_path, monkeypatch
):
    """Issue 62, item 4: ``flwr run`` hands a run to whatever listens on the local
    SuperLink's port, another project's (another Flower home) as readily as this one's.
    ``pflower run`` names the one it found (pid, home, directory) and, where its home is not
    this run's, says so and how to have one's own. A real ``flower-superlink`` on free
    ports, as Flower starts it."""
    import argparse
    import time

    from pflower.flower.cli import found_local_superlink

    http, control = _free_port(), _free_port()
    other = tmp_path / "other-home"
    (other / "local-superlink").mkdir(parents=True)
    database = other / "local-superlink" / "state.db"
    command = [str(Path(PFLOWER).parent / "flower-superlink"), "--insecure", "--simulation",
               "--control-api-address", f"127.0.0.1:{control}", "--host", "127.0.0.1",
               "--port", str(http), "--database", str(database)]  # fmt: skip
    env = {
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "this-home"))
    args = argparse.Namespace(superlink=None, own_superlink=False, app=str(ROOT))
    assert launch.local_superlink_notice(args) is None  # nothing listens: Flower starts one
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while found_local_superlink(os.environ) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        found = found_local_superlink(os.environ)
        assert found is not None and found.pid == proc.pid
        assert found.home == str(other) and found.cwd == str(tmp_path)
        notice = launch.local_superlink_notice(args)
        assert f"127.0.0.1:{http} (pid {proc.pid}, FLWR_HOME={other}" in notice
        assert "another Flower home's than this run's" in notice and "--own-superlink" in notice
        monkeypatch.setenv("FLWR_HOME", str(other))  # its own home: named, nothing to warn of
        notice = launch.local_superlink_notice(args)
        assert f"pid {proc.pid}" in notice and "another Flower home" not in notice
        # a SuperLink connection the user named is not the local one: nothing to say
        remote = argparse.Namespace(**{**vars(args), "superlink": "remote"})
        assert launch.local_superlink_notice(remote) is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_own_superlink_gives_each_project_a_home_and_ports_of_its_own(tmp_path, monkeypatch):
    """``pflower run --own-superlink``: a Flower home outside the project and two ports drawn
    from the project's path, the same on every run (so ``flwr ls`` and the next run find the
    SuperLink again), different for another project; what the user set is kept; the
    environment is set for ``flwr run`` and said."""
    import argparse

    from pflower.flower.cli import project_superlink

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    a, b = project_superlink(one, {}), project_superlink(two, {})
    assert a == project_superlink(one, {}) and a != b
    for own in (a, b):
        http = int(own["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"])
        control = int(own["FLWR_LOCAL_CONTROL_API_PORT"])
        assert 40000 <= http < 42000 and control == http + 1
        assert not Path(own["FLWR_HOME"]).is_relative_to(tmp_path)  # not in the app bundle
    assert a["FLWR_HOME"] != b["FLWR_HOME"]
    assert project_superlink(one, {"FLWR_HOME": "/mine"})["FLWR_HOME"] == "/mine"
    for k in a:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch, "found_local_superlink", lambda environ: None)
    args = argparse.Namespace(superlink=None, own_superlink=True, app=str(one))
    notice = launch.local_superlink_notice(args)
    assert {k: os.environ[k] for k in a} == a
    assert all(f"{k}={v}" in notice for k, v in a.items())
