"""Scenario files: TOML describing topology, geometry, fabric, workload, faults, phases and checks.

The public names of the format, gathered from the modules that each do one job:
sim/scenario_schema.py (the tables as typed msgspec Structs, each key documented),
sim/scenario_read.py (``load``/``parse``: msgspec decodes the TOML, then the checks across keys,
derived deadlines, ``with_flow``), sim/scenario_errors.py (msgspec's errors as ``FILE:
[table].key: ...`` with a "did you mean"), sim/scenario_dump.py (``dump``: a scenario back as
TOML) and sim/scenario_docs.py (docs/scenarios.md). Nothing under sim/ that those modules
import imports this one, so it closes no cycle.
"""

from __future__ import annotations

from kvferry.sim.scenario_docs import KeyDoc, TableDoc, schema_markdown, schema_tables
from kvferry.sim.scenario_dump import dump
from kvferry.sim.scenario_read import (
    fabric_profiles,
    load,
    parse,
    profile_fabric,
    with_derived_deadlines,
    with_flow,
    with_overrides,
)
from kvferry.sim.scenario_schema import (
    FABRIC_DOC,
    FAULT_EVENT_KINDS,
    FLOW_CHOICES,
    HOOKS,
    MAX_INSTANCES,
    NODE_EVENT_KINDS,
    PUSH_MATCH_CHOICES,
    REORDER_MAX_NS,
    US,
    WRITE_SLACK_NS,
    Checks,
    FaultEvent,
    Faults,
    FlowSpec,
    ModelSpec,
    Phases,
    RoomSpec,
    Scenario,
    ScenarioError,
    TimeoutSpec,
    Topology,
    Workload,
    flow_choices,
    pools,
    staging_sizes,
)

__all__ = [
    "FABRIC_DOC",
    "FAULT_EVENT_KINDS",
    "FLOW_CHOICES",
    "HOOKS",
    "MAX_INSTANCES",
    "NODE_EVENT_KINDS",
    "PUSH_MATCH_CHOICES",
    "REORDER_MAX_NS",
    "US",
    "WRITE_SLACK_NS",
    "Checks",
    "FaultEvent",
    "Faults",
    "FlowSpec",
    "KeyDoc",
    "ModelSpec",
    "Phases",
    "RoomSpec",
    "Scenario",
    "ScenarioError",
    "TableDoc",
    "TimeoutSpec",
    "Topology",
    "Workload",
    "dump",
    "fabric_profiles",
    "flow_choices",
    "load",
    "parse",
    "pools",
    "profile_fabric",
    "schema_markdown",
    "schema_tables",
    "staging_sizes",
    "with_derived_deadlines",
    "with_flow",
    "with_overrides",
]
