"""The layout's rules (DESIGN.md): an algorithm is one unit in one file; shared modules hold
no per-algorithm code; ``task/`` knows nothing of Flower; the client protocol imports no
server code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pflower.config import Config
from pflower.strategies import ALGORITHMS

PKG = Path(__file__).parents[1] / "pflower"
ALGORITHM_FILES = {"fedavg", "fedalt", "ffgg", "async_ffgg", "scaffold", "l2gd", "pflego", "apfl"}
SHARED = [
    "config.py",
    "wire.py",
    "client_app.py",
    "server_app.py",
    "numpy_client.py",
    "strategies/server.py",
    "strategies/client.py",
    "strategies/nodes.py",
    "strategies/combine.py",
    "strategies/history.py",
    "strategies/registry.py",
    "strategies/server_opt.py",
]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _code_strings(path: Path) -> set[str]:
    """String constants of the code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    }


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_hold_no_per_algorithm_code(module):
    path = PKG / module
    algorithm_modules = {f"pflower.strategies.{m}" for m in ALGORITHM_FILES}
    assert not _imports(path) & algorithm_modules, module
    default = {Config.model_fields["algorithm"].default}  # the run's default algorithm
    assert not _code_strings(path) - default & set(ALGORITHMS), module


def test_every_algorithm_is_declared_in_its_own_file():
    for name, entry in ALGORITHMS.items():
        module = entry.strategy.__module__.rsplit(".", 1)[1]
        assert module in ALGORITHM_FILES, name
        source = (PKG / "strategies" / f"{module}.py").read_text()
        assert f'"{name}": Algorithm(' in source, name  # the registration
        for settings in entry.settings:  # its keys (async-ffgg: FFGG's too, from ffgg.py)
            assert settings.__module__.rsplit(".", 1)[1] in (module, "ffgg"), name


def test_task_imports_no_flower():
    for path in (PKG / "task").glob("*.py"):
        flower = {m for m in _imports(path) if m == "flwr" or m.startswith("flwr.")}
        assert not flower, (path.name, flower)


def test_the_client_protocol_imports_no_server_code():
    server = ("flwr.serverapp", "pflower.strategies.server", "pflower.strategies.nodes")
    server += ("pflower.strategies.combine", "pflower.strategies.server_opt")
    for module in ("strategies/client.py", "context_store.py", "task/state.py"):
        found = {m for m in _imports(PKG / module) if m.startswith(server)}
        assert not found, (module, found)


def test_the_device_entry_imports_no_heavy_optional_package():
    """A device imports pflower.client_app: no torchvision, plotting, Ray, or the datasets
    stack (pyarrow, pandas) until the chosen model or data source needs them."""
    import subprocess
    import sys

    heavy = ["torchvision", "matplotlib", "ray", "datasets", "pyarrow", "pandas", "sklearn"]
    code = f"import sys, pflower.client_app; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
