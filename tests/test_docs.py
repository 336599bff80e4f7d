"""The documentation site: it builds with warnings as errors (a broken link or anchor, a
docstring mkdocstrings cannot read, a key without a description all fail), and its run-config
key reference, generated from the settings models, covers every key of ``Config`` and of
``[tool.flwr.app.config]`` with the model's default and a description."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from pflower.config import Config

ROOT = Path(__file__).parents[1]


def _reference_hook():
    """``docs/hooks/run_config.py``, the mkdocs hook that writes the key reference."""
    path = ROOT / "docs" / "hooks" / "run_config.py"
    spec = importlib.util.spec_from_file_location("pflower_docs_run_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_every_key_is_in_the_reference_with_its_default_and_a_description():
    """One list of keys in three places: a key missing from pyproject is refused by `flwr
    run`, one without a description in its settings model is undocumented (the reference is
    generated from the models, so it cannot drift from Config's defaults); the reference names
    the default run's value where pyproject's differs."""
    rows = {row.key: row for row in _reference_hook().key_rows()}
    defaults = Config().to_flat()
    run_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"
    ]
    assert set(rows) == set(defaults), set(rows) ^ set(defaults)
    assert set(run_config) == set(defaults), set(run_config) ^ set(defaults)
    undocumented = sorted(key for key, row in rows.items() if not row.description)
    assert not undocumented, f"add Field(description=...) to: {undocumented}"
    for key, value in defaults.items():
        assert rows[key].default == value, (key, rows[key].default, value)
        expected = None if run_config[key] == value else run_config[key]
        assert rows[key].default_run == expected, (key, rows[key].default_run, expected)


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    # mkdocs-material prints a banner about its successor unless told not to
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (site / "reference" / "run-config" / "index.html").read_text()
    for key in Config().to_flat():
        assert f"<code>{key}</code>" in reference, key
    # the API pages were rendered from the docstrings, not left as ::: directives
    api = (site / "reference" / "api" / "strategies" / "index.html").read_text()
    assert "PersonalizedStrategy" in api and ":::" not in api
    # README's intro and commands, included into the site (written once)
    start = (site / "getting-started" / "index.html").read_text()
    assert "Install the test tools and run the tests" in start and "--8&lt;--" not in start
