"""The docs' tables of ``[fault_tolerance]`` fields name every field once, with the default the
dataclass has: the core fields in docs/fault_tolerance.md, the experiment's in its README. A
field added, removed or given another default without its table fails here (the field's
docstring, which ``--help`` prints, is the full text; a table is the overview)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from torchtitan.config.job_config import FaultTolerance as CoreFaultTolerance
from torchtitan.experiments.fault_tolerance.job_config import FaultTolerance

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\|\s*`(?P<name>[a-z_]+)`\s*\|\s*(?P<default>[^|]*?)\s*\|")


def table_defaults(doc: Path, heading: str) -> dict[str, str]:
    """{field: default cell} of the first table after ``heading``; a field named twice fails."""
    text = doc.read_text()
    assert heading in text, f"{doc.name}: no heading {heading!r}"
    rows: dict[str, str] = {}
    started = False
    for line in text.split(heading, 1)[1].splitlines():
        match = ROW.match(line)
        if match:
            started = True
            name = match["name"]
            assert name not in rows, f"{doc.name}: `{name}` is in the table twice"
            rows[name] = match["default"]
        elif started and not line.startswith("|"):
            break
    return rows


def default_of(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def matches(cell: str, default: Any) -> bool:
    """Whether a table's default cell says ``default`` (``unset`` for None, ``""`` for "")."""
    cell = cell.strip("`")
    if default is None:
        return cell == "unset"
    if isinstance(default, bool):
        return cell == str(default).lower()
    if isinstance(default, int | float):
        try:
            return float(cell) == float(default)
        except ValueError:
            return False
    if isinstance(default, list):
        return cell == repr(default)
    return cell.strip('"') == default


def fields(cls: type, without: type | None = None) -> dict[str, Any]:
    skip = {f.name for f in dataclasses.fields(without)} if without else set()
    return {f.name: default_of(f) for f in dataclasses.fields(cls) if f.name not in skip}


CASES = [
    ("docs/fault_tolerance.md", "## The config", CoreFaultTolerance, None),
    (
        "torchtitan/experiments/fault_tolerance/README.md",
        "## Fields (`[fault_tolerance]`)",
        FaultTolerance,
        CoreFaultTolerance,
    ),
]


@pytest.mark.parametrize(("doc", "heading", "cls", "without"), CASES)
def test_a_field_table_names_every_field_with_its_default(
    doc: str, heading: str, cls: type, without: type | None
) -> None:
    table = table_defaults(REPO / doc, heading)
    expected = fields(cls, without)
    assert sorted(table) == sorted(expected), (
        f"{doc}: missing {sorted(set(expected) - set(table))}, "
        f"not fields {sorted(set(table) - set(expected))}"
    )
    wrong = {n: (table[n], d) for n, d in expected.items() if not matches(table[n], d)}
    assert not wrong, f"{doc}: defaults that differ from the dataclass (table, code): {wrong}"


def test_a_wrong_default_or_a_missing_field_is_seen(tmp_path: Path) -> None:
    """The check itself: a table with a wrong default and one field left out."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "## T\n\n| field | default | meaning |\n|---|---|---|\n"
        "| `sync_steps` | 6 | x |\n| `outer_nesterov` | true | y |\n\nafter\n| `x` | 1 |\n"
    )
    table = table_defaults(doc, "## T")
    assert table == {"sync_steps": "6", "outer_nesterov": "true"}
    assert not matches(table["sync_steps"], 5) and matches(table["outer_nesterov"], True)
    assert matches("unset", None) and matches('""', "") and matches("`[]`", [])
    assert matches("3600", 3600.0) and not matches("auto", 1)
