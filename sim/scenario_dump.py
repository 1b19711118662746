"""Writing a scenario back as TOML, which is how a failing fuzz seed becomes a regression file:
``parse(tomllib.loads(dump(s)))`` gives ``s`` back."""

from __future__ import annotations

from typing import Any

from kvferry.sim.scenario_schema import (
    Checks,
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


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, tuple | list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _table(name: str, values: dict[str, Any]) -> list[str]:
    lines = [f"[{name}]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    return [*lines, ""]


def fabric_values(s: Scenario) -> dict[str, Any]:
    """The [fabric] table of a scenario, in the file's keys and units."""
    n, c, k = s.fabric.nic, s.fabric.control, s.fabric.kernel
    return {
        "profile": s.fabric_profile,
        "bandwidth_gbps": n.bandwidth_bps / 1e9,
        "latency_ns": n.latency_ns,
        "jitter_ns": n.jitter_ns,
        "post_cost_ns": n.post_cost_ns,
        "per_desc_ns": n.per_desc_ns,
        "read_desc_ns": n.read_desc_ns,
        "max_inflight": n.max_inflight,
        "error_timeout_ns": n.error_timeout_ns,
        "completion_delay_ns": n.completion_delay_ns,
        "room_handle_ns": n.room_handle_ns,
        "completion_handle_ns": n.completion_handle_ns,
        "push_handle_ns": n.push_handle_ns,
        "shared_desc_ns": n.shared_desc_ns,
        "host_bandwidth_gbps": n.host_bandwidth_bps / 1e9,
        "host_shared_bandwidth_gbps": n.host_shared_bandwidth_bps / 1e9,
        "control_latency_ns": c.latency_ns,
        "control_jitter_ns": c.jitter_ns,
        "control_handle_ns": c.handle_ns,
        "staging_handle_ns": c.staging_handle_ns,
        "control_send_ns": c.send_ns,
        "kernel_launch_ns": k.launch_ns,
        "kernel_submit_ns": k.submit_ns,
        "kernel_busy_mean_ns": k.busy_mean_ns,
        "gpu_copy_gbps": k.gpu_bps / 1e9,
        "pinned_copy_gbps": k.pinned_bps / 1e9,
        "prepped": s.fabric.prepped,
        "one_gpu": s.fabric.one_gpu,
    }


def dump(s: Scenario) -> str:
    """The scenario as TOML; ``parse(tomllib.loads(dump(s)))`` gives ``s`` back."""
    out = [f"name = {toml_value(s.name)}", f"description = {toml_value(s.description)}", f"seed = {s.seed}"]
    if s.hooks:
        out.append(f"hooks = {toml_value(s.hooks)}")
    if not s.move_bytes:
        out.append("move_bytes = false")
    out.append("")
    m = s.model
    out += _table("model", {n: getattr(m, n) for n in ModelSpec.__struct_fields__})
    out += _table("topology", {n: getattr(s.topology, n) for n in Topology.__struct_fields__})
    out += _table("fabric", fabric_values(s))
    out += _table("flows", {n: getattr(s.flows, n) for n in FlowSpec.__struct_fields__})
    w = s.workload
    out += _table("workload", {n: getattr(w, n) for n in Workload.__struct_fields__ if n != "explicit"})
    for room in w.explicit:
        out += _table("[workload.room]", {n: getattr(room, n) for n in RoomSpec.__struct_fields__})
    f = s.faults
    out += _table("faults", {n: getattr(f, n) for n in Faults.__struct_fields__ if n != "events"})
    for ev in f.events:
        out += _table("[faults.event]", {n: getattr(ev, n) for n in FaultEvent.__struct_fields__})
    out += _table("timeouts", {n: getattr(s.timeouts, n) for n in TimeoutSpec.__struct_fields__})
    out += _table("phases", {n: getattr(s.phases, n) for n in Phases.__struct_fields__})
    out += _table("checks", {n: getattr(s.checks, n) for n in Checks.__struct_fields__})
    if s.deploy:  # written only when set, so a file without it dumps as before
        out += _table("deploy", s.deploy)
    if s.expect_violations:
        out += _table("expect", {"violations": s.expect_violations})
    return "\n".join(out)
