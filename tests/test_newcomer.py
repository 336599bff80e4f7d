"""The first hour cannot regress silently (issue 49, item 5): ``.ci/newcomer`` takes a clean
clone through the README's first command (a fresh virtual environment, an empty FLWR_HOME,
none of Flower's variables set) and checks the summary table it prints. A drill: it installs
torch and the app's extras (minutes), out of CI's default run; ``pytest -m drill``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.drill
@pytest.mark.skipif(not (ROOT / ".git").exists() or not shutil.which("git"), reason="no git")
def test_a_newcomer_s_first_command_prints_the_readme_s_table(tmp_path):
    done = subprocess.run([str(ROOT / ".ci" / "newcomer"), str(tmp_path)], capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    said = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and said.startswith("newcomer: OK: exit 0"), (
        done.stdout[-3000:] + done.stderr[-3000:]
    )
