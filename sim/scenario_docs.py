"""docs/scenarios.md, generated: every table and key of the scenario format, from the schema's
``DOC`` dicts, with the types and the defaults the parser applies (read off ``parse`` itself).

    python -m kvferry.sim.scenario_docs --markdown > docs/scenarios.md
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from kvferry.core.geometry import PRESETS, DType, Layout
from kvferry.sim import scenario_deploy as sd
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.scenario_dump import fabric_values, toml_value
from kvferry.sim.scenario_read import fabric_profiles, parse
from kvferry.sim.scenario_schema import (
    FABRIC_DOC,
    FAULT_EVENT_KINDS,
    FLOW_CHOICES,
    HOOKS,
    PUSH_MATCH_CHOICES,
    Checks,
    FabricTable,
    FaultEvent,
    Faults,
    FlowSpec,
    ModelSpec,
    Phases,
    RoomSpec,
    Scenario,
    TimeoutSpec,
    Topology,
    Workload,
)
from msgspec import inspect as mi


@dataclass(frozen=True, slots=True)
class KeyDoc:
    key: str
    type: str
    default: str  # as TOML; or "required", or "none" (no value: leaving the key out means something else)
    meaning: str


@dataclass(frozen=True, slots=True)
class TableDoc:
    """One table of the format: its header, where it sits in the TOML document, and its keys."""

    header: str  # "" for the top level
    path: tuple[str, ...]  # ("workload", "room") for [[workload.room]]
    intro: str
    keys: tuple[KeyDoc, ...]


_TOML_TYPES = {
    int: "integer",
    float: "number",
    bool: "boolean",
    str: "string",
}
_TYPE_NAMES = {mi.IntType: "integer", mi.FloatType: "number", mi.BoolType: "boolean", mi.StrType: "string"}
# Scenario fields that are tables, not top-level keys (each documented by its own dataclass).
_TABLE_FIELDS = frozenset(
    (
        "model",
        "topology",
        "fabric_profile",
        "fabric",
        "flows",
        "workload",
        "faults",
        "timeouts",
        "phases",
        "checks",
        "expect_violations",
        "deadlines_set",
        "deploy",
    )
)
# The smallest valid entry of each array of tables: its keys are the required ones, and parsing it
# gives the defaults of the others.
_MINIMAL_ENTRIES: dict[str, Any] = {
    "workload": {"room": [{"tokens": 16}]},
    "faults": {"event": [{"kind": "crash", "node": "prefill0"}]},
}


def _choices() -> dict[tuple[str, str], tuple[str, ...]]:
    layouts = tuple(x.value for x in Layout)
    return {
        ("", "hooks"): HOOKS,
        ("[model]", "dtype"): tuple(x.value for x in DType),
        ("[model]", "preset"): tuple(sorted(PRESETS)),
        ("[topology]", "prefill_layout"): layouts,
        ("[topology]", "decode_layout"): layouts,
        ("[fabric]", "profile"): fabric_profiles(),
        ("[flows]", "flow"): FLOW_CHOICES,
        ("[flows]", "push_match"): PUSH_MATCH_CHOICES,
        ("[[faults.event]]", "kind"): FAULT_EVENT_KINDS,
    }


def _doc_default(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:_}"  # TOML reads 50_000_000 too, and a reader counts the zeros at a glance
    return toml_value(v)


def _value_type(v: Any) -> str:
    return _TOML_TYPES[type(v)]


def _toml_type(t: mi.Type) -> str:
    """A key's type in TOML's words, from the type msgspec decodes it as."""
    if isinstance(t, mi.VarTupleType):
        return f"array of {_toml_type(t.item_type)}s"
    if isinstance(t, mi.LiteralType):
        return "string"
    return _TYPE_NAMES[type(t)]


def _field_keys(
    cls: type, values: Any, skip: tuple[str, ...] = (), required: tuple[str, ...] = ()
) -> list[KeyDoc]:
    doc: dict[str, str] = cls.DOC  # type: ignore[attr-defined]
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    names = [f.name for f in info.fields if f.name not in skip]
    missing, extra = set(names) - set(doc), set(doc) - {f.name for f in info.fields}
    if missing or extra:
        raise ValueError(f"{cls.__name__}.DOC: undocumented {sorted(missing)}, not fields {sorted(extra)}")
    types = {f.name: f for f in info.fields}
    return [
        KeyDoc(types[n].encode_name, "array of tables", "[]", doc[n])
        if isinstance(types[n].type, mi.VarTupleType) and isinstance(types[n].type.item_type, mi.StructType)
        else KeyDoc(
            n,
            _toml_type(types[n].type),
            "required" if n in required else _doc_default(getattr(values, n)),
            doc[n],
        )
        for n in names
    ]


def _fabric_doc() -> dict[str, str]:
    if tuple(FABRIC_DOC) != FabricTable.__struct_fields__:
        raise ValueError(f"FABRIC_DOC: keys {list(FABRIC_DOC)}, [fabric] has {FabricTable.__struct_fields__}")
    return FABRIC_DOC


def _top_keys(s: Scenario) -> list[KeyDoc]:
    stray = set(Scenario.__struct_fields__) - set(Scenario.DOC) - _TABLE_FIELDS
    if stray:
        raise ValueError(f"Scenario: fields neither in Scenario.DOC nor tables: {sorted(stray)}")
    return _field_keys(Scenario, s, skip=tuple(_TABLE_FIELDS))


def schema_tables() -> list[TableDoc]:
    """Every table of the scenario format, its keys, their types, and the defaults the parser
    applies (read off ``parse`` itself, so they are the ones a run gets)."""
    s = parse({})
    entries = parse(_MINIMAL_ENTRIES)
    return [
        *_deployment_tables(s),
        *_run_tables(s, entries),
        *_limit_tables(s),
        _deploy_doc(),
    ]


def _deployment_tables(s: Scenario) -> list[TableDoc]:
    """The top level, the model, the ranks, the fabric and the flows: what moves over what."""
    fabric = fabric_values(s)
    return [
        TableDoc("", (), "Keys outside any table.", tuple(_top_keys(s))),
        TableDoc(
            "[model]",
            ("model",),
            "The model whose KV cache moves. Either `preset` alone or the explicit keys.",
            (
                *_field_keys(ModelSpec, s.model),
                KeyDoc("preset", "string", "none", "A known model's geometry instead of the keys above."),
            ),
        ),
        TableDoc(
            "[topology]",
            ("topology",),
            "Ranks, pages and workers of each side.",
            tuple(_field_keys(Topology, s.topology)),
        ),
        TableDoc(
            "[fabric]",
            ("fabric",),
            "The simulated network and copy kernels. Defaults shown are the `h100-rdma` profile's; "
            "another `profile` changes them.",
            tuple(
                KeyDoc(k, _value_type(fabric[k]), _doc_default(fabric[k]), meaning)
                for k, meaning in _fabric_doc().items()
            ),
        ),
        TableDoc(
            "[flows]",
            ("flows",),
            "Which flow moves each room, and the staging memory each rank registers. Sizes in bytes.",
            tuple(_field_keys(FlowSpec, s.flows)),
        ),
    ]


def _run_tables(s: Scenario, entries: Scenario) -> list[TableDoc]:
    """The rooms of a run and the faults injected into it, drawn and listed."""
    room, event = entries.workload.explicit[0], entries.faults.events[0]
    return [
        TableDoc(
            "[workload]",
            ("workload",),
            "The rooms of the run: drawn at random, or listed one by one in `[[workload.room]]`.",
            tuple(_field_keys(Workload, s.workload)),
        ),
        TableDoc(
            "[[workload.room]]",
            ("workload", "room"),
            "One room, given explicitly; repeat the table for each room.",
            tuple(_field_keys(RoomSpec, room, required=tuple(_MINIMAL_ENTRIES["workload"]["room"][0]))),
        ),
        TableDoc(
            "[faults]",
            ("faults",),
            "Random faults, each a probability per message or write, injected until "
            "`[phases].fault_window_us`.",
            tuple(_field_keys(Faults, s.faults)),
        ),
        TableDoc(
            "[[faults.event]]",
            ("faults", "event"),
            "One timed fault; repeat the table for each.",
            tuple(_field_keys(FaultEvent, event, required=tuple(_MINIMAL_ENTRIES["faults"]["event"][0]))),
        ),
    ]


def _limit_tables(s: Scenario) -> list[TableDoc]:
    """The deadlines, the phases, the checks and the expected violations: what a run is held to."""
    return [
        TableDoc(
            "[timeouts]",
            ("timeouts",),
            "The core's deadlines, in ns, scaled down for simulated runs. A key left out whose default "
            "is too short for the scenario's largest room (4x its expected transfer: posting, wire, "
            "kernels, compute on this fabric and flow; sim/expected.py) is derived from it, and so are "
            "the fence, the tombstone and `[phases].liveness_us` then. A file whose deadlines the core "
            "calls unsafe for its fabric (a fence shorter than a peer may still write), or shorter than "
            "its largest room's transfer, is refused.",
            tuple(_field_keys(TimeoutSpec, s.timeouts)),
        ),
        TableDoc(
            "[phases]",
            ("phases",),
            "The fault window and the liveness deadline.",
            tuple(_field_keys(Phases, s.phases)),
        ),
        TableDoc(
            "[checks]",
            ("checks",),
            "Invariants checked; each can be turned off.",
            tuple(_field_keys(Checks, s.checks)),
        ),
        TableDoc(
            "[expect]",
            ("expect",),
            "For regression files of planted bugs.",
            (
                KeyDoc(
                    "violations",
                    "array of strings",
                    "[]",
                    "Invariants this file is known to break: replay passes only if exactly these break.",
                ),
            ),
        ),
    ]


def _deploy_doc() -> TableDoc:
    """[deploy]: its keys are DeploySpec's (sim/scenario_deploy.py), so is their list here."""
    known, spec = sd.keys(), DeploySpec()
    stale = set(sd.DOC) - set(known)
    if stale:
        raise ValueError(f"scenario_deploy.DOC: not [deploy] keys {sorted(stale)}")
    refused = ", ".join(f"`{k}`" for k in sd.REFUSED)
    intro = (
        "Deployment knobs for `kvferry select --scenario FILE` (replay ignores this table): the fields "
        "of `DeploySpec` (sim/deploy/spec.py), less those the file sets elsewhere or select sets itself, "
        f"which are refused here with where they belong: {refused}. A key given here wins over select's "
        "option of the same name, whether given or left at its default (as the file's model and TP "
        "already do); a key left out takes the option, or `DeploySpec`'s default where select has none. "
        "Types are strict: an integer is a number, but `true` is not an integer. The table is checked "
        "as one deployment when the file loads (the file's model, TP, page sizes, workers and chunk "
        "size, these keys, `DeploySpec`'s defaults for the rest), so it needs a `[model] preset`.\n\n"
        '```toml\n[model]\npreset = "qwen3-8b"\n\n[deploy]\ngpu = "h200"\n'
        'page_allocator = "lowest-first"\nmax_batch = 128\n```'
    )
    rows = tuple(
        KeyDoc(
            k,
            _TOML_TYPES[kind],
            "none",  # left out, select's option decides
            f"{sd.DOC.get(k, 'See `DeploySpec` in sim/deploy/spec.py.')} "
            f"Select's default: `{_doc_default(getattr(spec, k))}`.",
        )
        for k, kind in known.items()
    )
    return TableDoc("[deploy]", ("deploy",), intro, rows)


_PREAMBLE = """\
# Scenario files

<!-- Generated from sim/scenario_schema.py: edit the DOC dicts there, then run
     python -m kvferry.sim.scenario_docs --markdown > docs/scenarios.md
     (tests/test_scenario_docs.py fails while this file differs from the generated text). -->

A scenario is one TOML file (`kvferry replay FILE` runs it; `scenarios/` holds examples). Every table
and every key is optional unless marked required; a key left out takes the default shown, which is
what the parser applies. An unknown key, in any table, is an error naming the file and the key (with
a "did you mean" for near misses), and so is a value of the wrong type or out of range
(`[faults].ctrl_drop: expected a probability in [0, 1], got 1.5`). Times are in the unit their key
ends with (`_us`, `_ns`).
"""


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(t: TableDoc, choices: dict[tuple[str, str], tuple[str, ...]]) -> list[str]:
    title = f"`{t.header}`" if t.header else "Top level"
    lines = [f"## {title}", "", t.intro, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for k in t.keys:
        meaning = k.meaning
        if (t.header, k.key) in choices:
            meaning += " One of: " + ", ".join(f"`{c}`" for c in choices[(t.header, k.key)]) + "."
        default = k.default if k.default in ("required", "none") else f"`{k.default}`"
        lines.append(f"| `{k.key}` | {k.type} | {_md_cell(default)} | {_md_cell(meaning)} |")
    return [*lines, ""]


def schema_markdown() -> str:
    """docs/scenarios.md: every table and key of the format, from the dataclasses and the parser."""
    choices = _choices()
    lines = [_PREAMBLE]
    for t in schema_tables():
        lines += _md_table(t, choices)
    return "\n".join(lines).rstrip("\n") + "\n"


def _main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        sys.stderr.write("usage: python -m kvferry.sim.scenario_docs --markdown > docs/scenarios.md\n")
        return 2
    sys.stdout.write(schema_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
