"""The layout's rules (DESIGN.md): an algorithm is one unit in one file; shared modules hold
no per-algorithm code; ``task/`` knows nothing of Flower; the client protocol imports no
server code; no import circle, counting ``if TYPE_CHECKING:`` imports; the device entry
imports no experiment code."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

import pflower.strategies as strategies
from pflower.config import Config
from pflower.strategies import ALGORITHMS

PKG = Path(__file__).parents[1] / "pflower"
#: the modules of experiments: what the production path never imports
EXPERIMENT = ("pflower.testbed", "pflower.experiment")
#: the package's algorithm files: the modules the registry collected registrations from
ALGORITHM_FILES = {
    m.__name__.rsplit(".", 1)[1]
    for m in strategies.algorithm_modules()
    if m.__name__.startswith("pflower.strategies.")
}
SHARED = [
    "settings.py",
    "config.py",
    "wire.py",
    "client_app.py",
    "server_app.py",
    "numpy_client.py",
    "strategies/server.py",
    "strategies/client.py",
    "strategies/nodes.py",
    "strategies/exchange.py",
    "strategies/rounds.py",
    "strategies/admit.py",
    "strategies/bound.py",
    "strategies/combine.py",
    "strategies/settle.py",
    "strategies/pipeline.py",
    "strategies/robust_fedavg.py",
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
    # the key dp's modes: "local" DP (each client noises its update) is not the algorithm
    dp_modes = set(get_args(Config.model_fields["dp"].annotation))
    assert not _code_strings(path) - default - dp_modes & set(ALGORITHMS), module


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


# --- the import graph ----------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(path: Path, modules: set[str], typing: bool = False) -> set[str]:
    """The pflower modules ``path`` imports when it runs: at module level and inside functions
    (lazy imports count), not under ``if TYPE_CHECKING:`` unless ``typing`` (a type checker's
    imports); ``from x import y`` is module ``x.y`` when that is a module, else ``x``;
    relative imports resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test) and not typing:
            for child in node.orelse:  # the else branch runs
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    targets = set()
    for target in found:
        while target and target not in modules:  # ``import pflower.x.Y``: the module pflower.x
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)
    return targets


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """pflower's modules -> the pflower modules each imports, read from the source (with
    ``typing``: its ``if TYPE_CHECKING:`` imports too).

    Importing ``pflower.a.b`` also runs the package ``pflower.a``'s ``__init__``; that is
    Python's package mechanism, not an import the module makes, and is left out (as
    import-linter and grimp do): the registry is ``pflower/strategies/__init__.py`` by design."""
    paths = sorted(PKG.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _runtime_imports(p, modules, typing) for p in paths}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d"], ["e"]]
    assert len(import_graph()) > 40 and "pflower.strategies" in import_graph()["pflower.config"]


def test_no_import_circle():
    """No module of pflower imports, at any depth or lazily, a module that imports it back:
    the layers of DESIGN.md run one way (``config.py`` composes ``Config`` above the
    registry; ``settings.py`` and the registry's contract sit at the bottom)."""
    graph = import_graph()
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert circles == [], circles


def test_no_import_circle_through_type_checking_imports():
    """Issue 48, item 6: the layers run one way for a type checker too. An ``if
    TYPE_CHECKING:`` import of a module above (``Config`` from the bottom layer or an
    algorithm, ``RunReport`` from the plots it draws) is a circle a reader meets in the
    annotations: the layers below name what they read (``settings.RunSettings``, an
    algorithm's ``RunConfig``, a ``Protocol``), never the composed ``Config``."""
    graph = import_graph(typing=True)
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert circles == [], circles
    below = [m for m, imported in graph.items() if "pflower.config" in imported]
    assert not [m for m in below if m.startswith(("pflower.strategies", "pflower.task"))], below
    assert graph["pflower.settings"] <= {"pflower.wire"}, graph["pflower.settings"]


def test_the_bottom_layer_imports_no_algorithm():
    graph = import_graph()
    for bottom in ("pflower.settings", "pflower.wire", "pflower.strategies.registry"):
        assert graph[bottom] <= {"pflower.settings", "pflower.wire"}, (bottom, graph[bottom])


def test_the_production_apps_import_no_experiment_module():
    """``client_app.py`` and ``server_app.py`` import nothing under ``pflower.testbed`` or
    ``pflower.experiment``, at any depth: Byzantine and straggler behaviour and the
    simulated omniscient adversary attach from outside (``pflower.testbed.client_app``,
    ``pflower.testbed.server_app``)."""
    graph = import_graph()
    for app in ("pflower.client_app", "pflower.server_app"):
        reached, todo = set(), [app]
        while todo:
            for m in graph[todo.pop()] - reached:
                reached.add(m)
                todo.append(m)
        assert not {m for m in reached if m.startswith(EXPERIMENT)}, app


def test_the_device_entry_imports_no_experiment_code():
    """A device runs pflower.client_app: nothing under pflower.testbed is loaded."""
    import subprocess
    import sys

    code = (
        "import sys, pflower.client_app; "
        f"print(sorted(m for m in sys.modules if m.startswith({EXPERIMENT!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_planted_error_still_applies_to_the_code():
    """Each entry of ``benchmarks/planted_errors.py`` edits text that occurs exactly once in
    its file: code that moved on leaves an entry that plants nothing (the full run then
    reports it as not applied), and a hole in the suite would go unseen until that run."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("planted", root / "benchmarks/planted_errors.py")
    planted = importlib.util.module_from_spec(spec)
    sys.modules["planted"] = planted  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(planted)
    finally:
        del sys.modules["planted"]
    stale = [
        f"{plant.name}: {problem}"
        for plant in planted.PLANTS
        if (problem := plant.apply((root / plant.path).read_text())[1])
    ]
    assert len(planted.PLANTS) > 100 and not stale, stale
