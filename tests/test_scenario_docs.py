"""docs/scenarios.md is generated from sim/scenario_schema.py (sim/scenario_docs.py) and cannot drift from it.

The checked-in file equals ``schema_markdown()``; the keys it lists per table are exactly the ones
the parser accepts, with the defaults the parser applies; and every table refuses a key it does
not know. Regenerate the docs with:

    python -m kvferry.sim.scenario_docs --markdown > docs/scenarios.md
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from kvferry.sim import scenario as sc
from kvferry.sim import scenario_deploy, scenario_docs
from kvferry.sim.scenario_schema import ScenarioFile
from msgspec import inspect as mi

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "scenarios.md"
REGENERATE = "python -m kvferry.sim.scenario_docs --markdown > docs/scenarios.md"
TABLES = sc.schema_tables()


def _id(t: sc.TableDoc) -> str:
    return t.header or "top"


def test_checked_in_docs_are_the_generated_text() -> None:
    assert DOCS.read_text() == sc.schema_markdown(), f"docs/scenarios.md is stale: run `{REGENERATE}`"


def test_the_regeneration_command_prints_the_docs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.sim.scenario_docs", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == sc.schema_markdown()


def _where(t: sc.TableDoc) -> str:
    """The name the parser gives the table in its errors."""
    if not t.path:
        return "scenario"
    if t.header.startswith("[["):
        return f"scenario: [{t.path[0]}].{t.path[1]}[0]"
    return f"scenario: [{t.path[0]}]"


def _table_in(doc: dict[str, Any], t: sc.TableDoc) -> dict[str, Any]:
    """The table ``t`` inside ``doc`` (created if absent; an array's first entry)."""
    node = doc
    for part in t.path:
        node = node.setdefault(part, {})
    if isinstance(node, list):
        return node[0]
    return node


def _minimal() -> dict[str, Any]:
    return copy.deepcopy(scenario_docs._MINIMAL_ENTRIES)


def _accepted(t: sc.TableDoc) -> set[str]:
    """The keys the decoder takes in table ``t``: the encoded field names of its Struct."""
    if t.path == ("deploy",):
        return set(scenario_deploy.keys())  # [deploy] is typed from DeploySpec when read
    node = mi.type_info(ScenarioFile)
    for part in t.path:
        assert isinstance(node, mi.StructType)
        node = next(f.type for f in node.fields if f.encode_name == part)
        if isinstance(node, mi.VarTupleType):
            node = node.item_type
    assert isinstance(node, mi.StructType)
    return {f.encode_name for f in node.fields}


def test_docs_list_exactly_the_keys_the_parser_accepts() -> None:
    tables = {t.path[0] for t in TABLES if t.path}
    for t in TABLES:
        documented = {k.key for k in t.keys} | (tables if not t.path else set())
        assert documented == _accepted(t), t.header


def _value(default: str) -> Any:
    return tomllib.loads(f"v = {default}")["v"]


def test_documented_defaults_are_the_parsers() -> None:
    tables, entries = {}, _minimal()
    for t in TABLES:
        doc = entries if t.header.startswith("[[") else tables
        table = _table_in(doc, t)
        for k in t.keys:
            if k.default not in ("required", "none"):
                table[k.key] = _value(k.default)
    assert sc.parse(tables) == sc.parse({})
    assert sc.parse(entries) == sc.parse(_minimal())


@pytest.mark.parametrize("table", TABLES, ids=_id)
def test_every_table_refuses_unknown_keys(table: sc.TableDoc) -> None:
    doc = _minimal()
    _table_in(doc, table)["bogus_key"] = 1
    with pytest.raises(sc.ScenarioError) as err:
        sc.parse(doc)
    # One error path format: "scenario: key" at the top, "scenario: [table].key" inside a table.
    path = f"{_where(table)}: bogus_key" if not table.path else f"{_where(table)}.bogus_key"
    assert str(err.value).startswith(f"{path}: unknown field"), err.value


@pytest.mark.parametrize(
    ("path", "typo", "hint"),
    [
        (("flows",), "ring_byte", "ring_bytes"),
        (("workload", "room"), "token", "tokens"),
        (("faults", "event"), "duration", "duration_us"),
        (("fabric",), "bandwidth", "bandwidth_gbps"),
    ],
)
def test_a_near_miss_names_the_key_meant(path: tuple[str, ...], typo: str, hint: str) -> None:
    doc = _minimal()
    table = next(t for t in TABLES if t.path == path)
    _table_in(doc, table)[typo] = 1
    with pytest.raises(sc.ScenarioError, match=f"did you mean '{hint}'"):
        sc.parse(doc)


@pytest.mark.parametrize("table", [t for t in TABLES if t.path], ids=_id)
def test_a_table_given_as_a_plain_value_is_refused(table: sc.TableDoc) -> None:
    doc = _minimal()
    if table.header.startswith("[["):
        doc[table.path[0]][table.path[1]] = [3]
    else:
        doc[table.path[0]] = 3
    with pytest.raises(sc.ScenarioError, match="expected a table"):
        sc.parse(doc)
