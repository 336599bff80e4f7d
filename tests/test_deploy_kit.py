"""The deployment kit's process and configuration handling, without a SuperLink: a recorded
pid is stopped only while it still runs the recorded command, a whole process tree goes,
and the CLI connection is a valid Flower configuration that the ``flwr`` CLI can use."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib

import pytest

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


def test_down_stops_a_warm_supernode_with_its_superexec_beside_it(tmp_path, capsys):
    """``up --warm`` records each SuperNode's warm SuperExec as ``warm-exec-<i>``; stopping
    the SuperNode stops it too, and ``down`` goes on with the rest (it raised KeyError)."""
    node, warm, link = (_spawn("sleep", s) for s in ("67", "68", "69"))
    try:
        entries = {
            "supernode-0": {"pid": node.pid, "command": ["sleep", "67"]},
            "warm-exec-0": {"pid": warm.pid, "command": ["sleep", "68"]},
            "superlink": {"pid": link.pid, "command": ["sleep", "69"]},
        }
        (tmp_path / "pids.json").write_text(json.dumps(entries))
        deploy.main(["down", "--dir", str(tmp_path)])
        said = capsys.readouterr().out
        assert all(_gone(p.pid) for p in (node, warm, link))
        assert "stopped supernode-0" in said and "and warm-exec-0 beside it" in said
        assert "stopped superlink" in said
        assert json.loads((tmp_path / "pids.json").read_text()) == {}
    finally:
        for proc in (node, warm, link):
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


#: what ``flwr supernode register`` prints for a key registered before (Flower 1.41, rich)
REGISTERED_BOX = (
    "╭─ Error ──────────────────────────────────────────╮\n"
    "│ Public key already in use.                       │\n"
    "╰──────────────────────────────────────────────────╯\n"
)
#: the end of a SuperNode's log when Flower refuses it (colour codes as Flower writes them)
REFUSED_LOG = (
    "\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode\n"
    "INFO:     Uvicorn running on http://127.0.0.1:42013 (Press CTRL+C to quit)\n"
    "\x1b[91mERROR \x1b[0m:     Exit Code: 305\n"
    "Failed to initialize the connection to the SuperLink.\n"
    "[code: 2004] Failed to activate SuperNode.\n"
    "The SuperNode could not establish a connection to the SuperLink.\n"
    "\n"
    "For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/305.html>\n"
    "INFO:     Shutting down\n"
    "\x1b[92mINFO \x1b[0m:      FastAPI lifespan: shutdown\n"
)


def test_flower_s_words_without_the_box_or_the_log_around_them():
    assert deploy.flower_said(REGISTERED_BOX) == "Public key already in use."
    said = deploy.flower_error(REFUSED_LOG)
    assert said.splitlines() == [
        "Exit Code: 305",
        "Failed to initialize the connection to the SuperLink.",
        "[code: 2004] Failed to activate SuperNode.",
        "The SuperNode could not establish a connection to the SuperLink.",
        "For more information, visit: "
        "<https://flower.ai/docs/framework/1.41/en/ref-exit-codes/305.html>",
    ]
    assert deploy.flower_error("no error record\nlast words") == "no error record\nlast words"


def _fake_flower(tmp_path, monkeypatch, supernode: str) -> None:
    """``deploy up`` without Flower: SuperLink and gateway are ``sleep``s, ``flwr supernode
    register`` answers as for a key registered before, ``flower-supernode`` runs the bash
    ``supernode``; a SuperNode counts as started after 0.5 s instead of ``SETTLE_S``, and
    one that never listens after 1 s instead of ``READY_S``."""
    from pflower.deploy import federation, flower_cli

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "flwr": f"printf '%s' '{REGISTERED_BOX}'; exit 1",
        "flower-supernode": supernode,
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setattr(flower_cli, "executable", lambda name: str(bin_dir / name))
    # the fake's executables are no installed Flower's: whichever flwr is installed passes
    monkeypatch.setattr(flower_cli, "require_checked_flower", lambda version=None: None)
    monkeypatch.setattr(federation, "SETTLE_S", 0.5)
    monkeypatch.setattr(federation, "READY_S", 1.0)
    monkeypatch.setattr(federation, "RETRY_S", 0.1)
    monkeypatch.setattr(
        federation.Federation,
        "start_superlink",
        lambda self, command=None: self._start("superlink", command or ["sleep", "71"]),
    )
    monkeypatch.setattr(
        federation.Federation,
        "start_gateway",
        lambda self, command=None: self._start("gateway", command or ["sleep", "72"]),
    )


def test_up_fails_with_flower_s_message_when_a_supernode_dies_at_its_start(
    tmp_path, monkeypatch, capsys
):
    """Issue 31, item 4: a SuperNode that exits within the settle time is not 'started':
    ``up`` exits 1 with Flower's message from the node's log, and stops what it started."""
    dying = (
        "printf '\\033[91mERROR \\033[0m:     Exit Code: 300\\n"
        "Flower refused this node for a reason of its own.\\n'; exit 1"
    )
    _fake_flower(tmp_path, monkeypatch, dying)
    with pytest.raises(SystemExit) as exited:
        deploy.main(["up", "--dir", str(tmp_path / "fed"), "--supernodes", "1"])
    assert exited.value.code == 1
    out, err = capsys.readouterr()
    assert "supernode-0: key already registered (Flower: Public key already in use.)" in out
    assert not set(out + err) & set("╭╮╰╯│─")  # Flower's words, not the CLI's box
    assert "supernode-0: started" not in out
    assert "supernode-0 exited (code 1)" in err
    assert "Exit Code: 300\nFlower refused this node for a reason of its own." in err
    assert json.loads((tmp_path / "fed" / "pids.json").read_text()) == {}  # all stopped


def test_up_waits_out_a_dead_node_s_session_then_reports_the_node_started(
    tmp_path, monkeypatch, capsys
):
    """A node killed without signing off: Flower refuses its key until the heartbeat lapses
    (here: the first start); ``up`` says so, starts it again, and reports it started only
    once it is alive after the settle time."""
    once = tmp_path / "refused-once"
    refused_then_alive = (
        f"if [ -e {once} ]; then sleep 73; exit 0; fi; touch {once}; "
        "echo '[code: 2004] Failed to activate SuperNode.'; exit 1"
    )
    _fake_flower(tmp_path, monkeypatch, refused_then_alive)
    fed = deploy.Federation(tmp_path / "fed", supernodes=1)
    try:
        deploy.main(["up", "--dir", str(fed.root), "--supernodes", "1"])
        out = capsys.readouterr().out
        assert "still holds the session of the node that died" in out
        pid = json.loads((fed.root / "pids.json").read_text())["supernode-0"]["pid"]
        assert f"supernode-0: started (pid {pid}, alive after 0.5 s)" in out
        assert deploy.alive(pid)
    finally:
        deploy.Federation(fed.root).stop_all()


def test_up_starts_a_dead_warm_superexec_again_beside_its_living_supernode(tmp_path, monkeypatch):
    """Issue 50, item 1: a warm SuperExec whose zygote died exits, and its SuperNode, alive and
    listed online, ran nothing until ``down`` + ``up``. ``up`` (a new object, from pids.json,
    as the command makes it) checks every warm SuperExec beside a running node and starts a
    dead one again with its own command line; a living one is left alone."""
    _fake_flower(tmp_path, monkeypatch, "sleep 76")
    fed = deploy.Federation(tmp_path / "fed", supernodes=2)
    fed.logs.mkdir(parents=True)
    try:
        for i in (0, 1):
            fed._start(f"supernode-{i}", ["sleep", f"7{7 + i}"])
            fed._start(f"warm-exec-{i}", ["sleep", f"8{7 + i}"])
        dead, alive = fed.entries["warm-exec-0"]["pid"], fed.entries["warm-exec-1"]["pid"]
        fed.crash("warm-exec-0")
        said = deploy.Federation(fed.root, supernodes=2).up()
        assert f"warm-exec-0: had died (pid {dead}); started again" in "\n".join(said), said
        assert f"warm-exec-1: already running (pid {alive})" in said, said
        entries = json.loads((fed.root / "pids.json").read_text())
        assert entries["warm-exec-0"]["pid"] != dead and deploy.alive(entries["warm-exec-0"]["pid"])
        assert entries["warm-exec-0"]["command"] == ["sleep", "87"]
        assert entries["warm-exec-1"]["pid"] == alive
    finally:
        deploy.Federation(fed.root).stop_all()


def test_up_starts_every_dead_process_again_with_the_command_it_was_started_with(
    tmp_path, monkeypatch
):
    """Issue 50, item 1: ``up`` checks every process the federation owns and starts a dead
    one again with its recorded command line, one line each: the SuperLink and the gateway
    (their recorded commands, not the ones this ``up`` would build), a dead SuperNode as it
    was (warm, though this ``up`` is not given ``--warm``; its node config; its warm
    SuperExec beside the new node's pid, the old one stopped), a warm SuperExec beside a
    living SuperNode; what lives is left alone."""
    from pflower.deploy import federation

    _fake_flower(tmp_path, monkeypatch, "sleep 78")
    monkeypatch.setattr(
        federation, "warm_exec_command",
        lambda port, pid, poll=None: [
            sys.executable, "-c", "import time; time.sleep(79)",
            "--runtime-api-address", f"127.0.0.1:{port}", "--parent-pid", str(pid),
        ],
    )  # fmt: skip
    fed = deploy.Federation(tmp_path / "fed", supernodes=2, warm=True)
    try:
        fed.up()
        first = json.loads((fed.root / "pids.json").read_text())
        assert set(first) == {"superlink", "gateway", *(f"{k}-{i}" for k in ("supernode",
                              "warm-exec") for i in (0, 1))}  # fmt: skip
        for label in ("superlink", "gateway", "supernode-0", "warm-exec-1"):
            fed.crash(label)
        old_exec = first["warm-exec-0"]["pid"]
        assert deploy.alive(old_exec)  # its own session: it outlived its node
        recorded = json.loads((fed.root / "pids.json").read_text())
        # as an older kit (or another up's options) started them: up must not rebuild them
        recorded["superlink"]["command"] = ["sleep", "81"]
        recorded["gateway"]["command"] = ["sleep", "82"]
        (fed.root / "pids.json").write_text(json.dumps(recorded))

        said = deploy.Federation(fed.root, supernodes=2).up()
        now = json.loads((fed.root / "pids.json").read_text())
        for label in ("superlink", "gateway"):
            line = f"{label}: had died (pid {first[label]['pid']}); started again "
            assert f"{line}(pid {now[label]['pid']})" in said, said
        assert now["superlink"]["command"] == ["sleep", "81"]
        assert now["gateway"]["command"] == ["sleep", "82"]
        node = now["supernode-0"]
        assert any(
            s.startswith(f"supernode-0: had died (pid {first['supernode-0']['pid']}); "
                         f"started again (pid {node['pid']}, alive after 0.5 s")
            for s in said
        ), said  # fmt: skip
        assert node["command"] == first["supernode-0"]["command"]  # warm, its config, its port
        assert node["command"][-2:] == ["--isolation", "process"]
        assert _gone(old_exec)  # the dead node's SuperExec stopped...
        beside = now["warm-exec-0"]["command"]  # ...and one beside the new node
        assert (
            beside[-1] == str(node["pid"]) and beside[:-1] == first["warm-exec-0"]["command"][:-1]
        )
        line = f"warm-exec-1: had died (pid {first['warm-exec-1']['pid']}); started again"
        assert any(s.startswith(line) for s in said), said
        assert now["supernode-1"] == first["supernode-1"]
        assert f"supernode-1: already running (pid {first['supernode-1']['pid']})" in said
        assert all(deploy.alive(e["pid"]) for e in now.values())
        assert len([s for s in said if "had died" in s]) == 4
    finally:
        deploy.Federation(fed.root).stop_all()


def test_a_node_that_listens_and_is_then_refused_is_started_again(tmp_path, monkeypatch):
    """CI, stop 53: a restarted node's Runtime API listened, its activation was refused
    seconds after the settle time (a loaded box), and it counted as started: the federation
    ran on without it. A node counts as started once Flower logged its activation
    (``ACTIVATED``); one refused after listening is started again."""
    import socket

    from pflower.deploy import federation

    once = tmp_path / "refused-late-once"
    node = (
        "import socket, sys, time; s = socket.socket(); "
        "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
        "refused = sys.argv[2] == 'first'; time.sleep(1.5 if refused else 0); "
        "print('[code: 2004] Failed to activate SuperNode.' if refused else "
        "'SuperNode ID: 7', flush=True); sys.exit(1) if refused else time.sleep(73)"
    )
    port = "port=$(echo \"$@\" | grep -o -- '--port [0-9]*' | cut -d' ' -f2); "
    _fake_flower(
        tmp_path, monkeypatch,
        f"{port}if [ -e {once} ]; then exec {sys.executable} -c \"{node}\" $port again; fi; "
        f"touch {once}; exec {sys.executable} -c \"{node}\" $port first",
    )  # fmt: skip
    monkeypatch.setattr(federation, "READY_S", 20.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] - 100  # the node's Runtime API port: base + 100
    fed = deploy.Federation(tmp_path / "fed", supernodes=1, port=base)
    fed.logs.mkdir(parents=True)
    try:
        (proc,) = fed.start_supernodes([0]).values()
        assert proc.poll() is None, "the node refused after listening counted as started"
        log = (fed.logs / "supernode-0.log").read_text()
        assert log.count("Failed to activate SuperNode") == 1 and log.endswith("SuperNode ID: 7\n")
    finally:
        fed.stop_all()


def test_the_superlink_s_state_is_its_database_file_or_flower_s_memory(tmp_path):
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME

    from pflower.deploy import flower_cli

    assert flower_cli.FLWR_IN_MEMORY_DB_NAME == FLWR_IN_MEMORY_DB_NAME  # Flower's own word
    on_disk = flower_cli.superlink_command(tmp_path, 9094, tmp_path / "superlink.db")
    in_memory = flower_cli.superlink_command(tmp_path, 9094, None)
    assert on_disk[on_disk.index("--database") + 1] == str(tmp_path / "superlink.db")
    assert in_memory[in_memory.index("--database") + 1] == FLWR_IN_MEMORY_DB_NAME
    with pytest.raises(ValueError, match="superlink_state 'redis': must be one of"):
        deploy.Federation(tmp_path, superlink_state="redis")
    with pytest.raises(ValueError, match="threads 0: must be >= 1"):
        deploy.Federation(tmp_path, threads=0)
    with pytest.raises(SystemExit):
        deploy.main(["up", "--dir", str(tmp_path), "--superlink-state", "redis"])


def test_supernodes_on_one_machine_share_its_cores(tmp_path, monkeypatch):
    """Each SuperNode's processes get the cores divided among the SuperNodes as their thread
    count (torch's OpenMP, numpy's BLAS), at least one; a count the operator's environment
    sets is kept, unless ``threads`` is given."""
    from pflower.deploy import federation

    monkeypatch.setattr(federation, "cores", lambda: 8)
    for name in federation.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for supernodes, share in ((1, 8), (2, 4), (3, 2), (8, 1), (20, 1)):
        env = deploy.Federation(tmp_path, supernodes=supernodes).node_env
        assert [env[n] for n in federation.THREAD_VARIABLES] == [str(share)] * 3, supernodes
    assert deploy.Federation(tmp_path, supernodes=2, threads=3).node_env["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    env = deploy.Federation(tmp_path, supernodes=2).node_env
    assert env["OMP_NUM_THREADS"] == "6" and env["OPENBLAS_NUM_THREADS"] == "4"
    assert deploy.Federation(tmp_path, supernodes=2, threads=1).node_env["OMP_NUM_THREADS"] == "1"
    # the SuperLink and the gateway are not SuperNodes: their environment is the operator's
    assert deploy.Federation(tmp_path, supernodes=2).env["OMP_NUM_THREADS"] == "6"
    assert "OPENBLAS_NUM_THREADS" not in deploy.Federation(tmp_path, supernodes=2).env


def _kit_refuses_this_flower() -> bool:
    from pflower.deploy import flower_cli

    try:
        flower_cli.require_checked_flower()
    except RuntimeError:
        return True
    return False


def test_a_flower_older_than_the_kit_was_checked_on_is_refused_at_the_start(
    tmp_path, monkeypatch, capsys
):
    """With flwr 1.35 the SuperLink starts, but its CLI cannot reach it through the kit's
    connection, and ``up`` failed after a minute with "did not come up" (``.ci/compat``): an
    older Flower is refused before anything starts, naming both versions."""
    import pflower.flower
    from pflower.deploy import flower_cli

    for ok in ("1.41.0", "1.42.0", "1.42.1rc1", "2.0.0"):
        flower_cli.require_checked_flower(ok)
    with pytest.raises(RuntimeError, match=r"needs flwr >= 1\.41 .* has flwr 1\.35\.0"):
        flower_cli.require_checked_flower("1.35.0")
    monkeypatch.setattr(pflower.flower, "flower_version", lambda: "1.40.2")
    with pytest.raises(SystemExit) as exited:
        deploy.main(["up", "--dir", str(tmp_path / "fed"), "--supernodes", "1"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "up failed: the deployment kit needs flwr >= 1.41" in err and "flwr 1.40.2" in err
    assert not (tmp_path / "fed" / "superlink.db").exists()


@pytest.mark.skipif(_kit_refuses_this_flower(), reason="the kit refuses this Flower (test above)")
@pytest.mark.drill  # a real SuperLink process (pytest -m drill)
def test_a_superlink_in_memory_comes_up_registers_keys_and_leaves_no_database(tmp_path):
    """``superlink_state="memory"``: Flower's SuperLink with ``:flwr-in-memory:`` answers the
    CLI, takes a SuperNode's key (listed as registered; a second registration is refused as
    a key in use, which ``register`` accepts), and writes no ``superlink.db``."""
    import socket
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fed = deploy.Federation(tmp_path / "fed", supernodes=1, port=port, superlink_state="memory")
    try:
        fed.prepare()
        fed.start_superlink()
        pid = int(fed.entries["superlink"]["pid"])
        fed.register(0)
        listed = subprocess.run(
            [str(Path(sys.executable).parent / "flwr"), "supernode", "ls", fed.name,
             "--format", "json"],
            env=fed.env, capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        nodes = json.loads(listed)["nodes"]
        assert len(nodes) == 1 and nodes[0]["status"] == "registered", nodes
        assert deploy.ALREADY_REGISTERED in fed.register(0).lower()
        assert not (fed.root / "superlink.db").exists()
    finally:
        fed.stop_all()
    assert _gone(pid)


@pytest.mark.skipif(
    not hasattr(__import__("flwr.supercore.superexec.run_superexec").supercore.superexec
                .run_superexec, "_TASK_POLL_INTERVAL_ENV"),
    reason="Flower before 1.41 has no SuperExec task poll variable (its poll is fixed)",
)  # fmt: skip
def test_superexec_task_polls_stretch_with_supernodes_per_core(tmp_path, monkeypatch, capsys):
    """Each SuperExec asks its SuperNode for a task every 0.05 s while the SuperNodes fit the
    cores, and proportionally less often beyond (20 nodes on 2 cores: 0.5 s), through
    Flower's own variable, which Flower's SuperExec reads as that many seconds; a chosen
    interval is used as it is, and one outside Flower's [0.01, 60] s is refused by the kit
    and by ``deploy up`` with the flag's name."""
    from flwr.supercore.superexec import run_superexec as flower

    from pflower.deploy import federation

    var = federation.TASK_POLL_VARIABLE
    assert var == flower._TASK_POLL_INTERVAL_ENV
    assert (federation.MIN_TASK_POLL_S, federation.MAX_TASK_POLL_S) == (
        flower._MIN_TASK_POLL_INTERVAL_SECONDS,
        flower._MAX_TASK_POLL_INTERVAL_SECONDS,
    )
    monkeypatch.setattr(federation, "cores", lambda: 2)
    for supernodes, seconds in ((1, 0.05), (2, 0.05), (3, 0.075), (4, 0.1), (20, 0.5), (200, 5.0)):
        fed = deploy.Federation(tmp_path, supernodes=supernodes)
        assert fed.task_poll_s == seconds, supernodes
        monkeypatch.setenv(var, fed.node_env[var])
        assert flower._get_task_poll_interval() == seconds
    chosen = deploy.Federation(tmp_path, supernodes=20, task_poll_interval=0.05)
    assert chosen.node_env[var] == "0.05"
    monkeypatch.delenv(var)
    assert var not in deploy.Federation(tmp_path).env  # the SuperLink's keeps Flower's 1 s
    for bad in (0.001, 100.0):
        with pytest.raises(ValueError, match=f"task_poll_interval {bad}: must be in"):
            deploy.Federation(tmp_path, task_poll_interval=bad)
    with pytest.raises(SystemExit):
        deploy.main(["up", "--dir", str(tmp_path), "--task-poll-interval", "0"])
    assert "--task-poll-interval 0.0: must be in [0.01, 60] seconds" in capsys.readouterr().err


def test_a_supernode_s_runtime_port_is_another_free_one_where_its_own_is_taken(tmp_path):
    """SuperNode i's Runtime API (its SuperExec's) is on ``port + 100 + i`` unless something
    holds that port (an outgoing connection of the ephemeral range, say): then on a port
    the system hands out, which is free, and not the taken one."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] - 100  # port + 100 + 0 is the one held below
    fed = deploy.Federation(tmp_path, supernodes=2, port=base)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 100))
        holder.listen()
        moved = fed.runtime_port(0)
        assert moved != base + 100
        with socket.socket() as check:  # free: a server can bind it
            check.bind(("127.0.0.1", moved))
    assert fed.runtime_port(0) == base + 100  # its own again once free


def test_a_supernode_whose_port_was_taken_at_its_bind_starts_again_on_another(
    tmp_path, monkeypatch, capsys
):
    """Between ``runtime_port``'s look and the SuperNode's bind another process may take
    the port (uvicorn: "address already in use", and the node exits), later than the settle
    time on a loaded machine: the kit waits for the node to listen, sees it exit, starts it
    again at once on another port, and counts it started once it listens there. A node
    that keeps losing its port is given up after ``PORT_MOVES`` new ports."""
    import socket

    from pflower.deploy import federation

    ready_s = 5.0
    once = tmp_path / "taken-once"
    listen = (
        "import socket, sys, time; s = socket.socket(); "
        "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
        "print('SuperNode ID: 7', flush=True); time.sleep(73)"
    )
    taken = (
        'echo "ERROR:    [Errno 98] error while attempting to bind on '
        "address ('127.0.0.1', $port): address already in use\"; exit 1"
    )
    port = "port=$(echo \"$@\" | grep -o -- '--port [0-9]*' | cut -d' ' -f2); "
    taken_late_then_listening = (
        f'{port}if [ -e {once} ]; then exec {sys.executable} -c "{listen}" "$port"; fi; '
        f"touch {once}; sleep 1.5; {taken}"
    )
    _fake_flower(tmp_path, monkeypatch, taken_late_then_listening)
    monkeypatch.setattr(federation, "READY_S", ready_s)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] - 100
    fed = deploy.Federation(tmp_path / "fed", supernodes=1, port=base)
    fed.logs.mkdir(parents=True)
    try:
        (proc,) = fed.start_supernodes([0]).values()
        time.sleep(0.5)  # a node counted started too early would be gone by now
        assert proc.poll() is None and once.exists()
        assert fed.runtime_ports[0] != base + 100  # the taken one is not tried again
        assert fed.listening(0)
        assert "address already in use" in (fed.logs / "supernode-0.log").read_text()
    finally:
        fed.stop_all()
    # always taken: given up after PORT_MOVES new ports, with Flower's words
    (tmp_path / "bin" / "flower-supernode").write_text(f"#!/bin/bash\n{port}{taken}\n")
    fed = deploy.Federation(tmp_path / "fed2", supernodes=1, port=base)
    fed.logs.mkdir(parents=True)
    with pytest.raises(federation.SuperNodeDied, match="before it listened") as died:
        fed.start_supernodes([0])
    assert "address already in use" in str(died.value)
    text = (fed.logs / "supernode-0.log").read_text()
    assert text.count("address already in use") == 1 + federation.PORT_MOVES


#: a process that stops as Flower's do: on its first SIGTERM it puts the default handler back
#: (a second SIGTERM would kill it), takes a moment to sign off, and notes whether its child
#: (its SuperExec) was still there to be stopped after it, then exits
_FLOWER_LIKE = """
import os, signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "67"])
def sign_off(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(0.5)  # DeactivateNode, on a loaded box
    with open(sys.argv[1], "w") as f:
        f.write("signed off; child alive: %s" % (child.poll() is None))
    sys.exit(0)
signal.signal(signal.SIGTERM, sign_off)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_stop_tree_lets_the_process_sign_off_before_its_children_stop(tmp_path):
    """Issue 50: ``down`` sent a SuperNode SIGTERM twice at once (its own and its process
    group's); Flower's handler puts the default one back after the first, so the second
    killed the node before it deactivated itself, and the next ``up`` waited out its session.
    Now the process alone gets one SIGTERM and ends cleanly (its children still there), and
    only then do the rest of its tree get theirs."""
    said = tmp_path / "said"
    proc = subprocess.Popen(
        [sys.executable, "-c", _FLOWER_LIKE, str(said)], stdout=subprocess.PIPE,
        start_new_session=True, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    (child,) = deploy.descendants(proc.pid)
    deploy.stop_tree(proc.pid, timeout=5)
    assert proc.wait(5) == 0  # its own clean exit, not a signal's
    assert said.read_text() == "signed off; child alive: True"
    assert _gone(child)


def test_the_kit_s_help_is_formatted_and_describes_every_option():
    """Issue 49, item 3: ``python -m pflower.deploy --help`` keeps its examples one per line,
    and every option of every command says what it is."""
    import argparse
    import subprocess
    import sys

    from pflower.deploy.command import command_parser

    helped = subprocess.run([sys.executable, "-m", "pflower.deploy", "--help"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert helped.returncode == 0
    lines = helped.stdout.splitlines()
    assert "    python -m pflower.deploy up --dir deploy --supernodes 2     # all of it, on " \
        "loopback" in lines  # fmt: skip
    assert "    python -m pflower.deploy down --dir deploy" in lines
    parser = command_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    undescribed = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if action.option_strings and action.dest != "help" and not action.help
    ]
    assert undescribed == []
    assert set(commands.choices) == {"credentials", "connection", "gateway", "up", "down"}


def test_up_prints_a_flwr_run_line_with_its_run_config():
    """Issue 49, item 4: the ``flwr run`` line ``up`` prints carries the run config (a short
    first run by default): pasted without one it ran the app's whole default job."""
    import shlex

    from pflower.deploy.command import FIRST_RUN, command_parser, submit_line

    line = submit_line("deploy/flwr-home", "pflower-deployment", FIRST_RUN)
    assert line.startswith("FLWR_HOME=deploy/flwr-home flwr run . pflower-deployment --stream ")
    words = shlex.split(line)
    assert words[words.index("--run-config") + 1] == FIRST_RUN  # as the shell reads it back
    odd = 'outputs-dir="/tmp/x" lr=0.1'
    words = shlex.split(submit_line("h", "n", odd))
    assert words[words.index("--run-config") + 1] == odd
    assert "--run-config" not in submit_line("h", "n", "")  # the app's default job
    assert command_parser().parse_args(["up"]).run_config == FIRST_RUN
