"""The warm SuperExec (``pflower.deploy.warm_exec``): a SuperNode with ``--isolation process``
runs every message in a fork of a process that imported torch and the app once. The zygote
forks with no other thread alive, a fork imports nothing more to serve a run's messages, and
a loopback deployment (TLS, authentication, gateway; the kit's shorter waits) with it
completes a run whose results equal the same run on LocalGrid."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.drill  # a zygote's warm-up: its imports (pytest -m drill)
def test_the_zygote_forks_single_threaded():
    from pflower.deploy.warm_exec import ForkExecutor

    executor = ForkExecutor()
    try:
        assert executor.threads_at_fork == 1  # no thread a fork could leave holding a lock
    finally:
        executor.close()


#: in a fresh process: the zygote's warm-up, then every recorded (message, context) served by
#: the production ClientApp, as forks of the zygote serve them; prints what that imported
_REPLAY = """
import json, pickle, sys
from pflower.deploy.warm_exec import warm_up
warm_up()
from pflower.client_app import build_client_app
with open(sys.argv[1], "rb") as f:
    runs = pickle.load(f)
before = set(sys.modules)
for run, served in runs:
    app = build_client_app(run)
    for msg, context in served:
        app(msg, context)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


@pytest.mark.drill  # the warm SuperExec's forks: a minute of runs (pytest -m drill)
def test_a_fork_of_the_warm_zygote_imports_nothing(tmp_path):
    """What the production ClientApp imports while it serves a run's messages (start-up
    query, training, evaluation; every algorithm) after the zygote's warm-up: nothing. Each
    task runs in a new fork, so a module imported lazily there is imported again for every
    message (torch's optimizers import torch._dynamo on first use: 2.8 s a message)."""
    from pflower.client_app import build_client_app
    from pflower.testbed.local_grid import run_local

    runs = []
    for algorithm in ("fedavg", "local", "fedalt", "fedsim", "apfl", "pflego", "ffgg"):
        run = {
            "algorithm": algorithm,
            "dataset": "digits",
            "num-server-rounds": 2,
            "evaluate-every": 1,
            "outputs-dir": str(tmp_path / algorithm),
        }
        app, served = build_client_app(run), []

        def record(msg, context, app=app, served=served):  # as received, state included
            served.append(pickle.dumps((msg, context)))
            return app(msg, context)

        run_local(run, 2, client_app=record)
        assert len(served) >= 6  # queries, training and evaluation of both nodes
        runs.append((run, [pickle.loads(m) for m in served]))
    messages = tmp_path / "served.pickle"
    messages.write_bytes(pickle.dumps(runs))
    done = subprocess.run(
        [sys.executable, "-c", _REPLAY, str(messages)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


@pytest.mark.skipif(
    shutil.which("flower-superlink") is None
    and not (Path(sys.executable).parent / "flower-superlink").exists(),
    reason="Flower's deployment executables are not installed",
)
@pytest.mark.drill
def test_a_warm_federation_runs_and_equals_local_grid(tmp_path):
    from pflower.deploy import Federation
    from pflower.testbed.local_grid import run_local

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = {
        "algorithm": "fedalt",
        "dataset": "digits",
        "split": "head",
        "pretrain-rounds": 1,  # a personal-init record, then checkpoints of it
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "evaluate-every": 3,
        "finetune-epochs": 1,
        "outputs-dir": str(tmp_path / "outputs"),
    }
    # with the kit's shorter waits: Flower's SuperNode through pflower.deploy.supernode
    fed = Federation(tmp_path / "fed", supernodes=2, port=port, warm=True, poll_interval=0.2)
    try:
        fed.up()
        assert {"warm-exec-0", "warm-exec-1"} <= set(fed.entries)
        assert fed.entries["supernode-0"]["command"][1:3] == ["-m", "pflower.deploy.supernode"]
        done = fed.run(run, REPO, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        fed.stop_all()
    assert not fed.entries  # every process stopped, the warm SuperExecs too
    (results,) = (tmp_path / "outputs").glob("*/results.json")
    deployed = json.loads(results.read_text())["final"]
    local = run_local({**run, "outputs-dir": str(tmp_path / "local")}, 2).final
    assert deployed["personal-accuracy"] == local["personal-accuracy"]
    assert deployed["clients"] == 2


#: in a fresh process, as the zygote and its forks do: a fork loads a client's arrays and hands
#: them back; the zygote adopts them and the next fork starts with them (prints the calls of
#: the loading function each fork made, and whether a device's own file came back)
_HAND_BACK = """
import json, os, sys
from pathlib import Path
import numpy as np
from pflower.config import Config
from pflower.deploy.warm_exec import _adopt, _hand_back, warm_up
from pflower.task.data import loaders
warm_up()
calls = Path(sys.argv[1]) / "calls"
fn = loaders.client_arrays.fn
def counting(*args):
    with open(calls, "a") as f:
        f.write("1")
    return fn(*args)
loaders.client_arrays.fn = counting
node_file = Path(sys.argv[1]) / "node.npz"
np.savez(node_file, x=np.random.default_rng(0).normal(size=(40, 3)), y=np.arange(40) % 2)
digits = Config.from_run_config({"dataset": "digits"})
node = Config.from_run_config({"dataset": "node", "input-shape": "3", "num-classes": 2})
handed = Path(sys.argv[1]) / "handed.pkl"
seen = []
for _ in range(2):
    known = {k for k, _ in loaders.client_arrays.items()}
    pid = os.fork()
    if pid == 0:
        a = loaders.client_arrays(digits, 1, 3, None)
        loaders.client_arrays(node, 0, 1, str(node_file))
        _hand_back(handed, known)
        os._exit(0)
    os.waitpid(pid, 0)
    seen.append(calls.read_text().count("1") if calls.exists() else 0)
    calls.unlink(missing_ok=True)
    _adopt(handed)
keys = [k for k, _ in loaders.client_arrays.items()]
print(json.dumps({"calls": seen, "kept": [k[0].dataset for k in keys], "left": handed.exists()}))
"""


@pytest.mark.drill  # the warm SuperExec's forks: a minute of runs (pytest -m drill)
def test_a_fork_hands_its_data_arrays_back_and_the_next_fork_starts_with_them(tmp_path):
    """The first fork loads the client's arrays (and a device file's); the zygote adopts the
    former only, so the second fork loads only the device file again; nothing is left on
    disk."""
    done = subprocess.run(
        [sys.executable, "-c", _HAND_BACK, str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said == {"calls": [2, 1], "kept": ["digits"], "left": False}


# --- the warm SuperExec supervises itself (issue 50) ---------------------------------------
#: fake tasks and answers for a real ForkExecutor (its zygote forks them as it forks Flower's
#: run_clientapp); module level: the zygote is a fork of this process


def _write_whole(path, text):
    """``text`` at ``path``, whole: the tests poll for the file, and one found empty (written
    by another process, not yet filled) made a loaded run fail reading it."""
    Path(path + ".part").write_text(text)
    os.replace(path + ".part", path)


def _write_pid(path):
    """This process's pid at ``path``, whole."""
    _write_whole(path, str(os.getpid()))


def _note_pid(spec, hand_back, progress):
    _write_pid(spec["out"])
    return 0


def _hang(spec, hand_back, progress):
    from pflower.deploy.warm_exec import _note

    _note(progress, run=7, task=11)  # as the child notes once Flower pulled its task
    _write_pid(spec["out"])
    time.sleep(120)
    return 0


def _answer(spec, record, how):
    _write_whole(spec["answered"], json.dumps({"run": record.get("run"), "how": how}))
    return "answered (test)"


def _until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _dead(pid):
    from pflower.deploy.processes import alive

    return not alive(pid)


@pytest.fixture(scope="module")
def warm():
    """The zygote's imports once in this process, so that every zygote forked by these tests
    (and each restart) is ready at once."""
    from pflower.deploy.warm_exec import warm_up

    warm_up()


def test_a_killed_zygote_is_started_again_and_runs_the_next_task(tmp_path, warm, capfd):
    """Issue 50: a killed zygote took the warm SuperExec down at its next task
    (BrokenPipeError) and the node ran nothing more. Now the next task, handed to the dead
    zygote, starts a new one and runs; a zygote that dies between tasks is found by the poll
    (``reconcile``) first."""
    from pflower.deploy.warm_exec import ForkExecutor

    executor = ForkExecutor(task=_note_pid)
    try:
        first = executor.zygote
        os.kill(first, signal.SIGKILL)
        assert _until(lambda: _dead(first))
        executor.submit({"out": str(tmp_path / "a")})  # the pipe is broken: a new zygote
        assert _until((tmp_path / "a").exists)
        assert executor.restarts == 1 and executor.zygote != first
        second = executor.zygote
        os.kill(second, signal.SIGKILL)
        assert _until(lambda: _dead(second))
        executor.reconcile()  # Flower's loop calls it before each poll
        assert executor.restarts == 2 and executor.zygote not in (first, second)
        executor.submit({"out": str(tmp_path / "b")})
        assert _until((tmp_path / "b").exists)
    finally:
        executor.close()
    said = capfd.readouterr().err
    assert f"its zygote (pid {first}) was killed by SIGKILL; starting a new one" in said


def test_a_killed_task_is_said_answered_for_and_the_next_task_runs(tmp_path, warm, capfd):
    """Issue 50: a fork killed mid-task was reaped in silence and its SuperNode waited for its
    reply. Now the zygote says which run and task died and of what, answers for it
    (``answer_for``, replaced here), and runs the next task; the zygote itself lives on."""
    from pflower.deploy.warm_exec import ForkExecutor

    executor = ForkExecutor(task=_hang, answer=_answer)
    try:
        spec = {"out": str(tmp_path / "pid"), "answered": str(tmp_path / "answered")}
        executor.submit(spec)
        assert _until((tmp_path / "pid").exists)
        child = int((tmp_path / "pid").read_text())
        os.kill(child, signal.SIGKILL)
        assert _until((tmp_path / "answered").exists)
        assert json.loads((tmp_path / "answered").read_text()) == {
            "run": 7,
            "how": "killed by SIGKILL",
        }
        executor.submit({**spec, "out": str(tmp_path / "next")})
        assert _until((tmp_path / "next").exists)
        assert executor.restarts == 0
        os.kill(int((tmp_path / "next").read_text()), signal.SIGKILL)
    finally:
        executor.close()
    said = capfd.readouterr().err
    assert f"the ClientApp task of pid {child} (run 7, task 11) was killed by SIGKILL" in said
    assert f"the task of pid {child}: answered (test)" in said


class _FakeRuntime:
    """The Runtime API calls ``answer_for`` makes, recorded; ``PullMessages`` hands out
    ``waiting`` (a message the dead child had not taken) once."""

    def __init__(self, waiting=None):
        self.waiting, self.calls = waiting, []

    def PullMessages(self, request):
        from flwr.common.serde import message_to_proto
        from flwr.proto.runtime_pb2 import PullAppMessagesResponse

        self.calls.append(("PullMessages", None))
        waiting, self.waiting = self.waiting, None
        return PullAppMessagesResponse(
            messages_list=[message_to_proto(waiting)] if waiting is not None else []
        )

    def PushMessages(self, request):
        from flwr.common.serde import message_from_proto
        from flwr.proto.runtime_pb2 import PushAppMessagesResponse

        self.calls.append(("PushMessages", message_from_proto(request.messages_list[0])))
        return PushAppMessagesResponse(message_ids=["m"], objects_to_push=[], session_id="s")

    def PushObject(self, request):  # nothing asked for: never called
        raise AssertionError("no object was asked for")

    def PushTaskOutput(self, request):
        self.calls.append(("PushTaskOutput", (request.sub_status, request.details)))


def _message():
    """A train message as a SuperNode holds it (its id set)."""
    from flwr.app import Metadata, RecordDict
    from flwr.app.message import make_message

    metadata = Metadata(
        run_id=5, message_id="a" * 64, src_node_id=1, dst_node_id=42, reply_to_message_id="",
        group_id="3", created_at=time.time(), ttl=3600.0, message_type="train",
    )  # fmt: skip
    return make_message(metadata, RecordDict())


@pytest.mark.parametrize("noted", [True, False])
def test_a_dead_task_is_answered_with_an_error_reply_to_its_message(noted):
    """What the zygote does for a killed task's child (``answer_for``): an error reply to the
    task's message (the one the child noted, else the one it had not taken yet) and the task
    ended FAILED, as Flower's run_clientapp does for a ClientApp that fails; nothing for a
    child whose reply had been pushed (one whose push was cut off: the next test)."""
    from flwr.common.constant import ErrorCode, SubStatus

    from pflower.deploy.warm_exec import answer_for

    message = _message()
    runtime = _FakeRuntime(waiting=None if noted else message)
    record = {"run": 5, "task": 9, "message": message} if noted else {}
    done = answer_for({}, record, "killed by SIGKILL", client=runtime)
    assert done.startswith("answered with an error reply")
    names = [name for name, _ in runtime.calls]
    assert names == (["PushMessages", "PushTaskOutput"] if noted else
                     ["PullMessages", "PushMessages", "PushTaskOutput"])  # fmt: skip
    reply = runtime.calls[-2][1]
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_CRASHED
    assert reply.metadata.reply_to_message_id == "a" * 64
    assert "killed by SIGKILL" in reply.error.reason
    assert runtime.calls[-1][1][0] == SubStatus.FAILED

    runtime = _FakeRuntime(waiting=message)  # a reply pushed whole: nothing to do
    record = {"pushing": True, "pushed": True, "message": message}
    assert "had reached the SuperNode" in answer_for({}, record, "killed", client=runtime)
    assert runtime.calls == []
    runtime = _FakeRuntime()  # nothing to take back: Flower's heartbeat lapse answers
    assert "heartbeat lapses" in answer_for({}, {}, "killed", client=runtime)
    assert [name for name, _ in runtime.calls] == ["PullMessages"]


class _SuperNode:
    """The Runtime API of a SuperNode for one task (run 5, node 42), in process: ``PushMessages``
    and ``PushObject`` answered by Flower's own handlers on Flower's own node state (its
    sessions, its object store: what the SuperNode's sender waits on), the task's pulls as a
    SuperNode answers them, ``PushTaskOutput`` recorded. ``cut`` (a function of the call's
    name and request, called before it is answered; ``after``: once answered) may raise
    ``_Killed`` to cut the child off there."""

    def __init__(self, message):
        import types

        from flwr.supercore.object_store import ObjectStoreFactory
        from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

        self.message, self.state = message, InMemoryNodeState(ObjectStoreFactory().store())
        self.task = types.SimpleNamespace(run_id=5, task_id=9)
        self.outputs, self.calls = [], []
        self.cut = self.after = lambda name, request: None

    def _handle(self, name, request):
        from flwr.supernode.servicer.runtime import runtime_handlers

        self.calls.append(name)
        self.cut(name, request)
        res = getattr(runtime_handlers, name)(request, self.state, self.task)
        self.after(name, request)
        return res

    def PullTaskInput(self, request):
        from flwr.proto import runtime_pb2

        response = runtime_pb2.PullTaskInputResponse(task_id=9)
        response.run.run_id, response.context.node_id = 5, 42
        return response

    def PullMessages(self, request):
        from flwr.common.serde import message_to_proto
        from flwr.proto import runtime_pb2

        response = runtime_pb2.PullAppMessagesResponse(
            messages_list=[message_to_proto(self.message)]
        )
        response.message_object_trees.add().object_id = "a" * 64
        return response

    def PushMessages(self, request):
        return self._handle("push_messages", request)

    def PushObject(self, request):
        return self._handle("push_object", request)

    def ConfirmMessageReceived(self, request):
        return self._handle("confirm_message_received", request)

    def PushTaskOutput(self, request):
        from flwr.common.serde import context_from_proto

        context = context_from_proto(request.context) if request.HasField("context") else None
        self.outputs.append((request.sub_status, request.details, context))

    def client_class(self):
        """A client class for Flower's run_clientapp module: its instances are this node."""
        node = self

        class Runtime(_SuperNode):
            def __init__(self):
                self.__dict__ = node.__dict__

        return Runtime

    def reply_as_sent(self, reply_id=None):
        """The reply as the SuperNode's sender (``_push_messages``) would send it: its id
        (the one it takes, or ``reply_id``: taken before), and its objects' contents (``None``:
        removed from the store; ``b""``: still awaited)."""
        from flwr.supercore.inflatable.inflatable_object import iterate_object_tree

        if reply_id is None:
            (reply,) = self.state.get_messages_legacy(is_reply=True)  # as the sender takes it
            reply_id = reply.metadata.message_id
        store = self.state.object_store
        tree = store.get_object_tree(reply_id)
        return reply_id, {
            node.object_id: store.get(node.object_id) for node in iterate_object_tree(tree)
        }


class _Killed(BaseException):
    """The kill of a task's child, where ``_SuperNode.cut`` raises it."""


def _reply_and_context(message):
    """A training reply with arrays (several objects, pushed by Flower's pushing threads), and
    a context whose state the ClientApp changed."""
    import numpy as np
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(50, 20)).astype("float32"), np.arange(7.0), np.ones((3, 4))]
    reply = Message(
        RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"loss": 0.25})}),
        reply_to=message,
    )
    context = Context(run_id=5, node_id=42, node_config={}, state=RecordDict(), run_config={})
    context.state["personal"] = MetricRecord({"rounds": 3})
    return reply, context, arrays


def test_a_task_child_notes_its_message_and_its_reply_push(tmp_path, monkeypatch):
    """What a task's child notes for the zygote (``_record_progress``, around the Runtime API
    client Flower's ``run_clientapp`` builds and Flower's own ``push_message``): its run and
    task once pulled, its message as soon as it is taken (before its arrays), the reply it is
    about to push, kept whole before the push starts (each object's bytes, under the ids the
    SuperNode asks for), the SuperNode's push session and the objects it asked for, each
    object it stored, and the push's end, after which nothing of the reply is left."""
    from flwr.supernode.runtime import run_clientapp as flower

    from pflower.deploy.warm_exec import _read_progress, _record_progress

    message, progress, seen = _message(), tmp_path / "1.progress", []
    node = _SuperNode(message)

    def at_push_messages(name, request):  # as noted when the push starts
        if name == "push_messages":
            seen.append((_peek(progress), _peek(progress.with_suffix(".reply"))))

    node.cut = at_push_messages
    monkeypatch.setattr(flower, "RuntimeHttpClient", node.client_class())
    _record_progress(progress)
    client = flower.RuntimeHttpClient()
    client.PullTaskInput(None)
    assert set(_peek(progress)) == {"run", "task", "node"}  # not yet its message
    client.PullMessages(None)
    assert _peek(progress)["message"].metadata.message_id == "a" * 64
    reply, context, arrays = _reply_and_context(message)
    flower.push_message(client, reply, context)

    ((noted, kept),) = seen
    assert noted["pushing"] and noted["kept"] and "pushed" not in noted and "session" not in noted
    reply_id, sent = node.reply_as_sent()
    assert noted["reply_id"] == reply_id
    assert kept["objects"] == sent  # every object's bytes, as the SuperNode stored them
    assert (kept["node"], kept["run"], kept["status"], kept["details"]) == (42, 5, "completed", "")
    # the arrays' bytes are in what was kept
    assert any(arrays[0].tobytes() in content for content in kept["objects"].values())
    record = _read_progress(progress)
    assert {k: record[k] for k in ("run", "task", "node", "pushing", "pushed")} == {
        "run": 5, "task": 9, "node": 42, "pushing": True, "pushed": True,
    }  # fmt: skip
    assert record["session"] and set(record["to_push"]) == set(sent) == record["sent"]
    assert record["message"].metadata.reply_to_message_id == ""
    assert not list(tmp_path.iterdir())  # read once, removed; the kept reply too


@pytest.mark.parametrize("cut", ["after-first-object", "before-its-answer", "not-kept"])
def test_a_reply_cut_off_mid_push_is_pushed_whole_by_the_zygote(tmp_path, monkeypatch, cut):
    """Issue 50: a child killed while it pushed its reply left Flower's SuperNode waiting for
    the rest of it forever (its sender loops while an object's content is ``b""``). The
    zygote (``answer_for``) now finishes the push from what the child kept and ends the task
    as Flower's ``run_clientapp`` does after a push (COMPLETED, the ClientApp's context):
    killed once the SuperNode had stored one object (the rest pushed in the child's push
    session), or once the SuperNode had taken its ``PushMessages`` but before the child heard
    the answer (``PushMessages`` again: the SuperNode keeps the message and asks for what it
    lacks). Either way the SuperNode ends with the reply whole, equal to the ClientApp's
    reply. Where nothing was kept, the reply's objects are removed, so the SuperNode's
    sender fails that send and goes on (``None``), and the task ends FAILED."""
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
    from flwr.supernode.runtime import run_clientapp as flower

    from pflower.deploy.warm_exec import _read_progress, _record_progress, answer_for

    message, progress = _message(), tmp_path / "1.progress"
    node = _SuperNode(message)
    stored = []

    def kill(name, request):
        if cut == "before-its-answer" and name == "push_messages":
            raise _Killed
        if cut != "before-its-answer" and name == "push_object" and stored:
            raise _Killed  # the second object's push and every one after it

    def count(name, request):
        if name == "push_object":
            stored.append(request.object_id)

    node.after = kill if cut == "before-its-answer" else count
    node.cut = (lambda name, request: None) if cut == "before-its-answer" else kill
    monkeypatch.setattr(flower, "RuntimeHttpClient", node.client_class())
    _record_progress(progress)
    client = flower.RuntimeHttpClient()
    client.PullTaskInput(None)
    client.PullMessages(None)
    reply, context, arrays = _reply_and_context(message)
    with pytest.raises(_Killed):
        flower.push_message(client, reply, context)
    reply_id, contents = node.reply_as_sent()
    assert b"" in contents.values()  # what the SuperNode's sender would wait for, forever
    if cut == "not-kept":
        progress.with_suffix(".reply").unlink()
    record = _read_progress(progress)
    assert record["pushing"] and "pushed" not in record
    node.cut = node.after = lambda name, request: None
    node.calls.clear()

    done = answer_for({}, record, "killed by SIGKILL", client=node)

    if cut == "not-kept":
        assert "had not been kept" in done
        assert node.state.object_store.get(reply_id) is None  # the sender's wait ends
        ((status, details, kept_context),) = node.outputs
        assert status == "failed" and "killed by SIGKILL" in details and kept_context is None
        return
    assert "pushed from what the child kept" in done, done
    assert node.calls[0] == ("push_messages" if cut == "before-its-answer" else "push_object")
    resent = [c for c in node.calls if c == "push_object"]
    # only what the SuperNode lacked: not the object(s) the child had pushed
    assert record.get("sent", set()) == set(stored)
    assert (len(stored) > 0) == (cut == "after-first-object")
    assert len(resent) == len(contents) - len(stored)
    _, contents = node.reply_as_sent(reply_id)
    assert b"" not in contents.values() and None not in contents.values()
    assert not node.state.get_messages_legacy(is_reply=True)  # no second reply to send
    whole = inflate_object_from_contents(reply_id, dict(contents))
    assert isinstance(whole, Message)
    got = [a.numpy() for a in whole.content["arrays"].values()]
    assert all(np.array_equal(a, b) for a, b in zip(got, arrays, strict=True))
    assert whole.content["metrics"]["loss"] == 0.25
    assert whole.metadata.reply_to_message_id == "a" * 64
    ((status, details, kept_context),) = node.outputs  # the task's end, as run_clientapp's
    assert (status, details) == ("completed", "")
    assert kept_context.state["personal"]["rounds"] == 3


def _peek(path):
    return pickle.loads(path.read_bytes())


# --- the crash drill of the warm path (issue 50, item 5) -----------------------------------


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a warm SuperExec's: its zygote)."""
    from pflower.deploy.processes import _stat, descendants

    return [p for p in descendants(pid) if (_stat(p) or ("", 0))[1] == pid]


def _warm_federation(tmp_path: Path, rounds: int):
    """The crash drills' federation (loopback, TLS, authentication, gateway, two warm
    SuperNodes polling every 0.2 s), not yet up; the run config of a ``rounds``-round run
    evaluated at its end, with its outputs under ``tmp_path``; the run's log."""
    from test_deployment import RUN, _free_port

    from pflower.deploy import Federation

    run_config = {**RUN, "num-server-rounds": rounds, "evaluate-every": rounds,
                  "outputs-dir": str(tmp_path / "outputs")}  # fmt: skip
    fed = Federation(tmp_path / "fed", supernodes=2, port=_free_port(), warm=True,
                     poll_interval=0.2)  # fmt: skip
    return fed, run_config, fed.logs / "run.log"


def _a_task_at_work(fed, i: int, tmp: Path, timeout: float = 120) -> tuple[int, int]:
    """The pid of a task's child of SuperNode ``i``'s warm SuperExec that has taken a train
    message and not yet started its reply's push (what it noted: ``_record_progress``), and
    the message's round (the train messages the node has received: one a round, as every
    node trains in every round): a fork killed there is mid-task, its reply neither begun
    nor sent."""
    from pflower.deploy.processes import descendants

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine = set(descendants(int(fed.entries[f"warm-exec-{i}"]["pid"])))
        for path in tmp.glob("pflower-warm-exec-*/*.progress"):
            if int(path.stem) not in mine:
                continue
            try:
                record = pickle.loads(path.read_bytes())
            except (OSError, EOFError, pickle.UnpicklingError):
                continue
            message = record.get("message")
            train = message is not None and message.metadata.message_type == "train"
            if train and not record.get("pushing"):
                said = (fed.logs / f"supernode-{i}.log").read_text(errors="replace")
                return int(path.stem), said.count("Receiving: train message")
        time.sleep(0.01)
    raise AssertionError(f"no task of supernode-{i} at work within {timeout} s")


@pytest.mark.skipif(
    shutil.which("flower-superlink") is None
    and not (Path(sys.executable).parent / "flower-superlink").exists(),
    reason="Flower's deployment executables are not installed",
)
@pytest.mark.drill
def test_a_warm_federation_recovers_within_a_round_from_a_killed_task_and_a_killed_zygote(
    tmp_path, monkeypatch
):
    """Issue 50, item 5, on the loopback deployment (TLS, authentication, gateway, two warm
    SuperNodes, the kit's shorter waits): SIGKILL

    1. the fork running SuperNode 0's training task, after it took its message and before its
       reply's push: its warm SuperExec says so and answers for it; the server drops that
       reply (a client error naming the kill) in that round only, the round ends in seconds
       (not at the round timeout: at least 120 s), and the next round has both nodes' replies;
    2. SuperNode 1's zygote while its fork trains: the fork finishes its task, a new zygote is
       started, and the next round has both nodes' replies too.

    The run completes and ``flwr run`` exits 0. Before issue 50 the first cost every later
    round the round timeout, and the second dropped the node every round until down + up."""
    from test_deployment import _results, _wait_for

    tmp = tmp_path / "tmp"  # the zygotes' private directories (their children's progress)
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    rounds = 7
    fed, run_config, log = _warm_federation(tmp_path, rounds)
    try:
        fed.up()
        run = fed.submit(run_config, REPO, "run")
        _wait_for(log, f"round 1/{rounds}", run, timeout=300)

        # 1. a task's fork, mid-task
        victim, fork_round = _a_task_at_work(fed, 0, tmp)
        os.kill(victim, signal.SIGKILL)
        _wait_for(log, f"round {fork_round + 1}/{rounds}", run, timeout=300)

        # 2. a zygote, while its fork trains
        _, zygote_round = _a_task_at_work(fed, 1, tmp)
        (zygote,) = _children(int(fed.entries["warm-exec-1"]["pid"]))
        os.kill(zygote, signal.SIGKILL)
        assert run.wait(600) == 0, log.read_text(errors="replace")[-4000:]
        warm0 = (fed.logs / "warm-exec-0.log").read_text(errors="replace")
        warm1 = (fed.logs / "warm-exec-1.log").read_text(errors="replace")
    finally:
        fed.stop_all()
    assert f"the ClientApp task of pid {victim} (run " in warm0
    assert f"the task of pid {victim}: answered with an error reply" in warm0
    assert f"its zygote (pid {zygote}) was killed by SIGKILL; starting a new one" in warm1
    assert "new zygote" in warm1 and "ready" in warm1

    (final,) = _results(tmp_path / "outputs")
    by_round = {r["round"]: r for r in final["rounds"]}
    seconds = {r: round(e["seconds"], 2) for r, e in by_round.items()}
    assert sorted(by_round) == list(range(1, rounds + 1))
    print(f"round seconds {seconds}; fork killed in round {fork_round}, zygote in {zygote_round}")
    assert [r for r, e in by_round.items() if e["dropped"]] == [fork_round]  # that round only
    assert 1 < fork_round < zygote_round < rounds
    entry = by_round[fork_round]
    assert entry["train"]["applied"] == 1, entry
    (reason,) = entry["dropped"]
    assert "killed by SIGKILL" in reason and entry["dropped"][reason] == 1, entry
    for r in range(2, rounds + 1):
        # both replies in every other round, the ones after each kill among them; no round
        # waited for the round timeout (auto: at least 120 s; a new zygote's imports, ~15 s
        # on a loaded 2-core box, fall in the round after its kill)
        assert r == fork_round or by_round[r]["train"]["applied"] == 2, (r, by_round[r])
        assert by_round[r]["seconds"] < 60, seconds
    assert final["final"]["clients"] == 2


@pytest.mark.skipif(
    shutil.which("flower-superlink") is None
    and not (Path(sys.executable).parent / "flower-superlink").exists(),
    reason="Flower's deployment executables are not installed",
)
@pytest.mark.drill
def test_a_warm_federation_loses_no_reply_when_a_task_is_killed_mid_push(tmp_path, monkeypatch):
    """Issue 50, on the loopback deployment (TLS, authentication, gateway, two warm
    SuperNodes): a task's fork SIGKILLed while it pushes its reply, once the SuperNode has
    stored the first object of it (the warm SuperExec's drill hook, ``DRILL_KILL_MID_PUSH``,
    armed after round 1 started). Its warm SuperExec pushes the rest from what the fork kept
    and ends the task: every round has both nodes' replies (none dropped, not even the
    killed one's), no round waits for the round timeout, and ``flwr run`` exits 0. Before,
    Flower's SuperNode waited for the rest of the reply forever and ran nothing more."""
    from test_deployment import _results, _wait_for

    from pflower.deploy.warm_exec import DRILL_KILL_MID_PUSH

    trigger = tmp_path / "kill-mid-push"
    monkeypatch.setenv(DRILL_KILL_MID_PUSH, str(trigger))
    rounds = 4
    fed, run_config, log = _warm_federation(tmp_path, rounds)
    try:
        fed.up()
        run = fed.submit(run_config, REPO, "run")
        _wait_for(log, f"round 1/{rounds}", run, timeout=300)
        trigger.write_text("")  # the next reply pushed by either node's fork
        assert _until(lambda: not trigger.exists(), timeout=300), "no reply was pushed"
        assert run.wait(600) == 0, log.read_text(errors="replace")[-4000:]
        said = "".join(
            (fed.logs / f"warm-exec-{i}.log").read_text(errors="replace") for i in range(2)
        )
    finally:
        fed.stop_all()
    assert "was killed by SIGKILL; answering for it" in said, said[-3000:]
    assert "its reply was cut off while it was being pushed; the " in said, said[-3000:]
    assert "pushed from what the child kept" in said and "(completed)" in said

    (final,) = _results(tmp_path / "outputs")
    by_round = {r["round"]: r for r in final["rounds"]}
    seconds = {r: round(e["seconds"], 2) for r, e in by_round.items()}
    print(f"round seconds {seconds}")
    assert sorted(by_round) == list(range(1, rounds + 1))
    for r, entry in by_round.items():  # the killed fork's reply among them
        assert not entry["dropped"] and entry["train"]["applied"] == 2, (r, entry)
        assert entry["seconds"] < 60, seconds  # the round timeout: at least 120 s
    assert final["final"]["clients"] == 2
