"""MkDocs hook: the run-config key reference, generated from the settings models.

Nothing here restates a key: the names, defaults, limits, allowed values and descriptions
come from pflower's pydantic models (``RunSettings`` and each algorithm's settings, composed
into ``pflower.config.Config``), the default run's values from ``[tool.flwr.app.config]`` in
``pyproject.toml``. A page holding the marker ``<!-- run-config-keys -->`` gets the tables;
a key without a description logs a warning, which fails ``mkdocs build --strict``.
``tests/test_docs.py`` checks the same rows against ``Config`` and pyproject.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types as at

MARKER = "<!-- run-config-keys -->"
BOUNDS = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))
ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.run_config")


@dataclass(frozen=True)
class KeyRow:
    """One run-config key as the reference shows it."""

    key: str
    default: Any
    #: the value ``[tool.flwr.app.config]`` gives it, where it differs from ``default``
    default_run: Any
    allowed: str
    description: str
    #: the settings model that declares it, and the algorithms that read it ("" for every one)
    owner: str
    section: str
    algorithms: tuple[str, ...] = ()


def pyproject_run_config() -> dict[str, Any]:
    text = (ROOT / "pyproject.toml").read_text()
    return tomllib.loads(text)["tool"]["flwr"]["app"]["config"]


def _settings_classes() -> list[tuple[type, tuple[str, ...]]]:
    """The models ``Config`` is composed of, run-level first, each with the algorithms that
    read it (empty: every algorithm)."""
    from pflower.config import Config
    from pflower.strategies import ALGORITHMS

    users: dict[type, list[str]] = {}
    for name, entry in ALGORITHMS.items():
        for settings in entry.settings:
            users.setdefault(settings, []).append(name)
    own = [c for c in reversed(Config.__mro__) if _declared_fields(c) and c is not Config]
    run_level = [c for c in own if c not in users]
    return [(c, ()) for c in run_level] + [(c, tuple(users[c])) for c in own if c in users]


def _declared_fields(cls: type) -> list[str]:
    """Fields a pydantic model declares itself (not inherited), in source order."""
    fields = getattr(cls, "model_fields", None) or {}  # pydantic >= 2.0 (the floor is 2.6)
    return [name for name in vars(cls).get("__annotations__", {}) if name in fields]


def _sections(cls: type) -> dict[str, str]:
    """field -> the ``# --- title ---`` comment above it in the model's source, if any."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    sections, current = {}, ""
    for line in source.splitlines():
        title = re.match(r"\s*# -+ (.+?) -*$", line)
        if title:
            current = title.group(1).strip()
            continue
        field = re.match(r"\s+([a-z_][a-z0-9_]*)\s*:", line)
        if field and current:
            sections[field.group(1)] = current
    return sections


def _special_choices(run_level: type) -> dict[str, str]:
    """Keys whose choices are open-ended strings: the built-in names (the tuples declared
    next to ``RunSettings``) and what else a value may be."""
    from pflower.strategies import ALGORITHMS

    home = sys.modules[run_level.__module__]

    def names(values) -> str:
        return ", ".join(f"`{v}`" for v in values)

    return {
        "algorithm": names(ALGORITHMS),
        "model": names(home.MODELS) + ", or `module:Class` (a model of your own)",
        "loss": names(home.LOSSES) + ", or `module:function` (a loss of your own)",
        "dataset": names((*home.BUILTIN_DATASETS, home.NODE_DATASET))
        + ", `hf:<hub id>`, `disk:<path>`",
    }


def _limits(metadata: list) -> str:
    parts = []
    for item in metadata:
        for cls, attr, sign in (
            (at.Ge, "ge", "≥"),
            (at.Gt, "gt", ">"),
            (at.Le, "le", "≤"),
            (at.Lt, "lt", "<"),
        ):
            if isinstance(item, cls):
                parts.append(f"{sign} {_value(getattr(item, attr))}")
        if isinstance(item, at.MinLen):
            parts.append(f"at least {item.min_length} characters")
    return ", ".join(parts)


def _allowed(key: str, info, special: dict[str, str]) -> str:
    if key in special:
        return special[key]
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if annotation is bool:
        return "`true`, `false`"
    kind = {int: "integer", float: "number", str: "text"}.get(annotation, str(annotation))
    limits = _limits(info.metadata)
    return f"{kind} {limits}" if limits else kind


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def key_rows() -> list[KeyRow]:
    """Every run-config key, in the order of the models that declare it."""
    run_config = pyproject_run_config()
    classes = _settings_classes()
    special = _special_choices(classes[0][0])
    rows = []
    for cls, algorithms in classes:
        sections = _sections(cls)
        for name in _declared_fields(cls):
            info = cls.model_fields[name]
            key = info.alias or name
            default = info.default
            in_pyproject = run_config.get(key, default)
            rows.append(
                KeyRow(
                    key=key,
                    default=default,
                    default_run=None if in_pyproject == default else in_pyproject,
                    allowed=_allowed(key, info, special),
                    description=(info.description or "").strip(),
                    owner=cls.__name__,
                    section=sections.get(name, ""),
                    algorithms=algorithms,
                )
            )
    return rows


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(rows: list[KeyRow]) -> list[str]:
    lines = [
        "| key | default | allowed | meaning |",
        "|---|---|---|---|",
    ]
    for row in rows:
        default = f"`{_value(row.default)}`"
        if row.default_run is not None:
            default += f" (`{_value(row.default_run)}` in the default run)"
        lines.append(
            f"| `{row.key}` | {default} | {_cell(row.allowed)} | {_cell(row.description)} |"
        )
    return lines


def _docstring(cls: type) -> str:
    """The model's docstring, with reST ````code```` as Markdown."""
    return re.sub(r"``(.+?)``", r"`\1`", inspect.getdoc(cls) or "")


def reference_markdown(rows: list[KeyRow] | None = None) -> str:
    """The tables: run-level keys by section, then each algorithm's own keys."""
    rows = key_rows() if rows is None else rows
    classes = {cls.__name__: cls for cls, _ in _settings_classes()}
    groups: dict[tuple[str, str], list[KeyRow]] = {}
    for row in rows:
        groups.setdefault((row.owner, row.section), []).append(row)
    out: list[str] = []
    owners_done = set()
    for (owner, section), group in groups.items():
        if owner not in owners_done:
            owners_done.add(owner)
            algorithms = group[0].algorithms
            if algorithms:
                names = ", ".join(f"`{a}`" for a in algorithms)
                out += [f"## `{owner}`: {names}", ""]
            else:
                out += [f"## Run-level keys (`{owner}`)", ""]
            if owner in classes:
                out += [_docstring(classes[owner]), ""]
        if section:
            out += [f"### {section[0].upper()}{section[1:]}", ""]
        out += [*_table(group), ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    rows = key_rows()
    for row in rows:
        if not row.description:
            log.warning("run-config key %r (%s) has no description", row.key, row.owner)
    return markdown.replace(MARKER, reference_markdown(rows))
