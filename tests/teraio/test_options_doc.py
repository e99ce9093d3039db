"""docs/options.md cannot drift from the code: each of its tables names exactly the fields of its object
(the parameters of ``teraio.backend``), and ``teraio.backend`` keeps a signature a reader and an IDE can
see: at most 16 parameters besides the deprecated catch-all, each with a type annotation."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import teraio
from teraio.config import DEPRECATED_OPTIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"
MAX_PARAMETERS = 16


def _tables() -> dict[str, list[str]]:
    """Per ``## `heading` `` section of the page, the first column's names (in backticks), in order."""
    tables: dict[str, list[str]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^## `([^`]+)`", line)
        if heading:
            section = heading.group(1)
            tables[section] = []
        elif line.startswith("## "):
            section = None
        elif section is not None:
            cell = re.match(r"^\| `(\w+)` \|", line)
            if cell:
                tables[section].append(cell.group(1))
    return tables


def _backend_parameters() -> list[inspect.Parameter]:
    return [p for p in inspect.signature(teraio.backend).parameters.values() if p.kind is not p.VAR_KEYWORD]


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ("teraio.backend(...)", lambda: [p.name for p in _backend_parameters()]),
        ("teraio.States", lambda: [f.name for f in dataclasses.fields(teraio.States)]),
        ("teraio.Solver", lambda: [f.name for f in dataclasses.fields(teraio.Solver)]),
        ("teraio.Profiling", lambda: [f.name for f in dataclasses.fields(teraio.Profiling)]),
    ],
)
def test_each_table_names_exactly_its_objects_fields(section, names) -> None:
    tables = _tables()
    assert section in tables, f"docs/options.md has no section '## `{section}`'"
    assert tables[section] == names()


def test_the_backend_parameters_are_the_config_fields() -> None:
    """``teraio.backend`` composes BackendConfig: one parameter per field, nothing lost between them."""
    assert [p.name for p in _backend_parameters()] == [
        f.name for f in dataclasses.fields(teraio.BackendConfig)
    ]


def test_the_signature_is_small_and_typed() -> None:
    params = list(inspect.signature(teraio.backend).parameters.values())
    catch_all = [p for p in params if p.kind is p.VAR_KEYWORD]
    assert [p.name for p in catch_all] == ["deprecated"]
    explicit = _backend_parameters()
    assert len(explicit) <= MAX_PARAMETERS, [p.name for p in explicit]
    assert all(p.kind is p.KEYWORD_ONLY for p in explicit)
    untyped = [p.name for p in explicit if p.annotation is inspect.Parameter.empty]
    assert untyped == []


def test_every_deprecated_name_is_in_the_migration_table() -> None:
    text = DOC.read_text()
    table = text[text.index("## The flat names of earlier releases") :]
    assert [n for n in DEPRECATED_OPTIONS if f"`{n}" not in table] == []


def test_the_pages_example_runs() -> None:
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    exec(compile(block, str(DOC), "exec"), {})
