"""Reading a scenario file: ``load(path)`` parses and validates; every error names the file and
the offending field (``[faults].ctrl_drop: expected a probability in [0, 1], got 1.5``). Deadlines a
file leaves out are derived for its largest room (sim/expected.py), and ``with_flow`` re-derives
them for another flow."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvferry.backends.simfabric.spec import PROFILES, ControlSpec, FabricSpec, KernelSpec, NicSpec
from kvferry.core.deadlines import Timeouts
from kvferry.core.errors import GeometryError
from kvferry.core.geometry import PRESETS, Layout, ModelGeometry, validate_tp
from kvferry.sim import scenario_deploy
from kvferry.sim import scenario_fields as sf  # looked up per call: a test records the keys read
from kvferry.sim.deploy import hardware
from kvferry.sim.expected import derive, max_msg_ns, max_write_ns, worst
from kvferry.sim.scenario_schema import (
    FABRIC_DOC,
    FAULT_EVENT_KINDS,
    HOOKS,
    MAX_INSTANCES,
    PUSH_MATCH_CHOICES,
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
)


def _model(r: sf.Reader) -> ModelSpec:
    if "preset" in r.table:
        name = r.str("preset", "")
        extra = [k for k in r.table if k != "preset"]
        if extra:
            raise ScenarioError(f"{r.where}.{extra[0]}: give either preset or explicit fields, not both")
        try:
            g = ModelGeometry.preset(name)
        except GeometryError as e:
            raise ScenarioError(f"{r.where}.preset: {e}") from None
        return ModelSpec(g.name, g.num_layers, g.num_kv_heads, g.head_dim, g.dtype.value, g.is_mla)
    d = ModelSpec()
    spec = ModelSpec(
        name=r.str("name", d.name),
        num_layers=r.int("num_layers", d.num_layers, lo=1),
        num_kv_heads=r.int("num_kv_heads", d.num_kv_heads, lo=1),
        head_dim=r.int("head_dim", d.head_dim, lo=1),
        dtype=r.str("dtype", d.dtype),
        is_mla=r.bool("is_mla", d.is_mla),
    )
    try:
        g = spec.geometry()
    except GeometryError as e:
        raise ScenarioError(f"{r.where}: {e}") from None
    if spec.name in PRESETS and PRESETS[spec.name].same_kv_shape(g) is not None:
        # A preset's name alone used to run the tiny default geometry under that name (the
        # preset's own fields written out, as dump() does, are fine).
        raise ScenarioError(
            f"{sf.at(r.where, 'name')}: {spec.name!r} is a preset: write preset = {spec.name!r} (a name "
            "alone does not set the geometry; give another name for a custom model)"
        )
    return spec


def _topology(r: sf.Reader, model: ModelSpec) -> Topology:
    d = Topology()
    layouts = tuple(x.value for x in Layout)
    t = Topology(
        prefill_tp=r.int("prefill_tp", d.prefill_tp, lo=1, hi=64),
        decode_tp=r.int("decode_tp", d.decode_tp, lo=1, hi=64),
        prefill_page_size=r.int("prefill_page_size", d.prefill_page_size, lo=1, hi=1024),
        decode_page_size=r.int("decode_page_size", d.decode_page_size, lo=1, hi=1024),
        prefill_pages=r.int("prefill_pages", d.prefill_pages, lo=1, hi=1 << 20),
        decode_pages=r.int("decode_pages", d.decode_pages, lo=1, hi=1 << 20),
        prefill_layout=r.str("prefill_layout", d.prefill_layout, layouts),
        decode_layout=r.str("decode_layout", d.decode_layout, layouts),
        workers=r.int("workers", d.workers, lo=1, hi=64),
        aux_rows=r.int("aux_rows", d.aux_rows, lo=1, hi=1 << 16),
        prefill_instances=r.int("prefill_instances", d.prefill_instances, lo=1, hi=MAX_INSTANCES),
        decode_instances=r.int("decode_instances", d.decode_instances, lo=1, hi=MAX_INSTANCES),
    )
    g = model.geometry()
    for key in ("prefill_tp", "decode_tp"):
        try:
            validate_tp(g, getattr(t, key))
        except GeometryError as e:
            raise ScenarioError(f"{r.where}.{key}: {e}") from None
    return t


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
    return replace(
        base,
        nic=replace(
            base.nic,
            bandwidth_bps=int(fit.bandwidth_gbps * 1e9),
            latency_ns=round(fit.latency_us * 1000),
            post_cost_ns=round(fit.post_cost_us * 1000),
            per_desc_ns=round(fit.per_desc_us * 1000),
            completion_delay_ns=n.completion_delay_ns
            if fit.completion_delay_us is None
            else round(fit.completion_delay_us * 1000),
        ),
        control=c
        if fit.control_latency_us is None
        else replace(c, latency_ns=round(fit.control_latency_us * 1000)),
        kernel=replace(
            k,
            launch_ns=k.launch_ns if fit.kernel_launch_us is None else round(fit.kernel_launch_us * 1000),
            gpu_bps=k.gpu_bps if fit.copy_gpu_gbps is None else int(fit.copy_gpu_gbps * 1e9),
            pinned_bps=k.pinned_bps if fit.copy_pinned_gbps is None else int(fit.copy_pinned_gbps * 1e9),
        ),
    )


def _fabric(r: sf.Reader) -> tuple[str, FabricSpec]:
    profile = r.str("profile", "h100-rdma", fabric_profiles())
    base = profile_fabric(profile)
    n, c = base.nic, base.control
    nic = NicSpec(
        bandwidth_bps=int(r.float("bandwidth_gbps", n.bandwidth_bps / 1e9, lo=0.001) * 1e9),
        latency_ns=r.int("latency_ns", n.latency_ns),
        jitter_ns=r.int("jitter_ns", n.jitter_ns),
        post_cost_ns=r.int("post_cost_ns", n.post_cost_ns),
        per_desc_ns=r.int("per_desc_ns", n.per_desc_ns),
        max_inflight=r.int("max_inflight", n.max_inflight, lo=1),
        error_timeout_ns=r.int("error_timeout_ns", n.error_timeout_ns),
        completion_delay_ns=r.int("completion_delay_ns", n.completion_delay_ns),
    )
    control = ControlSpec(
        latency_ns=r.int("control_latency_ns", c.latency_ns),
        jitter_ns=r.int("control_jitter_ns", c.jitter_ns),
    )
    k = base.kernel
    kernel = KernelSpec(
        launch_ns=r.int("kernel_launch_ns", k.launch_ns),
        gpu_bps=int(r.float("gpu_copy_gbps", k.gpu_bps / 1e9, lo=0.001) * 1e9),
        pinned_bps=int(r.float("pinned_copy_gbps", k.pinned_bps / 1e9, lo=0.001) * 1e9),
        busy_mean_ns=r.int("kernel_busy_mean_ns", k.busy_mean_ns),
    )
    return profile, FabricSpec(
        nic=nic, control=control, kernel=kernel, prepped=r.bool("prepped", base.prepped)
    )


def _flows(r: sf.Reader) -> FlowSpec:
    d = FlowSpec()
    sizes = {
        n: r.int(n, getattr(d, n), hi=1 << 40)
        for n in ("ring_bytes", "pinned_bytes", "worker_buffer_bytes", "prefill_pinned_bytes")
    }
    return FlowSpec(
        flow=r.str("flow", d.flow, flow_choices()),
        fallback_direct=r.bool("fallback_direct", d.fallback_direct),
        auto_chunks=r.int("auto_chunks", d.auto_chunks, lo=1, hi=1024),
        push_match=r.str("push_match", d.push_match, PUSH_MATCH_CHOICES),
        **sizes,
    )


def _workload(r: sf.Reader, topo: Topology) -> Workload:
    d = Workload()
    rooms: list[RoomSpec] = []
    for i, raw in enumerate(r.list("room")):
        rr = sf.Reader(f"{r.where}.room[{i}]", raw, sf.field_names(RoomSpec))
        tokens = rr.int("tokens", 0, lo=1)
        chunks = rr.list("chunks")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in chunks):
            raise ScenarioError(f"{rr.where}.chunks: expected positive integers, got {chunks!r}")
        if chunks and sum(chunks) != tokens:
            raise ScenarioError(f"{rr.where}.chunks: lengths sum to {sum(chunks)}, room has {tokens} tokens")
        rooms.append(
            RoomSpec(
                tokens,
                rr.int("arrival_us", 0),
                tuple(chunks),
                rr.int("prefill_delay_us", 0),
                rr.int("decode_lag_us", 0),
                rr.int("decode_tokens", 0),
            )
        )
    w = Workload(
        rooms=r.int("rooms", len(rooms) if rooms else d.rooms, lo=0, hi=1_000_000),
        tokens_min=r.int("tokens_min", d.tokens_min, lo=1),
        tokens_max=r.int("tokens_max", d.tokens_max, lo=1),
        chunk_tokens=r.int("chunk_tokens", d.chunk_tokens, lo=0),
        arrival_mean_us=r.int("arrival_mean_us", d.arrival_mean_us),
        compute_ns_per_token=r.int("compute_ns_per_token", d.compute_ns_per_token),
        decode_lag_us_max=r.int("decode_lag_us_max", d.decode_lag_us_max, hi=10_000_000),
        length_mismatch=r.prob("length_mismatch", d.length_mismatch),
        prefix_hit=r.float("prefix_hit", d.prefix_hit, hi=1.0),
        explicit=tuple(rooms),
    )
    if rooms and w.rooms != len(rooms):
        raise ScenarioError(f"{r.where}.rooms: {w.rooms} but {len(rooms)} [[workload.room]] entries")
    if w.tokens_min > w.tokens_max:
        raise ScenarioError(f"{r.where}.tokens_min: {w.tokens_min} > tokens_max {w.tokens_max}")
    for side in ("prefill", "decode"):
        # A drawn mismatched room's decode length is capped at the pool (sim/world.py).
        longest = max([x.dec_tokens if side == "decode" else x.tokens for x in rooms] or [w.tokens_max])
        cap = getattr(topo, f"{side}_pages") * getattr(topo, f"{side}_page_size")
        if longest > cap:
            raise ScenarioError(
                f"{r.where}: a room of {longest} tokens does not fit the {side} pool ({cap} tokens)"
            )
    return w


def _node(r: sf.Reader, key: str, nodes: tuple[str, ...]) -> str:
    """A node name of the topology; with many, the error shows the pattern, not every name."""
    if len(nodes) <= 12:
        return r.str(key, "", nodes)
    v = r.str(key, "")
    if v not in nodes:
        named = [n for n in nodes if n]
        raise r._err(
            key,
            f"expected a node of the topology ({named[0]} ... {named[-1]}: server, then rank), got {v!r}",
        )
    return v


def _faults(r: sf.Reader, nodes: tuple[str, ...]) -> Faults:
    d = Faults()
    events: list[FaultEvent] = []
    for i, raw in enumerate(r.list("event")):
        er = sf.Reader(f"{r.where}.event[{i}]", raw, sf.field_names(FaultEvent))
        kind = er.str("kind", "", FAULT_EVENT_KINDS)
        node = _node(er, "node", nodes)
        peer = _node(er, "peer", ("", *nodes))
        if kind != "crash" and not peer:
            raise ScenarioError(f"{er.where}.peer: a {kind} event needs the other end of the link")
        if peer == node:
            raise ScenarioError(f"{er.where}.peer: a link joins two different nodes")
        events.append(
            FaultEvent(
                at_us=er.int("at_us", 0),
                kind=kind,
                node=node,
                peer=peer,
                duration_us=er.int("duration_us", 0),
                factor=er.float("factor", 1.0, lo=1e-6, hi=1.0),
            )
        )
    return Faults(
        swarm=r.bool("swarm", d.swarm),
        ctrl_drop=r.prob("ctrl_drop", d.ctrl_drop),
        ctrl_dup=r.prob("ctrl_dup", d.ctrl_dup),
        ctrl_reorder=r.prob("ctrl_reorder", d.ctrl_reorder),
        ctrl_delay=r.prob("ctrl_delay", d.ctrl_delay),
        ctrl_delay_max_us=r.int("ctrl_delay_max_us", d.ctrl_delay_max_us),
        xfer_err=r.prob("xfer_err", d.xfer_err),
        abort=r.prob("abort", d.abort),
        notif_drop=r.prob("notif_drop", d.notif_drop),
        notif_delay=r.prob("notif_delay", d.notif_delay),
        notif_delay_max_us=r.int("notif_delay_max_us", d.notif_delay_max_us),
        clock_skew_max_us=r.int("clock_skew_max_us", d.clock_skew_max_us),
        events=tuple(sorted(events, key=lambda e: (e.at_us, e.kind, e.node, e.peer))),
    )


def _check_timeouts(where: str, s: Scenario) -> None:
    """Refuse deadlines the core itself calls unsafe for this fabric (a fence shorter than a
    peer may still write would let the checker blame the core for the scenario's settings), or
    shorter than the scenario's own largest room takes to move."""
    t = s.timeouts
    est = worst(s)
    probs = Timeouts(**{n: getattr(t, n) for n in sf.field_names(TimeoutSpec)}).problems(
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
    top = sf.Reader(
        where,
        data,
        (
            "name",
            "description",
            "seed",
            "model",
            "topology",
            "fabric",
            "flows",
            "workload",
            "faults",
            "timeouts",
            "phases",
            "checks",
            "hooks",
            "move_bytes",
            "expect",
            "deploy",
        ),
    )
    model = _model(
        sf.Reader(f"{where}: [model]", data.get("model", {}), (*sf.field_names(ModelSpec), "preset"))
    )
    topo = _topology(
        sf.Reader(f"{where}: [topology]", data.get("topology", {}), sf.field_names(Topology)), model
    )
    profile, fabric = _fabric(sf.Reader(f"{where}: [fabric]", data.get("fabric", {}), tuple(FABRIC_DOC)))
    flows = _flows(sf.Reader(f"{where}: [flows]", data.get("flows", {}), sf.field_names(FlowSpec)))
    work = _workload(
        sf.Reader(
            f"{where}: [workload]",
            data.get("workload", {}),
            (*(n for n in sf.field_names(Workload) if n != "explicit"), "room"),
        ),
        topo,
    )
    deploy = scenario_deploy.read(
        where, data.get("deploy", {}), Scenario(model=model, topology=topo, workload=work)
    )
    base = Scenario(topology=topo)
    faults = _faults(
        sf.Reader(
            f"{where}: [faults]",
            data.get("faults", {}),
            (*(n for n in sf.field_names(Faults) if n != "events"), "event"),
        ),
        base.node_names(),
    )
    tr = sf.Reader(f"{where}: [timeouts]", data.get("timeouts", {}), sf.field_names(TimeoutSpec))
    td = TimeoutSpec()
    timeouts = TimeoutSpec(**{n: tr.int(n, getattr(td, n), lo=1) for n in sf.field_names(TimeoutSpec)})
    pr = sf.Reader(f"{where}: [phases]", data.get("phases", {}), sf.field_names(Phases))
    phases = Phases(
        pr.int("fault_window_us", Phases().fault_window_us), pr.int("liveness_us", Phases().liveness_us, lo=1)
    )
    cr = sf.Reader(f"{where}: [checks]", data.get("checks", {}), sf.field_names(Checks))
    checks = Checks(**{n: cr.bool(n, True) for n in sf.field_names(Checks)})
    hooks = top.list("hooks")
    for h in hooks:
        if h not in HOOKS:
            raise ScenarioError(
                f"{sf.at(where, 'hooks')}: unknown planted bug {h!r} (known: {', '.join(HOOKS)})"
            )
    er = sf.Reader(f"{where}: [expect]", data.get("expect", {}), ("violations",))
    expect = er.list("violations")
    given = frozenset(n for n in sf.field_names(TimeoutSpec) if n in tr.table) | frozenset(
        n for n in ("liveness_us",) if n in pr.table
    )
    out = Scenario(
        name=top.str("name", "unnamed"),
        description=top.str("description", ""),
        seed=top.int("seed", 0),
        model=model,
        topology=topo,
        fabric_profile=profile,
        fabric=fabric,
        flows=flows,
        workload=work,
        faults=faults,
        timeouts=timeouts,
        phases=phases,
        checks=checks,
        hooks=tuple(hooks),
        move_bytes=top.bool("move_bytes", True),
        expect_violations=tuple(str(x) for x in expect),
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
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
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
        timeouts=TimeoutSpec(
            **{n: getattr(s.timeouts if n in given else td, n) for n in sf.field_names(TimeoutSpec)}
        ),
        phases=replace(
            s.phases, liveness_us=s.phases.liveness_us if "liveness_us" in given else pd.liveness_us
        ),
    )
    derived = with_derived_deadlines(base)
    _check_timeouts(f"[timeouts] under --flow {flow}", derived)
    return derived


def with_overrides(s: Scenario, **kw: Any) -> Scenario:
    return replace(s, **kw)
