"""Shared fixtures. Nothing in the tests may touch the network: it would hang offline."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # Flower's usage telemetry posts online
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# One torch thread per process: CI has 2 cores, and the suite's engines run several processes
# or threads of clients at once; two intra-op threads each oversubscribe the cores (measured:
# 4 of the 5-class default runs took 124 s with 2 threads, 32 s with 1). Subprocesses (Ray
# workers, flwr run, SuperNodes) inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_connect = socket.socket.connect


def _guarded_connect(self, address):
    """Allow loopback and Unix sockets (Ray, Flower's in-process engine); refuse the rest."""
    if isinstance(address, tuple):
        host = address[0]
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = host in ("localhost",)
        if not local:
            raise OSError(f"test tried to reach the network: {address!r}")
    return _connect(self, address)


socket.socket.connect = _guarded_connect

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def task_identity():
    """Messages built outside a running ServerApp need Flower's task identity set (flwr >= 1.38;
    older releases have none and need none)."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:
        yield None
        return
    before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield TaskIdentity
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = before
