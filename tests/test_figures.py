"""Figures in the docs against the results files they come from (issue 63).

Two checks over README.md, CHANGELOG.md and docs/:

- every results file the prose cites (``benchmarks/results/...``, brace groups such as
  ``floor-{a,b}.jsonl`` expanded) exists;
- a figure the prose marks with its source, ``<!-- figures: 96.90 33.43 from
  benchmarks/results/main-job-runs.md -->`` (an HTML comment: the rendered page does not show
  it), is the file's: every number the comment lists appears in the paragraph that holds the
  comment (the prose says it) and in the file (the file says it). A figure changed in the prose
  alone, or a results file re-run without the prose, fails here.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_./{},\-]+")
MARK = re.compile(r"<!--\s*figures:\s*(?P<numbers>[^>]*?)\s+from\s+(?P<path>\S+)\s*-->")


def expand(path: str) -> list[str]:
    """``a-{x,y}.json`` -> ``a-x.json``, ``a-y.json`` (each brace group in turn)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited(text: str) -> set[str]:
    out = set()
    for match in CITED.finditer(text):
        raw = match.group(0).rstrip(".,;:)")
        if raw.endswith("-") or "{" in raw and "}" not in raw:
            continue  # a prefix the prose completes ("deploy-rounds-…")
        out.update(p.rstrip("/") for p in expand(raw))
    return out


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks (a list item and its continuation lines are one)."""
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def marks(text: str) -> list[tuple[str, list[str], str]]:
    """(the paragraph's prose without its comments, the numbers, the file) of each mark."""
    out = []
    for block in paragraphs(text):
        prose = re.sub(r"<!--.*?-->", "", block, flags=re.DOTALL)
        for m in MARK.finditer(block):
            out.append((prose, m.group("numbers").split(), m.group("path")))
    return out


def number_in(number: str, text: str) -> bool:
    """``number`` as a whole number in ``text`` (96.9 is not in 96.90, 1.2 not in 11.2, 0.3
    not in −0.3); the prose's minus sign (U+2212) reads as the file's hyphen."""
    text = text.replace("\u2212", "-")
    return re.search(rf"(?<![\d.-]){re.escape(number)}(?![\d])", text) is not None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_the_docs_cite_exists(doc):
    missing = sorted(p for p in cited(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} cites results that are not in the repo: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_marked_figure_is_its_results_files(doc):
    for prose, numbers, path in marks(doc.read_text()):
        source = ROOT / path
        assert source.is_file(), f"{doc.name}: the figures' file {path} is missing"
        held = source.read_text()
        for number in numbers:
            assert number_in(number, prose), f"{doc.name}: {number} is marked but not in the prose"
            assert number_in(number, held), f"{doc.name}: {number} is not in {path}"


def test_the_readme_marks_its_headline_figures():
    """The README's measured figures carry their marks (more each time one is re-run)."""
    found = {path for _, _, path in marks((ROOT / "README.md").read_text())}
    assert {
        "benchmarks/results/main-job-runs.md",
        "benchmarks/results/defence-history/table.md",
        "benchmarks/results/planted_errors.md",
    } <= found


def test_the_checks_catch_a_wrong_figure_and_a_missing_file(tmp_path):
    """The checks themselves, on a planted page: a figure that is not the file's, a figure
    the prose does not say, a file that is not there."""
    results = tmp_path / "r.md"
    results.write_text("| 1 | 96.90 | 33.43 |\n")
    ok = f"Runs gave 96.90 / 33.43 %.<!-- figures: 96.90 33.43 from {results} -->"
    wrong = ok.replace("96.90 /", "96.80 /").replace("figures: 96.90", "figures: 96.80")
    (prose, numbers, path), = marks(ok)
    assert all(number_in(n, prose) and number_in(n, results.read_text()) for n in numbers)
    (prose, numbers, path), = marks(wrong)
    assert not number_in("96.80", results.read_text())
    (prose, numbers, path), = marks(ok.replace("96.90 / ", ""))
    assert not number_in("96.90", prose)
    assert number_in("-0.3", "lost \u22120.3 points") and not number_in("0.3", "\u22120.3")
    assert expand("a-{x,y}.jsonl") == ["a-x.jsonl", "a-y.jsonl"]
    page = "see `benchmarks/results/nothing-here.md`."
    assert "benchmarks/results/nothing-here.md" in cited(page)
