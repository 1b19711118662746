"""Reading a scenario file: ``load(path)`` decodes its TOML with msgspec into the typed tables of
sim/scenario_schema.py (unknown keys, wrong types and out-of-range values refused there, each
error naming the file and the key: ``[faults].ctrl_drop: expected a probability in [0, 1], got
1.5``), then checks what spans keys and tables: presets, TP against the model, node names, room
sizes against the pools, and the deadlines. Deadlines a file leaves out are derived for its
largest room (sim/expected.py), and ``with_flow`` re-derives them for another flow."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
from kvferry.backends.simfabric.spec import PROFILES, ControlSpec, FabricSpec, KernelSpec, NicSpec
from kvferry.core.deadlines import Timeouts
from kvferry.core.errors import GeometryError
from kvferry.core.geometry import PRESETS, Layout, ModelGeometry, validate_tp
from kvferry.sim import scenario_deploy
from kvferry.sim.deploy import hardware
from kvferry.sim.expected import derive, max_msg_ns, max_write_ns, worst
from kvferry.sim.scenario_errors import place, scenario_error
from kvferry.sim.scenario_schema import (
    HOOKS,
    FabricTable,
    FaultEvent,
    Faults,
    ModelSpec,
    ModelTable,
    Phases,
    Scenario,
    ScenarioError,
    ScenarioFile,
    TimeoutSpec,
    Topology,
    Workload,
    flow_choices,
)
from msgspec.structs import replace

TIMEOUT_KEYS = TimeoutSpec.__struct_fields__


def _choice(where: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ScenarioError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")


def _model(m: ModelTable, given: dict[str, Any], file: str) -> ModelSpec:
    if "preset" in given:
        extra = [k for k in given if k != "preset"]
        if extra:
            raise ScenarioError(
                f"{place(file, ('model', extra[0]))}: give either preset or explicit fields, not both"
            )
        try:
            g = ModelGeometry.preset(m.preset)
        except GeometryError as e:
            raise ScenarioError(f"{place(file, ('model', 'preset'))}: {e}") from None
        return ModelSpec(
            name=g.name,
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            dtype=g.dtype.value,
            is_mla=g.is_mla,
        )
    spec = ModelSpec(**{n: getattr(m, n) for n in ModelSpec.__struct_fields__})
    try:
        g = spec.geometry()
    except GeometryError as e:
        raise ScenarioError(f"{place(file, ('model',))}: {e}") from None
    if spec.name in PRESETS and PRESETS[spec.name].same_kv_shape(g) is not None:
        # A preset's name alone used to run the tiny default geometry under that name (the
        # preset's own fields written out, as dump() does, are fine).
        raise ScenarioError(
            f"{place(file, ('model', 'name'))}: {spec.name!r} is a preset: write preset = {spec.name!r} (a "
            "name alone does not set the geometry; give another name for a custom model)"
        )
    return spec


def _check_topology(t: Topology, model: ModelSpec, file: str) -> None:
    layouts = tuple(x.value for x in Layout)
    for side in ("prefill", "decode"):
        _choice(place(file, ("topology", f"{side}_layout")), getattr(t, f"{side}_layout"), layouts)
    g = model.geometry()
    for key in ("prefill_tp", "decode_tp"):
        try:
            validate_tp(g, getattr(t, key))
        except GeometryError as e:
            raise ScenarioError(f"{place(file, ('topology', key))}: {e}") from None


def fabric_profiles() -> tuple[str, ...]:
    """Names ``[fabric] profile`` accepts: the built-in fabrics, then the fitted profiles
    (``kvferry calibrate``, sim/deploy/profiles) that are not also built in."""
    return tuple(PROFILES) + tuple(n for n in hardware.names("fabric") if n not in PROFILES)


def profile_fabric(name: str) -> FabricSpec:
    """The fabric a profile name gives: a fitted profile's numbers over the built-in fabric of the
    same name (or h100-rdma's), so a fitted profile wins over a built-in one of its name."""
    base = PROFILES.get(name, FabricSpec())
    if name not in hardware.names("fabric"):
        return base
    fit = hardware.fitted(name)
    k, n, c = base.kernel, base.nic, base.control
    return dataclasses.replace(
        base,
        nic=dataclasses.replace(
            base.nic,
            bandwidth_bps=int(fit.bandwidth_gbps * 1e9),
            latency_ns=round(fit.latency_us * 1000),
            post_cost_ns=round(fit.post_cost_us * 1000),
            per_desc_ns=round(fit.per_desc_us * 1000),
            read_desc_ns=_ns(fit.read_desc_us, n.read_desc_ns),
            completion_delay_ns=_ns(fit.completion_delay_us, n.completion_delay_ns),
            room_handle_ns=_ns(fit.room_handle_us, n.room_handle_ns),
            completion_handle_ns=_ns(fit.completion_handle_us, n.completion_handle_ns),
            push_handle_ns=_ns(fit.push_handle_us, n.push_handle_ns),
            shared_desc_ns=_ns(fit.shared_desc_us, n.shared_desc_ns),
            host_bandwidth_bps=_bps(fit.host_bandwidth_gbps, n.host_bandwidth_bps),
            host_shared_bandwidth_bps=_bps(fit.host_shared_bandwidth_gbps, n.host_shared_bandwidth_bps),
        ),
        control=dataclasses.replace(
            c,
            latency_ns=_ns(fit.control_latency_us, c.latency_ns),
            handle_ns=_ns(fit.control_handle_us, c.handle_ns),
            staging_handle_ns=_ns(fit.staging_handle_us, c.staging_handle_ns),
            send_ns=_ns(fit.control_send_us, c.send_ns),
        ),
        kernel=dataclasses.replace(
            k,
            launch_ns=_ns(fit.kernel_launch_us, k.launch_ns),
            submit_ns=_ns(fit.copy_submit_us, k.submit_ns),
            gpu_bps=_bps(fit.copy_gpu_gbps, k.gpu_bps),
            pinned_bps=_bps(fit.copy_pinned_gbps, k.pinned_bps),
        ),
    )


def _ns(fitted_us: float | None, built_in: int) -> int:
    """A fitted profile's microseconds in the fabric's nanoseconds; the built-in value where the
    profile does not have it (profiles fitted before the cost existed)."""
    return built_in if fitted_us is None else round(fitted_us * 1000)


def _bps(fitted_gbps: float | None, built_in: int) -> int:
    return built_in if fitted_gbps is None else int(fitted_gbps * 1e9)


def _fabric(f: FabricTable, file: str) -> FabricSpec:
    """The fabric of a ``[fabric]`` table: its profile's numbers, less the keys the table gives."""
    _choice(place(file, ("fabric", "profile")), f.profile, fabric_profiles())
    base = profile_fabric(f.profile)

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    n, c, k = base.nic, base.control, base.kernel
    gbps = f.bandwidth_gbps
    nic = NicSpec(
        bandwidth_bps=n.bandwidth_bps if gbps is None else int(gbps * 1e9),
        latency_ns=given(f.latency_ns, n.latency_ns),
        jitter_ns=given(f.jitter_ns, n.jitter_ns),
        post_cost_ns=given(f.post_cost_ns, n.post_cost_ns),
        per_desc_ns=given(f.per_desc_ns, n.per_desc_ns),
        read_desc_ns=given(f.read_desc_ns, n.read_desc_ns),
        max_inflight=given(f.max_inflight, n.max_inflight),
        error_timeout_ns=given(f.error_timeout_ns, n.error_timeout_ns),
        completion_delay_ns=given(f.completion_delay_ns, n.completion_delay_ns),
        shared_desc_ns=given(f.shared_desc_ns, n.shared_desc_ns),
        room_handle_ns=given(f.room_handle_ns, n.room_handle_ns),
        completion_handle_ns=given(f.completion_handle_ns, n.completion_handle_ns),
        push_handle_ns=given(f.push_handle_ns, n.push_handle_ns),
        host_bandwidth_bps=n.host_bandwidth_bps
        if f.host_bandwidth_gbps is None
        else int(f.host_bandwidth_gbps * 1e9),
        host_shared_bandwidth_bps=n.host_shared_bandwidth_bps
        if f.host_shared_bandwidth_gbps is None
        else int(f.host_shared_bandwidth_gbps * 1e9),
    )
    control = ControlSpec(
        latency_ns=given(f.control_latency_ns, c.latency_ns),
        jitter_ns=given(f.control_jitter_ns, c.jitter_ns),
        handle_ns=given(f.control_handle_ns, c.handle_ns),
        staging_handle_ns=given(f.staging_handle_ns, c.staging_handle_ns),
        send_ns=given(f.control_send_ns, c.send_ns),
    )
    kernel = KernelSpec(
        launch_ns=given(f.kernel_launch_ns, k.launch_ns),
        submit_ns=given(f.kernel_submit_ns, k.submit_ns),
        gpu_bps=k.gpu_bps if f.gpu_copy_gbps is None else int(f.gpu_copy_gbps * 1e9),
        pinned_bps=k.pinned_bps if f.pinned_copy_gbps is None else int(f.pinned_copy_gbps * 1e9),
        busy_mean_ns=given(f.kernel_busy_mean_ns, k.busy_mean_ns),
    )
    return FabricSpec(
        nic=nic,
        control=control,
        kernel=kernel,
        prepped=given(f.prepped, base.prepped),
        one_gpu=given(f.one_gpu, base.one_gpu),
    )


def _workload(w: Workload, given: dict[str, Any], topo: Topology, file: str) -> Workload:
    rooms = w.explicit
    for i, room in enumerate(rooms):
        if room.chunks and sum(room.chunks) != room.tokens:
            raise ScenarioError(
                f"{place(file, ('workload', 'room', i, 'chunks'))}: lengths sum to {sum(room.chunks)}, "
                f"room has {room.tokens} tokens"
            )
    if rooms and "rooms" not in given:
        w = replace(w, rooms=len(rooms))
    if rooms and w.rooms != len(rooms):
        raise ScenarioError(
            f"{place(file, ('workload', 'rooms'))}: {w.rooms} but {len(rooms)} [[workload.room]] entries"
        )
    if w.tokens_min > w.tokens_max:
        raise ScenarioError(
            f"{place(file, ('workload', 'tokens_min'))}: {w.tokens_min} > tokens_max {w.tokens_max}"
        )
    for side in ("prefill", "decode"):
        # A drawn mismatched room's decode length is capped at the pool (sim/world.py).
        longest = max([x.dec_tokens if side == "decode" else x.tokens for x in rooms] or [w.tokens_max])
        cap = getattr(topo, f"{side}_pages") * getattr(topo, f"{side}_page_size")
        if longest > cap:
            raise ScenarioError(
                f"{place(file, ('workload',))}: a room of {longest} tokens does not fit the {side} pool "
                f"({cap} tokens)"
            )
    return w


def _node(where: str, value: str, nodes: tuple[str, ...]) -> None:
    """A node name of the topology; with many, the error shows the pattern, not every name."""
    if len(nodes) <= 12:
        _choice(where, value, nodes)
    elif value not in nodes:
        named = [n for n in nodes if n]
        raise ScenarioError(
            f"{where}: expected a node of the topology ({named[0]} ... {named[-1]}: server, then rank), "
            f"got {value!r}"
        )


def _faults(f: Faults, nodes: tuple[str, ...], file: str) -> Faults:
    for i, ev in enumerate(f.events):
        _node(place(file, ("faults", "event", i, "node")), ev.node, nodes)
        _node(place(file, ("faults", "event", i, "peer")), ev.peer, ("", *nodes))
        peer = place(file, ("faults", "event", i, "peer"))
        if ev.kind != "crash" and not ev.peer:
            raise ScenarioError(f"{peer}: a {ev.kind} event needs the other end of the link")
        if ev.peer == ev.node:
            raise ScenarioError(f"{peer}: a link joins two different nodes")
    return replace(f, events=tuple(sorted(f.events, key=_event_order)))


def _event_order(e: FaultEvent) -> tuple[int, str, str, str]:
    return (e.at_us, e.kind, e.node, e.peer)


def _check_timeouts(where: str, s: Scenario) -> None:
    """Refuse deadlines the core itself calls unsafe for this fabric (a fence shorter than a
    peer may still write would let the checker blame the core for the scenario's settings), or
    shorter than the scenario's own largest room takes to move."""
    t = s.timeouts
    est = worst(s)
    probs = Timeouts(**{n: getattr(t, n) for n in TIMEOUT_KEYS}).problems(
        max_msg_ns(s), max_write_ns(s, est), expected_transfer_ns=est.total_ns, transfer_what=est.describe()
    )
    if probs:
        raise ScenarioError(f"{where}: {'; '.join(probs)}")


def with_derived_deadlines(s: Scenario) -> Scenario:
    """``s`` with the deadlines it does not set derived for its flows (sim/expected.py)."""
    if s.deadlines_set is None:
        return s
    given = s.deadlines_set
    out = derive(
        s,
        frozenset(n for n in given if n != "liveness_us"),
        frozenset(n for n in given if n == "liveness_us"),
    )
    return replace(out, deadlines_set=given)


def parse(data: dict[str, Any], where: str = "scenario") -> Scenario:
    """A scenario from a decoded TOML document; errors name ``where`` (the file) and the key."""
    try:
        f = msgspec.convert(data, ScenarioFile)
    except msgspec.ValidationError as e:
        raise scenario_error(e, data, ScenarioFile, where) from None
    for h in f.hooks:
        if h not in HOOKS:
            raise ScenarioError(
                f"{place(where, ('hooks',))}: unknown planted bug {h!r} (known: {', '.join(HOOKS)})"
            )
    model = _model(f.model, data.get("model", {}), where)
    _check_topology(f.topology, model, where)
    _choice(place(where, ("flows", "flow")), f.flows.flow, flow_choices())
    work = _workload(f.workload, data.get("workload", {}), f.topology, where)
    deploy = scenario_deploy.read(
        where, data.get("deploy", {}), Scenario(model=model, topology=f.topology, workload=work)
    )
    faults = _faults(f.faults, Scenario(topology=f.topology).node_names(), where)
    # The deadlines the file sets; with_derived_deadlines derives the others.
    given = frozenset(n for n in TIMEOUT_KEYS if n in data.get("timeouts", {})) | frozenset(
        n for n in ("liveness_us",) if n in data.get("phases", {})
    )
    out = Scenario(
        name=f.name,
        description=f.description,
        seed=f.seed,
        model=model,
        topology=f.topology,
        fabric_profile=f.fabric.profile,
        fabric=_fabric(f.fabric, where),
        flows=f.flows,
        workload=work,
        faults=faults,
        timeouts=f.timeouts,
        phases=f.phases,
        checks=f.checks,
        hooks=f.hooks,
        move_bytes=f.move_bytes,
        expect_violations=f.expect.violations,
        deadlines_set=given,
        deploy=deploy,
    )
    out = with_derived_deadlines(out)
    _check_timeouts(f"{where}: [timeouts]", out)
    return out


def load(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ScenarioError(f"{p}: is a directory, not a scenario file") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"{p}: not a text (UTF-8) file, so not a TOML scenario") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise ScenarioError(f"{p}: cannot read: {e}") from None
    try:
        # The document as plain TOML first: parse() reads which keys the file gave (deadlines
        # left out are derived) and quotes a refused value from it.
        data = msgspec.toml.decode(text)
    except msgspec.DecodeError as e:
        raise ScenarioError(f"{p}: not valid TOML: {e}") from None
    return parse(data, where=str(p))


def with_flow(s: Scenario, flow: str) -> Scenario:
    """The scenario with every room on ``flow`` (sizes the flow needs are auto-sized)."""
    choices = flow_choices()
    if flow not in choices:
        raise ScenarioError(f"--flow: expected one of {', '.join(choices)}, got {flow!r}")
    out = replace(s, flows=replace(s.flows, flow=flow))
    if s.deadlines_set is None:
        return out
    # Re-derive from the defaults for the new flow (a slower flow needs longer deadlines).
    given = s.deadlines_set
    td, pd = TimeoutSpec(), Phases()
    base = replace(
        out,
        timeouts=TimeoutSpec(**{n: getattr(s.timeouts if n in given else td, n) for n in TIMEOUT_KEYS}),
        phases=replace(
            s.phases, liveness_us=s.phases.liveness_us if "liveness_us" in given else pd.liveness_us
        ),
    )
    derived = with_derived_deadlines(base)
    _check_timeouts(f"[timeouts] under --flow {flow}", derived)
    return derived


def with_overrides(s: Scenario, **kw: Any) -> Scenario:
    return replace(s, **kw)
