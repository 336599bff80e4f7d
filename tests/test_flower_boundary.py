"""The boundary to Flower (``pflower.flower``, issue 48): every private touch is in one place,
and each is taken away here, the way an upgrade would, to check that the run still completes
with Flower's own behaviour and one warning, or is refused at start naming what changed;
never a crash, never silence."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from flwr.clientapp import ClientApp
from helpers import OUTPUTS_DIR
from test_deploy_kit import _kit_refuses_this_flower

from pflower.flower import FlowerDrift, _said, grids
from pflower.flower import dispatch as flower_dispatch
from pflower.flower import dp as flower_dp
from pflower.testbed.local_grid import LocalGrid, run_local

ROOT = Path(__file__).resolve().parents[1]
#: Flower's public modules (its API reference); everything else of ``flwr`` is private
PUBLIC = {
    "flwr.app",
    "flwr.serverapp",
    "flwr.serverapp.strategy",
    "flwr.clientapp",
    "flwr.simulation",
    "flwr.common",
    "flwr.server",
    "flwr.client",
}
#: where private touches may be: the boundary alone (the deployment kit reaches Flower through
#: its cli, superexec, texts and waits; the testbed's LocalGrid through its local)
ALLOWED = ("pflower/flower/",)
TINY = {
    "dataset": "digits",
    "num-server-rounds": 2,
    "evaluate-every": 2,
    "fraction-train": 1.0,
    "sample-seed": 0,
    "outputs-dir": OUTPUTS_DIR,
}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """``fall_back`` says each change once per process: each test starts unsaid."""
    _said.clear()
    yield
    _said.clear()


def _private_imports() -> list[str]:
    found = []
    for path in sorted((ROOT / "pflower").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if (name == "flwr" or name.startswith("flwr.")) and name not in PUBLIC:
                    found.append(f"{rel}:{node.lineno} {name}")
    return found


def test_private_flower_imports_live_in_the_boundary():
    outside = [f for f in _private_imports() if not f.startswith(ALLOWED)]
    assert not outside, outside
    # the check sees them where they are (it cannot pass by seeing nothing)
    assert any(f.startswith("pflower/flower/dispatch.py") for f in _private_imports())


def test_local_grid_runs_with_flowers_run_record_and_error_codes_taken_away(
    monkeypatch, caplog, tmp_path
):
    """LocalGrid's touches (``pflower.flower.local``): with Flower's ``Run`` and
    ``ErrorCode`` unimportable it runs on a plain run record and the codes' known values,
    saying so; the run goes on, a NaN node's replies dropped and counted."""
    from pflower.flower import local

    for name in ("flwr.supercore.run", "flwr.common.typing", "flwr.common.constant"):
        monkeypatch.setitem(sys.modules, name, None)
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        assert local.empty_run(7) == local.PlainRun(7)
        assert local.error_codes() == (local.NODE_UNAVAILABLE, local.CLIENT_APP_RAISED_EXCEPTION)
        grid = LocalGrid(ClientApp(), 2)
        assert grid.run.fab_hash == "" and grid.run.run_id == grid.run_id
        run = {**TINY, "outputs-dir": str(tmp_path)}
        report = run_local(run, 3, node_configs={0: {"byzantine": "nan"}})
    assert report.rounds[-1].evaluate  # the run went on to its final evaluation
    assert sum(sum(e.dropped.values()) for e in report.rounds) >= 1  # node 0's replies
    warned = [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
    assert sum("run record" in w for w in warned) == 1, warned
    assert sum("error codes" in w for w in warned) == 1, warned


def test_importing_the_apps_imports_no_private_module_of_the_boundary():
    """A run that uses nothing of an adapter never loads what it touches: the apps import
    with the dispatcher's, the waits' and the launch helpers' modules made unimportable."""
    blocked = [
        "flwr.server.superlink.linkstate.in_memory_linkstate",
        "flwr.supercore.inflatable.inflatable_utils",
        "flwr.supernode.start_client_internal",
        "flwr.superlink.grid.http_grid",
    ]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "import pflower.client_app, pflower.server_app, pflower.strategies\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]


def test_a_dispatcher_flower_moved_or_changed_falls_back_with_one_warning(monkeypatch, caplog):
    from pflower.strategies.exchange import index_dispatch

    def moved():
        raise ImportError("No module named 'flwr.server.superlink'")

    monkeypatch.setattr(flower_dispatch, "_link_state", moved)
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        index_dispatch()
        index_dispatch()  # said once
    said = [r.getMessage() for r in caplog.records if "dispatch index" in r.getMessage()]
    assert len(said) == 1 and "ImportError" in said[0] and "Flower's own dispatcher" in said[0]
    with pytest.raises(FlowerDrift, match="cannot be read"):
        flower_dispatch.index_message_dispatch()


def test_the_index_failing_in_flowers_thread_puts_flowers_method_back(monkeypatch, caplog):
    """Flower renames its link state's ``lock``: the indexed method's first call meets the
    AttributeError in Flower's dispatching thread; it answers with Flower's method, which is
    put back for every later call, and says so."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    flower_dispatch.restore_message_dispatch()

    def flowers_renamed(self, node_id, limit, *, run_id=None):
        return ["Flower's answer"]

    monkeypatch.setattr(InMemoryLinkState, "get_message_ins", flowers_renamed)
    monkeypatch.setattr(flower_dispatch, "_FLOWER_SOURCE_MARKS", ())
    flower_dispatch.index_message_dispatch()
    assert InMemoryLinkState.get_message_ins is flower_dispatch.get_message_ins
    state = object.__new__(InMemoryLinkState)  # no `lock`: as if Flower had renamed it
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        assert InMemoryLinkState.get_message_ins(state, 1, None) == ["Flower's answer"]
    assert InMemoryLinkState.get_message_ins is flowers_renamed
    assert any("AttributeError" in r.getMessage() for r in caplog.records)


def test_object_pulls_flower_moved_leave_its_backoff_and_say_so(monkeypatch, caplog):
    import flwr.supercore.inflatable as package

    from pflower.flower import waits
    from pflower.strategies.exchange import shorten_pull_backoff

    monkeypatch.delattr(package, "inflatable_utils")
    monkeypatch.setitem(sys.modules, "flwr.supercore.inflatable.inflatable_utils", None)
    with pytest.raises(FlowerDrift, match="object pulls"):
        waits.cap_pull_backoff(0.1)
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        shorten_pull_backoff(0.1)
    assert any("Flower's own backoff" in r.getMessage() for r in caplog.records)


class RenamedGrid(LocalGrid):
    """Flower's grid after an upgrade renamed and moved it: not recognised by any test."""

    ENGINE = None


def test_a_grid_not_recognised_runs_the_safe_path_with_a_warning(caplog):
    """It is pulled through the window (whose arrivals the round deadline learns from),
    checkpointed as in deployment, the run the same as on a known grid, and said once."""
    from pflower.checkpoint import in_deployment
    from pflower.config import Config
    from pflower.server_app import run
    from pflower.strategies.exchange import Window
    from pflower.testbed.client_app import experiment_client_app

    cfg = Config.from_run_config(TINY)
    grid = RenamedGrid(experiment_client_app(TINY), 3, seed=cfg.seed)
    assert grids.engine_of(Window(grid, None)) == grids.OTHER and in_deployment(grid)
    pulled = []
    real = Window.send_and_receive

    def watched(self, messages, *, timeout=None):
        pulled.append(self.grid)
        return real(self, messages, timeout=timeout)

    Window.send_and_receive = watched
    try:
        with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
            report = run(grid, cfg)
    finally:
        Window.send_and_receive = real
    assert pulled  # the window carried the rounds' messages
    said = [r.getMessage() for r in caplog.records if "recognising the grid" in r.getMessage()]
    assert len(said) == 1 and "RenamedGrid" in said[0]
    assert report.final == run_local(TINY, 3).final


def test_flowers_grids_are_recognised_by_class_and_a_moved_one_by_name(monkeypatch):
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    grid = object.__new__(InMemoryGrid)
    assert grids.engine_of(grid) == grids.SIMULATION
    monkeypatch.setattr(grids, "_flower_class", lambda module, name: None)  # moved
    assert grids.engine_of(grid) == grids.SIMULATION  # its name still says it
    assert grids.engine_of(object.__new__(type("HttpGrid", (), {}))) == grids.DEPLOYMENT


def test_dp_without_flowers_noise_helpers_is_refused_at_start_and_no_dp_runs(monkeypatch):
    monkeypatch.setattr(flower_dp, "MODULE", "flwr.supercore.no_such_module")
    flower_dp.helpers.cache_clear()
    try:
        with pytest.raises(FlowerDrift, match="no_such_module.*dp = 'none'"):
            run_local({**TINY, "dp": "central", "dp-noise": 1.0, "dp-clip": 1.0}, 3)
        assert run_local(TINY, 3).final["personal-accuracy"] > 0.3
    finally:
        monkeypatch.undo()
        flower_dp.helpers.cache_clear()


def test_the_warm_superexec_falls_back_or_fails_visibly(monkeypatch, capfd):
    """A SuperExec that no longer reads ``get_executor``, or a ``run_clientapp`` with other
    arguments: the warm SuperExec says why and Flower's own runs; a task that fails in the
    fork prints its traceback and exits 1 (it was ``os._exit`` with nothing said)."""
    import flwr.supernode.runtime.run_clientapp as flowers
    from flwr.supercore.superexec import run_superexec as superexec

    from pflower.deploy import warm_exec

    assert warm_exec.cannot_warm(superexec) is None  # this Flower: warm
    # a run_superexec that never asks for its executor by that name
    other = types.SimpleNamespace(run_superexec=lambda **kw: None)
    assert "get_executor" in warm_exec.cannot_warm(other)

    def changed(runtime_api_address, token, *, certificates=None):  # another signature
        raise TypeError("run_clientapp() got an unexpected keyword argument 'insecure'")

    monkeypatch.setattr(flowers, "run_clientapp", changed)
    assert "other arguments" in warm_exec.cannot_warm(superexec)
    spec = {
        "runtime_api_address": "127.0.0.1:1",
        "token": "t",
        "insecure": True,
        "root_certificates_path": None,
        "parent_pid": None,
        "runtime_dependency_install": False,
    }
    assert warm_exec._run_task(spec) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and "unexpected keyword argument" in err


def test_pflower_run_finds_its_run_when_flower_words_it_otherwise(monkeypatch):
    from pflower import launch

    listing = {
        "success": True,
        "runs": [
            {"run-id": "7", "pending-at": "2026-11-28T03:00:00"},
            {"run-id": "12", "pending-at": "2026-11-28T04:00:00"},
        ],
    }
    answer = subprocess.CompletedProcess([], 0, json.dumps(listing), "")
    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: answer)
    assert launch.newest_run(None) == 12
    assert launch.RUN_STARTED.search("🎊 Successfully started run 42").group(1) == "42"


def test_check_config_says_when_flowers_parser_moved(monkeypatch, capsys):
    from pflower import launch
    from pflower.flower import cli

    assert launch.check([str(ROOT), "-c", "lr=0.1"]) == launch.COMPLETED
    monkeypatch.setattr(cli, "MODULE", "flwr.common.no_such_config")
    assert launch.check([str(ROOT), "-c", "lr=0.1"]) == launch.FAILED
    assert "cannot check" in capsys.readouterr().err


def test_children_find_this_environments_flower_first():
    from pflower.flower.cli import with_own_bin

    env = with_own_bin({"PATH": os.pathsep.join(["/usr/bin", str(Path(sys.executable).parent)])})
    first, *rest = env["PATH"].split(os.pathsep)
    assert first == str(Path(sys.executable).parent) and first not in rest


def test_pflower_run_fails_when_the_superlink_is_gone_though_flwr_run_exits_0(
    monkeypatch, capsys, tmp_path
):
    """Flower's ``flwr run --stream`` exits 0 when its SuperLink dies mid-run (issue 50);
    ``pflower run`` asks for the run's status, gets no answer, and exits 1 saying how to
    resume."""
    from pflower import launch

    class Flower:
        stdout = iter(
            ["🎊 Successfully started run 5\n", "Connection to the SuperLink is unavailable\n"]
        )

        def __init__(self, *args, **kwargs):
            pass

        def wait(self):
            return 0

    def gone(run_id, superlink):
        raise RuntimeError("flwr ls --run-id 5: the SuperLink is unavailable")

    monkeypatch.setattr(launch.subprocess, "Popen", Flower)
    monkeypatch.setattr(launch, "run_status", gone)
    monkeypatch.setattr(launch, "LOG_DIR", tmp_path)  # not the user's ~/pflower/logs
    assert launch.run([str(ROOT), "--no-check"]) == launch.FAILED
    err = capsys.readouterr().err
    assert "run 5" in err and "may have stopped" in err and "resume-from" in err


# --- the deployment kit's touches (issue 48 item 1: gathered in pflower.flower) -------------
#: the kit refuses a Flower older than it was checked on (1.41) at start: its adapters are
#: checked on 1.41 and 1.42 (``.ci/compat`` runs this file on 1.35)
KIT_FLOWER = pytest.mark.skipif(
    _kit_refuses_this_flower(),
    reason="the deployment kit refuses this Flower at start (flwr < 1.41)",
)


@KIT_FLOWER
def test_the_words_the_kit_reads_are_in_the_installed_flowers_source():
    """``pflower.flower.texts``: each word the deployment kit looks for in Flower's output is
    in this Flower's source, as it was in 1.41 and 1.42 (a reworded one fails here before it
    turns an explanation into Flower's bare error)."""
    import flwr

    from pflower.flower import texts

    source = "\n".join(
        p.read_text(errors="replace") for p in Path(flwr.__file__).parent.rglob("*.py")
    )
    assert [w for w in texts.FLOWER_SAYS if w not in source] == []
    assert "a word Flower never says" not in source  # the check can fail


@KIT_FLOWER
def test_the_kits_flower_cli_touches_moved_are_refused_by_name(monkeypatch, tmp_path):
    """``pflower.flower.cli``: Flower's connection writer and ``flower_supernode`` moved (the
    modules made unimportable, as after an upgrade that moved them): ``FlowerDrift`` naming
    the module, which ``deploy up`` and ``python -m pflower.deploy.supernode`` print as their
    one-line refusal; this Flower's are found and the connection written with them."""
    import tomllib

    from pflower.deploy import connection
    from pflower.flower import cli

    written = connection(tmp_path / "home", "here", "127.0.0.1:1", __file__)
    here = tomllib.loads(written.read_text())["superlink"]
    assert here["default"] == "here" and here["here"]["address"] == "127.0.0.1:1"
    assert callable(cli.flower_supernode())
    for name in (*cli.CONFIG_MODULES, cli.SUPERNODE_MODULE):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(FlowerDrift, match="flwr.cli.flower_config"):
        connection(tmp_path / "home", "here", "127.0.0.1:1", __file__)
    with pytest.raises(FlowerDrift, match="flwr.supernode.cli.flower_supernode"):
        cli.flower_supernode()


@KIT_FLOWER
def test_the_warm_superexecs_flower_touches_moved_say_what_changed(monkeypatch):
    """``pflower.flower.superexec``: Flower's ``run_clientapp`` module gone, or without a hook
    the warm SuperExec wraps, its ``push_message`` pushing otherwise, a Runtime API message
    without a field the warm SuperExec sends: ``cannot_warm`` names it (the warm SuperExec
    then runs Flower's own, cold); importing the warm SuperExec's module loads none of these
    Flower modules."""
    import flwr.supernode.runtime.run_clientapp as flowers
    from flwr.supercore.superexec import run_superexec

    from pflower.flower import superexec

    assert superexec.cannot_warm(run_superexec) is None
    monkeypatch.delattr(flowers, "push_task_output")
    assert superexec.cannot_warm(run_superexec) == (
        "this Flower's run_clientapp module has no push_task_output"
    )
    monkeypatch.undo()
    # a push_message that no longer pushes its objects itself: the reply a killed child kept
    # (note_progress) would not be what it pushes
    monkeypatch.setattr(flowers, "push_message", lambda client, message, context: None)
    assert "push_message no longer calls client.PushMessages" in superexec.cannot_warm(
        run_superexec
    )
    monkeypatch.undo()
    # a Runtime API message without a field complete_push sends
    fields = {**superexec.PUSH_FIELDS, "flwr.proto.message_pb2.PushObjectRequest": ("lease",)}
    monkeypatch.setattr(superexec, "PUSH_FIELDS", fields)
    assert (
        superexec.cannot_warm(run_superexec) == "this Flower's PushObjectRequest has no field lease"
    )
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, superexec.RUN_CLIENTAPP, None)
    said = superexec.cannot_warm(run_superexec)
    assert "not the one checked" in said and superexec.RUN_CLIENTAPP in said
    code = (
        "import sys\n"
        "import pflower.deploy.warm_exec, pflower.deploy.supernode, pflower.deploy\n"
        "print([m for m in sys.modules if m.startswith(('flwr.supernode.runtime', "
        "'flwr.supercore.superexec', 'flwr.cli', 'flwr.supernode.cli'))])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]
