"""docs/library.md's first example, as a user copies it (issue 49, item 2): its ServerApp and
ClientApp blocks, written into a plain Flower package beside the quickstart's ``task.py`` (the
user's model, loaders and loop; not the example's own apps), switched to FedAlt, FFGG, PFLEGO
and APFL as the page says (the class and the name), run in process on ``LocalGrid``: each
reaches the personalized accuracy the page states for this setting, and the page's line count
of the ClientApp is the block's."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from pflower.strategies import nodes
from pflower.testbed.local_grid import LocalGrid

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "library.md"
TASK = ROOT / "examples" / "quickstart" / "quickstart_app" / "task.py"
#: the algorithms the page names in its first example, by strategy class
SWITCHED = {"FedAlt": "fedalt", "FFGG": "ffgg", "PFLEGO": "pflego", "APFL": "apfl"}
#: the setting the page states its numbers for: the quickstart's keys, 5 clients
RUN_CONFIG = {
    "fraction-train": 0.5,
    "num-server-rounds": 10,
    "lr": 0.1,
    "batch-size": 32,
    "local-epochs": 1,
}


def blocks() -> tuple[str, str]:
    """The page's ServerApp and ClientApp blocks (its first two Python blocks)."""
    found = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    server = next(b for b in found if "@app.main()" in b)
    client = next(b for b in found if "personalized_client_app(client_fn)" in b)
    return server, client


def stated() -> dict[str, float]:
    """The personalized accuracy the page states per algorithm for this setting."""
    text = " ".join(PAGE.read_text().split())
    said = re.search(r"personalized accuracy (FedAlt [\d.]+, FFGG [\d.]+, PFLEGO [\d.]+, "
                     r"APFL \d\.\d+)", text)  # fmt: skip
    assert said, "the page states no accuracy for its first example"
    return {name: float(v) for name, v in (p.split() for p in said.group(1).split(", "))}


@pytest.fixture
def pinned_sample(monkeypatch):
    """The strategies sample in secret by default; the page's numbers pin the sample to 0."""
    secret = nodes.sample_stream
    monkeypatch.setattr(nodes, "sample_stream", lambda seed: secret(0 if seed < 0 else seed))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_app(where: Path, package: str, cls: str, name: str) -> None:
    """The page's blocks as the user's package, switched to ``cls`` / ``name``."""
    server, client = blocks()
    pkg = where / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(TASK, pkg / "task.py")
    for file, block in (("server_app.py", server), ("client_app.py", client)):
        code = block.replace("your_app", package).replace("FFGG", cls)
        (pkg / file).write_text(code.replace('"ffgg"', f'"{name}"'))


def test_the_page_s_client_app_has_the_lines_it_says():
    _, client = blocks()
    said = re.search(r"a ClientApp of (\d+) lines", " ".join(PAGE.read_text().split()))
    assert said and int(said.group(1)) == len(client.rstrip("\n").splitlines())


@pytest.mark.usefixtures("pinned_sample")
def test_the_page_s_app_reaches_the_accuracy_it_states(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    floors = stated()
    assert set(floors) == set(SWITCHED)
    reached = {}
    for cls, name in SWITCHED.items():
        package = f"page_app_{name}"
        write_app(tmp_path, package, cls, name)
        torch.manual_seed(0)
        __import__(f"{package}.server_app")
        __import__(f"{package}.client_app")
        server, client = sys.modules[f"{package}.server_app"], sys.modules[f"{package}.client_app"]
        assert getattr(server, cls).__module__.startswith("pflower.strategies")  # switched
        grid = LocalGrid(client.app, 5, run_config=RUN_CONFIG)
        context = Context(
            run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=RUN_CONFIG
        )
        server.main(grid, context)
        out = capsys.readouterr().out
        reached[cls] = float(out.split("final personalized accuracy:")[-1].split()[0])
    with capsys.disabled():
        print("\nthe page's app, personalized accuracy:", reached)
    for cls, accuracy in reached.items():
        assert round(accuracy, 2) >= floors[cls], (cls, accuracy, floors[cls])


@pytest.mark.usefixtures("pinned_sample")
def test_a_server_that_sends_the_personal_part_is_told_what_to_do(tmp_path, monkeypatch):
    """The page's ServerApp with ``shared_arrays`` forgotten (the whole model sent, no
    pre-training): every reply lacks the head, and the drop says so and names the fix."""
    from flwr.app import ArrayRecord

    from pflower.strategies import FFGG

    monkeypatch.syspath_prepend(str(tmp_path))
    write_app(tmp_path, "page_app_forgot", "FFGG", "ffgg")
    from page_app_forgot.client_app import app
    from page_app_forgot.task import Net

    strategy = FFGG(fraction_train=1.0, lr=0.1, max_failed_rounds=0, fraction_evaluate=0.5)
    whole = ArrayRecord(Net().state_dict())
    strategy.start(grid=LocalGrid(app, 3, RUN_CONFIG), initial_arrays=whole, num_rounds=1)
    dropped = strategy.history[0].dropped
    (reason,) = dropped
    assert dropped[reason] == 3, (len(strategy.history), dropped)
    assert reason.startswith("the reply lacks fc2.bias, fc2.weight, which the server sent")
    assert "initial_arrays=shared_arrays(model, algorithm, personal=...)" in reason
