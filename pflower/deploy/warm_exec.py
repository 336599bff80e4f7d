"""A warm SuperExec for one SuperNode: Flower's own SuperExec loop, each task in a fork of a
process that has already imported torch, Flower and pflower.

A SuperNode started with ``--isolation subprocess`` (Flower's default) runs its own SuperExec,
which starts a fresh ``flwr-clientapp`` process for every message: Python, torch, Flower and
the app are imported again each time, ~2-4 s of a 2-core device's CPU per message
(measured ~9 s per round on the loopback deployment). With ``--isolation process`` the
SuperNode leaves that to a SuperExec started beside it; this module is that SuperExec:

- Flower's ``run_superexec`` loop, as it is (it acquires each task from the SuperNode's
  Runtime API with its token, and hands it to an executor), with Flower's executor
  replaced by ``ForkExecutor`` (Flower 1.41 builds its executor with ``get_executor``; the
  SuperExec CLI offers only ``subprocess`` and ``kubernetes``, hence the replacement here);
- ``ForkExecutor`` runs each task with Flower's own ``run_clientapp`` (the code a
  ``flwr-clientapp`` process runs: it pulls the message, installs the FAB, loads the app,
  pushes the reply) in a child forked from a *zygote*: a single-threaded process started
  before the SuperExec loop starts any thread, which imported torch, Flower and pflower's
  ClientApp once. A fork of it starts in milliseconds, and nothing a task does survives it
  (the same isolation per message as a fresh process: the ClientApp's state is Flower's
  ``context.state`` or the node's ``state-dir``, never process memory). One thing goes back:
  the client's data arrays a child loaded (``loaders.client_arrays``, a pure function of the
  run's config and the partition, ~0.14 s a message on the loopback deployment), which the
  zygote adds to its cache so that the next fork starts with them, as a simulation worker
  keeps them between messages (not a device's own file, ``dataset = "node"``: it may change).

    python -m pflower.deploy.warm_exec --runtime-api-address 127.0.0.1:9194 \\
        --insecure --parent-pid <the SuperNode's pid>

``pflower deploy up --warm`` (``Federation(warm=True)``) starts one beside every SuperNode.
The polling interval of the loop is Flower's ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
(default 1 s); the deployment kit sets 0.05 s, longer where more SuperNodes than cores
share the machine (``Federation.task_poll_s``, ``deploy up --task-poll-interval``). The
SuperNode hands a task out as soon as it has the message, before the message's arrays have
arrived, so a ClientApp often asks for an object that is not there yet and Flower then
waits 1 s (then 2, 4...) before it asks again; ``--poll-interval`` shortens that first wait
(``pflower.flower.waits``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from pflower.flower import CHECKED, FlowerDrift
from pflower.flower import superexec as flower
from pflower.flower.superexec import cannot_warm
from pflower.flower.waits import cap_pull_backoff

#: imported in the zygote before any fork: what a fresh flwr-clientapp spends its start on,
#: and what the ClientApp imports lazily on its first message, which every fork would import
#: again (measured on the loopback deployment, per message: ``torch._dynamo``, which torch's
#: optimizers import on first use, 2.8 s; flwr-datasets, 2.4 s)
WARM_IMPORTS = (
    "torch",
    "torch._dynamo",
    *flower.TASK_MODULES,
    "pflower.client_app",
)
#: the same where installed (their extras are optional): the libraries of the data sets and
#: models (flwr-datasets, pflower's partitioners, datasets: ``data``; scikit-learn, 0.3 s for
#: ``digits``, with the packages its ``load_digits`` reads its files from, and mlxtend:
#: ``offline``; torchvision: ``vision``)
WARM_IF_INSTALLED = (
    "flwr_datasets",
    "pflower.task.partitioners",
    "datasets",
    "sklearn.datasets",
    "sklearn.datasets.data",
    "sklearn.datasets.descr",
    "mlxtend.data",
    "torchvision",
)


def warm_up() -> None:
    """Import what a task would import (``WARM_IMPORTS``, and ``WARM_IF_INSTALLED`` where
    installed). Starts no thread (torch's thread pools start on first use, not on import)."""
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    for name in WARM_IF_INSTALLED:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _hand_back(path: Path, known: set) -> None:
    """Write the data arrays this child loaded (not those it inherited, not a device's own
    file) to ``path``, for the zygote (``_adopt``)."""
    from pflower.task.data.loaders import client_arrays

    new = [(k, v) for k, v in client_arrays.items() if k not in known and k[0].dataset != "node"]
    if new:
        part = path.with_suffix(".part")
        part.write_bytes(pickle.dumps(new, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(part, path)  # whole, or not at all


def _adopt(path: Path) -> None:
    """Add what a finished child handed back (``_hand_back``) to this process's cache."""
    from pflower.task.data.loaders import client_arrays

    try:
        items = pickle.loads(path.read_bytes())
    except FileNotFoundError:
        return
    finally:
        path.unlink(missing_ok=True)
    client_arrays.adopt(items)


def _note(path: Path, **fields) -> None:
    """Add ``fields`` to the progress record at ``path`` (whole, or not at all)."""
    try:
        record = pickle.loads(path.read_bytes())
    except (FileNotFoundError, EOFError, pickle.UnpicklingError):
        record = {}
    record.update(fields)
    part = path.with_suffix(".part")
    part.write_bytes(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(part, path)


def _read_progress(path: Path) -> dict:
    """What a task's child recorded (``_note``), ``{}`` where it recorded nothing; removed.
    With ``sent``: the objects of its reply the SuperNode stored (``_sent``), and
    ``reply_file`` where it kept its reply (``_keep``; the answer removes it)."""
    try:
        record = pickle.loads(path.read_bytes())
    except Exception:  # nothing recorded, or cut off: the child died before it noted anything
        record = {}
    finally:
        path.unlink(missing_ok=True)
        path.with_suffix(".part").unlink(missing_ok=True)
    sent = path.with_suffix(".sent")
    with contextlib.suppress(FileNotFoundError):
        # whole lines only: a line cut off by the kill is no object id
        record["sent"] = {i for i in sent.read_text().split("\n") if len(i) == 64}
        sent.unlink()
    path.with_suffix(".reply-part").unlink(missing_ok=True)
    if path.with_suffix(".reply").exists():
        record["reply_file"] = str(path.with_suffix(".reply"))
    return record


#: the crash drill's hook (tests/test_warm_exec.py): where this names a file, the first task's
#: child that removes it kills itself (SIGKILL) once the SuperNode has stored the first object
#: of its reply, mid-push
DRILL_KILL_MID_PUSH = "PFLOWER_WARM_EXEC_DRILL_KILL_MID_PUSH"


def _keep(progress: Path, reply: dict | None, reply_id: str) -> None:
    """In a task's child, as its reply's push starts: keep what the zygote needs to finish
    that push (``reply``: ``flower.kept_reply``) next to ``progress`` (whole, or not at all),
    then note that the push started and the reply's id. Written before the first byte of
    the reply leaves the child: a child killed while it writes has pushed nothing (it is
    answered for with an error reply); one that cannot write it pushes all the same."""
    kept = False
    if reply is not None:
        path, part = progress.with_suffix(".reply"), progress.with_suffix(".reply-part")
        try:
            with open(part, "wb") as f:  # the arrays' bytes straight to the file, no copy
                pickle.dump(reply, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(part, path)
            kept = True
        except Exception:  # disk full: the push goes on; cut off, it is dropped (answer_for)
            part.unlink(missing_ok=True)
    _note(progress, pushing=True, reply_id=reply_id, kept=kept)


def _sent(progress: Path, object_id: str) -> None:
    """In a task's child (one of Flower's pushing threads): add ``object_id``, stored by the
    SuperNode, to the list next to ``progress`` (one line, one write, appended)."""
    fd = os.open(progress.with_suffix(".sent"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{object_id}\n".encode())
    finally:
        os.close(fd)
    drill = os.environ.get(DRILL_KILL_MID_PUSH)
    if drill:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(drill)  # one task only: the one that removes it
            os.kill(os.getpid(), signal.SIGKILL)


def _pushed(progress: Path) -> None:
    """In a task's child, once its reply is pushed whole: noted; what it kept is removed."""
    _note(progress, pushed=True)
    progress.with_suffix(".reply").unlink(missing_ok=True)


def _record_progress(progress: Path) -> None:
    """In a task's child: note, at ``progress``, the task's run and id once Flower's
    ``run_clientapp`` has pulled them, its message (without content) as soon as it is taken
    (before its arrays are pulled: the longest part of a fork's life on loopback), and its
    reply's push: the reply kept before it starts (``_keep``), the SuperNode's push session
    and the objects it asked for, each object it stored (``_sent``), and the push's end, so
    that the zygote can answer for a child that dies (``answer_for``) or finish its push.
    Through ``pflower.flower.superexec.note_progress`` (checked by ``cannot_warm``), in this
    child only."""
    flower.note_progress(
        pulled_task=lambda run, task, node: _note(progress, run=run, task=task, node=node),
        took_message=lambda message: _note(progress, message=message),
        pushing=lambda reply, reply_id: _keep(progress, reply, reply_id),
        push_began=lambda session, ids: _note(progress, session=session, to_push=ids),
        object_sent=lambda object_id: _sent(progress, object_id),
        pushed=lambda: _pushed(progress),
    )


def _run_task(spec: dict, hand_back: Path | None = None, progress: Path | None = None) -> int:
    """One task, in a forked child: Flower's ``run_clientapp``; its exit code. With
    ``hand_back``, the data arrays it loaded are written there (``_hand_back``); with
    ``progress``, how far it got (``_record_progress``)."""
    from pflower.task.data.loaders import client_arrays

    known = {k for k, _ in client_arrays.items()}
    if progress is not None:
        _record_progress(progress)
    try:
        flower.run_task(spec)
    except SystemExit as done:  # run_clientapp ends with Flower's flwr_exit
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # never a silent exit: the SuperExec's log says why the task failed
        print(
            "pflower warm SuperExec: the task failed in Flower's run_clientapp "
            "(pflower.flower adapters: checked on Flower " + ", ".join(CHECKED) + "):",
            file=sys.stderr,
        )
        traceback.print_exc()
        return 1
    finally:
        if hand_back is not None:
            with contextlib.suppress(Exception):  # a cache: the task's result stands without it
                _hand_back(hand_back, known)
    return 0


def how_it_ended(status: int) -> str:
    """A ``waitpid`` status in words: ``killed by SIGKILL``, ``exited with code 1``."""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def _say(line: str) -> None:
    """One line in the warm SuperExec's log (its stderr: the zygote's and its forks' too)."""
    print(f"pflower warm SuperExec: {line}", file=sys.stderr, flush=True)


def answer_for(spec: dict, record: dict, how: str, client=None) -> str:
    """For a task whose child died (``how``: ``killed by SIGKILL``) before it answered: what
    Flower's ``run_clientapp`` does for a ClientApp that fails — an error reply to the task's
    message, then the task's end (FAILED) — through the SuperNode's Runtime API with the
    task's own token, so the SuperNode sends the server that reply (which drops it: that node's
    reply is lost in this round only) and hands out the next round's task as usual; for a
    child killed while it pushed its reply, the rest of that push from the reply it kept
    (``_finish_push``: its reply reaches the server). Returns what was done, for the log.

    Flower's own SuperExec does nothing for a dead ``flwr-clientapp`` (``reconcile`` is empty);
    its SuperNode answers "ClientApp stopped responding" once the task's heartbeat lapses
    (60 s), but only for a message the ClientApp had taken, and it waits for the rest of a
    reply whose push was cut off forever; a fork that lives ~1 s spends much of its life in
    those windows. ``record`` is what the child noted (``_record_progress``): its message once
    taken; whether its reply's push started (and what it kept of it) and ended."""
    if record.get("pushed"):
        return "its reply had reached the SuperNode; nothing to answer"
    client = client or flower.runtime_client(spec)
    if record.get("pushing"):
        return _finish_push(client, record, how)
    message = record.get("message")
    if message is None:  # it died before it took its message: take it, to answer it
        message = flower.take_message(client)
    if message is None:
        return (
            "its message could not be taken back; Flower's SuperNode answers for it once the "
            "task's heartbeat lapses (30-60 s: a task not started is handed out again, a started "
            "one answered 'ClientApp stopped responding')"
        )
    flower.answer_failed(
        client, message, f"the ClientApp's process was {how} (pflower warm SuperExec)"
    )
    return "answered with an error reply to its message (the server drops it: this round only)"


def _finish_push(client, record: dict, how: str) -> str:
    """For a child killed while it pushed its reply (Flower's SuperNode waits for the rest of
    it forever, and runs nothing more): push what the SuperNode still lacks from the reply
    the child kept and end the task as Flower's ``run_clientapp`` would have
    (``flower.complete_push``); where it kept nothing, remove the reply from the SuperNode so
    that its send fails and it goes on (``flower.drop_reply``)."""
    reply = None
    with contextlib.suppress(Exception), open(record["reply_file"], "rb") as f:
        reply = pickle.load(f)  # not kept (no file), or cut off: dropped below
    if reply is not None:
        stored, lacking = flower.complete_push(
            client, reply, record.get("session"), record.get("to_push", ()),
            record.get("sent", set()),
        )  # fmt: skip
        return (
            f"its reply was cut off while it was being pushed; the {lacking} of its objects the "
            f"SuperNode still lacked pushed from what the child kept ({stored} stored), and "
            f"its task ended as Flower's run_clientapp ends it ({reply['status']}): the reply "
            "goes to the server in this round"
        )
    flower.drop_reply(
        client, record["run"], record["node"], record["reply_id"],
        f"the ClientApp's process was {how} while it pushed its reply (pflower warm SuperExec)",
    )  # fmt: skip
    return (
        "its reply was cut off while it was being pushed, and had not been kept: removed from "
        "the SuperNode (its send fails, and the node goes on), the task ended FAILED; the "
        "server has no reply from this node in this round"
    )


def _zygote(conn: Connection, task=None, answer=None) -> None:
    """Receive task specs; fork a child per task; reap finished children, and answer for
    those that died (``answer_for``)."""
    warm_up()
    conn.send(threading.active_count())  # ready; 1: no thread a fork could leave locked
    handed = Path(tempfile.mkdtemp(prefix="pflower-warm-exec-"))  # private (0700)
    try:
        _serve(conn, handed, task or _run_task, answer or answer_for)
    finally:
        shutil.rmtree(handed, ignore_errors=True)


def _fork(conn: Connection, job, *args) -> int:
    """``job(*args)`` in a fork of the zygote; its pid. The fork closes the zygote's end of
    the pipe (a dead zygote's pipe must break) and never returns: it exits with ``job``'s
    code (1 where it raised)."""
    pid = os.fork()
    if pid:
        return pid
    conn.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 1
    try:
        code = job(*args)
    except BaseException:  # never a silent exit: the SuperExec's log says why
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0)


def _answer_job(answer, pid: int, spec: dict, record: dict, how: str) -> int:
    try:
        done = answer(spec, record, how)
    except Exception as err:  # the SuperNode gone too, a Flower that changed: said
        done = f"could not answer for it ({type(err).__name__}: {err})"
    finally:
        if record.get("reply_file"):
            Path(record["reply_file"]).unlink(missing_ok=True)
    _say(f"the task of pid {pid}: {done}")
    return 0


def _reap(conn: Connection, tasks: dict[int, dict], answering: set[int], handed: Path,
          answer) -> None:  # fmt: skip
    """Reap every ended child without blocking; a task's child killed by a signal is said in
    the log (run, task, signal) and answered for (``answer``, in a fork of its own: the zygote
    starts no thread)."""
    while tasks or answering:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            tasks.clear()
            answering.clear()
            return
        if pid == 0:
            return
        answering.discard(pid)
        spec = tasks.pop(pid, None)
        if spec is None:
            continue
        with contextlib.suppress(Exception):  # a cache: never the zygote's end
            _adopt(handed / f"{pid}.pkl")
        record = _read_progress(handed / f"{pid}.progress")
        if not os.WIFSIGNALED(status):
            if record.get("reply_file"):  # one that exited mid-push: its push failed, said
                Path(record["reply_file"]).unlink(missing_ok=True)
            continue  # ended by Flower's run_clientapp, which answered for itself
        how = how_it_ended(status)
        where = (
            f"run {record['run']}, task {record['task']}"
            if "run" in record
            else "before it had pulled its task"
        )
        _say(f"the ClientApp task of pid {pid} ({where}) was {how}; answering for it")
        answering.add(_fork(conn, _answer_job, answer, pid, spec, record, how))


def _serve(conn: Connection, handed: Path, task, answer) -> None:
    tasks: dict[int, dict] = {}  # pid -> the spec of the task it runs
    answering: set[int] = set()
    while True:
        _reap(conn, tasks, answering, handed, answer)
        try:
            if not conn.poll(0.2):
                continue
            spec = conn.recv()
        except (EOFError, OSError):  # the SuperExec is gone
            break
        if spec is None:
            break
        tasks[_fork(conn, _task_job, task, spec, handed)] = spec
    for pid in [*tasks, *answering]:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _task_job(task, spec: dict, handed: Path) -> int:
    """A task's child: ``task`` (``_run_task``) with where to hand back its data arrays and
    note its progress."""
    pid = os.getpid()
    return task(spec, handed / f"{pid}.pkl", handed / f"{pid}.progress")


class ForkExecutor:
    """Flower's executor protocol (``flwr.supercore.superexec.executor.types.Executor``):
    every task goes to the zygote, which forks a child for it.

    A dead zygote (killed, out of memory) is found at the next poll (``reconcile``) or at the
    next task it is handed (a broken pipe) and started again in this process: a new fork of
    the SuperExec, which imports torch, Flower and the app anew (seconds); the task handed to
    the dead one goes to the new one. Its children live on and finish their tasks. A zygote
    that cannot start again (an import fails) raises ``FlowerDrift``: the warm SuperExec exits
    non-zero, and ``pflower deploy up`` starts it again beside its SuperNode.

    ``task`` and ``answer`` replace ``_run_task`` and ``answer_for`` (tests)."""

    def __init__(self, task=None, answer=None) -> None:
        self.task, self.answer = task, answer
        self.lock = threading.Lock()
        #: how many times the zygote was started again
        self.restarts = 0
        self._start_zygote()

    def _start_zygote(self) -> None:
        parent, child = Pipe()
        pid = os.fork()
        if pid == 0:  # the zygote
            parent.close()
            code = 0
            try:
                _zygote(child, self.task, self.answer)
            except BaseException:  # e.g. an import a Flower upgrade moved: said, not hidden
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        child.close()
        self.conn, self.zygote = parent, pid
        try:
            self.threads_at_fork = self.conn.recv()  # waits for the imports
        except EOFError:
            os.waitpid(pid, 0)
            raise FlowerDrift(
                "the warm SuperExec's zygote stopped while importing what a task needs "
                "(its traceback is above)"
            ) from None

    def zygote_ended(self) -> str | None:
        """How the zygote ended (``how_it_ended``), or None while it lives."""
        try:
            pid, status = os.waitpid(self.zygote, os.WNOHANG)
        except ChildProcessError:
            return "gone"
        return None if pid == 0 else how_it_ended(status)

    def _restart(self, how: str) -> None:
        _say(f"its zygote (pid {self.zygote}) was {how}; starting a new one")
        with contextlib.suppress(OSError):
            self.conn.close()
        self._start_zygote()
        self.restarts += 1
        _say(f"new zygote (pid {self.zygote}) ready")

    def get_eligible_capacity(
        self, supported_task_types, *, insecure=False, root_certificates_path=None
    ):
        del insecure, root_certificates_path
        return supported_task_types, set()

    def wait_for_capacity(
        self, task_type=None, *, fab_hash=None, insecure=False, root_certificates_path=None
    ):
        del task_type, fab_hash, insecure, root_certificates_path

    def launch(self, spec):
        return flower.launch(spec, self.submit)

    def submit(self, task: dict) -> None:
        """Hand ``task`` to the zygote; to a new one where it has died."""
        with self.lock:
            try:
                self.conn.send(task)
            except OSError:  # BrokenPipeError: no zygote reads the pipe any more
                self._restart(self.zygote_ended() or "no longer reading its tasks")
                self.conn.send(task)

    def reconcile(self) -> None:
        """Called by Flower's SuperExec loop before each poll: a dead zygote is started again
        (the zygote reaps its own children and answers for those that die)."""
        with self.lock:
            how = self.zygote_ended()
            if how is not None:
                self._restart(how)

    def close(self) -> None:
        try:
            with self.lock:
                self.conn.send(None)
            os.waitpid(self.zygote, 0)
        except (OSError, ChildProcessError, BrokenPipeError):
            pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime-api-address", required=True)
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--root-certificates", default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--allow-runtime-dependency-installation", action="store_true")
    p.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a ClientApp retries an object its SuperNode does not have yet after this many "
        "seconds, not Flower's 1 s (pflower.flower.waits)",
    )
    args = p.parse_args(argv)
    if args.poll_interval is not None:  # before the fork: the zygote and its children inherit it
        try:
            cap_pull_backoff(args.poll_interval)
        except (ValueError, RuntimeError) as err:
            p.error(str(err))
    superexec = flower.superexec_module()
    # the zygote first, while this process has no thread: run_superexec then starts its own
    reason = cannot_warm(superexec)
    if reason is None:
        try:
            flower.use_executor(superexec, ForkExecutor())
        except FlowerDrift as err:
            reason = str(err)
    if reason is not None:  # Flower's own SuperExec: a fresh flwr-clientapp per task
        print(
            f"pflower warm SuperExec is off: {reason}; Flower's own SuperExec runs each task "
            "in a fresh flwr-clientapp process (cold, as without pflower). Checked on Flower "
            + ", ".join(CHECKED),
            file=sys.stderr,
            flush=True,
        )
    superexec.run_superexec(
        runtime_api_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates_path=args.root_certificates,
        parent_pid=args.parent_pid,
        runtime_dependency_install=args.allow_runtime_dependency_installation,
    )


if __name__ == "__main__":
    main()
