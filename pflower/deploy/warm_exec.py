"""A warm SuperExec for one SuperNode: Flower's own SuperExec loop, each task in a fork of a
process that has already imported torch, Flower and pflower.

A SuperNode started with ``--isolation subprocess`` (Flower's default) runs its own SuperExec,
which starts a fresh ``flwr-clientapp`` process for every message: Python, torch, Flower and
the app are imported again each time, ~2-4 s of a 2-core device's CPU per message (issue 29
measured ~9 s per round on the loopback deployment). With ``--isolation process`` the
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
import inspect
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
from pflower.flower.waits import cap_pull_backoff

#: imported in the zygote before any fork: what a fresh flwr-clientapp spends its start on,
#: and what the ClientApp imports lazily on its first message, which every fork would import
#: again (measured on the loopback deployment, per message: ``torch._dynamo``, which torch's
#: optimizers import on first use, 2.8 s; flwr-datasets, 2.4 s)
WARM_IMPORTS = (
    "torch",
    "torch._dynamo",
    "flwr.supernode.runtime.run_clientapp",
    "flwr.supercore.tls",
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


#: what ``_run_task`` passes Flower's ``run_clientapp`` (checked by ``cannot_warm``)
RUN_CLIENTAPP_KEYWORDS = (
    "runtime_api_address",
    "token",
    "insecure",
    "certificates",
    "parent_pid",
    "runtime_dependency_install",
)


def _run_task(spec: dict, hand_back: Path | None = None) -> int:
    """One task, in a forked child: Flower's ``run_clientapp``; its exit code. With
    ``hand_back``, the data arrays it loaded are written there (``_hand_back``)."""
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    from pflower.task.data.loaders import client_arrays

    known = {k for k, _ in client_arrays.items()}
    try:
        run_clientapp(
            runtime_api_address=spec["runtime_api_address"],
            token=spec["token"],
            insecure=spec["insecure"],
            certificates=validate_and_resolve_root_certificates(
                spec["root_certificates_path"], spec["insecure"]
            ),
            parent_pid=spec["parent_pid"],
            runtime_dependency_install=spec["runtime_dependency_install"],
        )
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


def _zygote(conn: Connection) -> None:
    """Receive task specs; fork a child per task; reap finished children."""
    warm_up()
    conn.send(threading.active_count())  # ready; 1: no thread a fork could leave locked
    handed = Path(tempfile.mkdtemp(prefix="pflower-warm-exec-"))  # private (0700)
    children: set[int] = set()
    try:
        _serve(conn, children, handed)
    finally:
        shutil.rmtree(handed, ignore_errors=True)


def _serve(conn: Connection, children: set[int], handed: Path) -> None:
    while True:
        while children:  # reap, without blocking
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            with contextlib.suppress(Exception):  # a cache: never the zygote's end
                _adopt(handed / f"{pid}.pkl")
        try:
            if not conn.poll(0.2):
                continue
            spec = conn.recv()
        except (EOFError, OSError):  # the SuperExec is gone
            break
        if spec is None:
            break
        pid = os.fork()
        if pid == 0:
            conn.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = 1
            try:
                code = _run_task(spec, handed / f"{os.getpid()}.pkl")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.add(pid)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


class ForkExecutor:
    """Flower's executor protocol (``flwr.supercore.superexec.executor.types.Executor``):
    every task goes to the zygote, which forks a child for it."""

    def __init__(self) -> None:
        parent, child = Pipe()
        pid = os.fork()
        if pid == 0:  # the zygote
            parent.close()
            code = 0
            try:
                _zygote(child)
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
        self.lock = threading.Lock()

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
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:  # a SuperNode only asks for ClientApps
            return LaunchResult.failed(f"the warm executor runs ClientApps, not {spec.task_type}")
        with self.lock:
            self.conn.send(
                {
                    "runtime_api_address": spec.runtime_api_address,
                    "token": spec.token,
                    "insecure": spec.insecure,
                    "root_certificates_path": spec.root_certificates_path,
                    "parent_pid": spec.parent_pid,
                    "runtime_dependency_install": spec.runtime_dependency_install,
                }
            )
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """The zygote reaps its own children."""

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
    from flwr.supercore.superexec import run_superexec as superexec

    # the zygote first, while this process has no thread: run_superexec then starts its own
    reason = cannot_warm(superexec)
    if reason is None:
        try:
            executor = ForkExecutor()
            superexec.get_executor = lambda *a, **k: executor
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


def cannot_warm(superexec) -> str | None:
    """Why this Flower's SuperExec cannot take the fork executor, or None: it must read
    ``get_executor`` from its module (pflower's hook), and ``run_clientapp`` must take the
    keywords ``_run_task`` calls it with."""
    try:
        if "get_executor(" not in inspect.getsource(superexec.run_superexec):
            return "this Flower's run_superexec no longer asks get_executor for its executor"
        from flwr.supercore.tls import validate_and_resolve_root_certificates  # noqa: F401
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        inspect.signature(run_clientapp).bind(**dict.fromkeys(RUN_CLIENTAPP_KEYWORDS))
    except TypeError as err:
        return f"this Flower's run_clientapp takes other arguments ({err})"
    except Exception as err:  # moved, renamed, shipped without source
        return f"this Flower's SuperExec is not the one checked ({type(err).__name__}: {err})"
    return None


if __name__ == "__main__":
    main()
