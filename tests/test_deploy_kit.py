"""The deployment kit's process and configuration handling, without a SuperLink: a recorded
pid is stopped only while it still runs the recorded command, a whole process tree goes,
and the CLI connection is a valid Flower configuration that the ``flwr`` CLI can use."""

from __future__ import annotations

import json
import subprocess
import time
import tomllib

from pflower import deploy


def _spawn(*command: str) -> subprocess.Popen:
    """``command`` started, once it runs (until exec, the child's command line is ours)."""
    proc = subprocess.Popen(list(command), start_new_session=True)
    deadline = time.monotonic() + 5
    while deploy.cmdline(proc.pid)[-1:] != [command[-1]] and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not deploy.alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_pid_is_ours_only_while_it_runs_the_recorded_command():
    proc = _spawn("sleep", "61")
    try:
        assert deploy.is_ours(proc.pid, ["sleep", "61"])
        assert not deploy.is_ours(proc.pid, ["sleep", "62"])  # a reused pid: another program
        assert not deploy.is_ours(proc.pid, [])
    finally:
        proc.kill()
        proc.wait()
    assert not deploy.is_ours(proc.pid, ["sleep", "61"])  # ended


def test_stop_tree_stops_the_process_and_everything_below_it():
    script = "sleep 63 & sleep 64 & wait"
    proc = _spawn("bash", "-c", script)
    deadline = time.monotonic() + 5
    while len(deploy.descendants(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = deploy.descendants(proc.pid)
    assert len(children) == 2
    signalled = deploy.stop_tree(proc.pid, timeout=2)
    proc.wait(5)
    assert set(children) <= set(signalled)
    assert all(_gone(pid) for pid in children)


def test_down_leaves_a_process_alone_whose_pid_no_longer_runs_its_command(tmp_path, capsys):
    stranger = _spawn("sleep", "65")  # holds the pid the file records for another command
    ours = _spawn("sleep", "66")
    try:
        entries = {
            "supernode-0": {"pid": stranger.pid, "command": ["flower-supernode", "--x"]},
            "superlink": {"pid": ours.pid, "command": ["sleep", "66"]},
        }
        (tmp_path / "pids.json").write_text(json.dumps(entries))
        deploy.main(["down", "--dir", str(tmp_path)])
        said = capsys.readouterr().out
        assert _gone(ours.pid) and "stopped superlink" in said
        assert deploy.alive(stranger.pid), "a process the kit did not start was signalled"
        assert "no longer this federation's process; left alone" in said
        assert json.loads((tmp_path / "pids.json").read_text()) == {}
    finally:
        for proc in (stranger, ours):
            proc.kill()
            proc.wait()


def test_connection_is_a_flower_configuration_the_cli_reads(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("not read here")
    home = tmp_path / "flwr-home"
    path = deploy.connection(home, "my-federation", "127.0.0.1:9094", str(ca))
    config = tomllib.loads(path.read_text())
    assert config["superlink"]["default"] == "my-federation"
    entry = config["superlink"]["my-federation"]
    assert entry["address"] == "127.0.0.1:9094"
    assert entry["root-certificates"] == str(ca.resolve())
    assert entry.get("insecure", False) is False
    # a second connection is added beside it and becomes the default; the first stays
    deploy.connection(home, "other", "127.0.0.1:9999", str(ca))
    config = tomllib.loads(path.read_text())
    assert config["superlink"]["default"] == "other" and "my-federation" in config["superlink"]
    # the flwr CLI resolves the default connection from it (no SuperLink needed for that)
    import os

    from flwr.cli import flower_config

    before = os.environ.get("FLWR_HOME")
    os.environ["FLWR_HOME"] = str(home)
    try:
        resolved = flower_config.read_superlink_connection(None)
    finally:
        if before is None:
            os.environ.pop("FLWR_HOME")
        else:
            os.environ["FLWR_HOME"] = before
    assert resolved.name == "other" and resolved.address == "127.0.0.1:9999"
