"""``kvferry calibrate``: fit the simulated fabric (and kernels) to NIXL telemetry, write a named
profile; ``kvferry bench predict``: the simulator's GB/s beside ``bench nixl --json`` rows."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import typer

from kvferry.commands import bad_input, check_output_file, progress
from kvferry.commands.options import options

if TYPE_CHECKING:  # the fit's modules import numpy: loaded only when a command runs
    from kvferry.sim.calibrate.fit import FabricFit, KernelFit
    from kvferry.sim.calibrate.hostshare import HostShareFit
    from kvferry.sim.calibrate.inputs import Telemetry
    from kvferry.sim.calibrate.posting import FlowFit
    from kvferry.sim.calibrate.predict import FlowError
    from kvferry.sim.calibrate.readpost import ReadFit
    from kvferry.sim.calibrate.rooms import RoomFit

DEFAULT_FABRIC = "h100-rdma"  # sim/scenario.py's default [fabric] profile


def register(app: typer.Typer) -> None:
    from kvferry.commands.bench import bench_app

    app.command("calibrate")(calibrate)
    bench_app.command("predict")(predict)


def _mb(sizes: tuple[int, ...]) -> str:
    return ", ".join(f"{s / 1e6:.1f}" for s in sizes) + " MB"


def _check_target(path: Path, name: str, option: str) -> None:
    """A fitted profile may replace a fitted one (a recalibration), never a shipped GPU/NIC profile
    nor any other file."""
    if not path.exists():
        return
    try:
        kind = tomllib.loads(path.read_text()).get("kind")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        kind = None
    if kind != "fabric":
        what = kind or "unreadable"
        bad_input(f"{option} {path}: exists and is not a fitted profile ({what}); not replacing it")


@dataclass(frozen=True)
class CalibrateOpts:
    telemetry: Annotated[
        list[Path], typer.Argument(help="Telemetry files of `kvferry bench nixl --telemetry` (one or more).")
    ]
    name: Annotated[
        str, typer.Option(help="Profile name: sim/deploy/profiles/NAME.toml, for --nic NAME and scenarios.")
    ] = ""
    kernels: Annotated[
        Path | None,
        typer.Option(help="Kernel bench JSON (bench/kernel_bench.py --json): fit the copy kernels."),
    ] = None
    out: Annotated[
        Path | None,
        typer.Option(help="Write the profile here, not in the profile folder (not found by name)."),
    ] = None
    compare: Annotated[
        Path | None,
        typer.Option(help="`bench nixl --json` rows: print the fitted profile's prediction beside each."),
    ] = None
    rooms: Annotated[
        list[Path] | None,
        typer.Option(
            help="`bench nixl --json` rows (repeat for several files): fit the per-room control path "
            "(control message latency, completion delay, a copy's host work) to their ms per room, "
            "some room sizes held out."
        ),
    ] = None
    rooms_check: Annotated[
        list[Path] | None,
        typer.Option(
            help="`bench nixl --json` rows measured apart (repeat): the per-room fit's held-out check; "
            "every --rooms row is then fit (no room size of them held out)."
        ),
    ] = None
    flow_telemetry: Annotated[
        list[Path] | None,
        typer.Option(
            help="Telemetry of different-TP direct rooms and of pinned rooms (repeat): fit the cost a "
            "descriptor of one process and of the GPU every process shares, and the host wire."
        ),
    ] = None
    transport: Annotated[
        str,
        typer.Option(
            help="What moved the bytes (cuda_ipc, ib_verbs, efa, tcp, cma): the telemetry does not say."
        ),
    ] = "fitted"
    control_handle_us: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="A measured cost (not fitted): how long a runtime's control thread holds each "
            "message, so messages arriving together wait (bench/wake_probe.py: the control plane "
            "over the ZMQ under it). Charged while the room costs are fitted; 0: off.",
        ),
    ] = 0.0
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False


class _Fits(NamedTuple):
    """What a calibration read and fitted: the telemetry, the fabric, and the optional parts."""

    tel: Telemetry
    fab: FabricFit
    kfit: KernelFit | None
    flows: FlowFit | None
    rfit: RoomFit | None
    bench_rows: list | None  # type: ignore[type-arg]  # --compare's rows
    host_share: HostShareFit | None = None
    read: ReadFit | None = None
    layout_note: str | None = None  # --rooms rows that ran a side's ranks in one process


@options(CalibrateOpts)
def calibrate(o: CalibrateOpts) -> None:
    """Fit post cost, per-descriptor cost, bandwidth and latency (and kernel launch cost and rates)
    by non-negative least squares; report the MAPE on transfer sizes held out of the fit."""
    from kvferry.sim.calibrate import profile

    target = _check_calibrate(o)
    fits = _fit(o)
    text = profile.render(
        o.name, fits.fab, fits.tel, [str(p) for p in o.telemetry], fits.kfit, str(o.kernels or ""), fits.rfit,
        [str(p) for p in o.rooms or ()], fits.flows, o.control_handle_us, o.transport,
        [str(p) for p in o.rooms_check or ()], fits.host_share, fits.read,
    )  # fmt: skip
    try:
        target.write_text(text)
    except (OSError, UnicodeError) as e:
        bad_input(f"cannot write {target}: {e}")
    result = _result(o, target, fits)
    if fits.layout_note:  # the per-room costs absorb what the shared process added
        typer.echo(fits.layout_note, err=True)
    preds = _predict_rows(fits.bench_rows, o.name) if fits.bench_rows is not None else None
    if o.as_json:
        if preds is not None:
            result["compare"] = [p.as_dict() for p in preds]
        typer.echo(json.dumps(result))
        return
    _print_fit(fits, o.control_handle_us)
    where = f'--nic {o.name}, [fabric] profile = "{o.name}"' if o.out is None else "not in the profile folder"
    typer.echo(f"wrote {target} ({where})")
    if preds is not None:
        _print_predictions(preds, o.name)


def _check_calibrate(o: CalibrateOpts) -> Path:
    """The options checked before any fit; the file the profile goes to."""
    from kvferry.sim.calibrate import profile
    from kvferry.sim.calibrate.inputs import CalibrationError
    from kvferry.sim.deploy.hardware import TRANSPORTS

    if o.transport not in TRANSPORTS:
        bad_input(f"--transport {o.transport!r}: one of {', '.join(TRANSPORTS)}")
    if o.rooms_check and not o.rooms:
        bad_input("--rooms-check: the held-out check of the per-room fit needs its fit rows (--rooms)")
    if not o.name:
        bad_input("--name is required: the profile's name (e.g. cpu-loopback, h100-nixl)")
    if o.name == DEFAULT_FABRIC:
        bad_input(
            f"--name {o.name}: every scenario without a [fabric] profile runs on it, and a fit must not "
            "change them all silently; pick another name (e.g. h100-nixl)"
        )
    try:
        named = profile.profile_path(o.name)  # checks the name even when --out writes elsewhere
        target = o.out if o.out is not None else named
    except CalibrationError as e:
        bad_input(str(e))
    if o.out is not None:
        check_output_file(o.out, "--out")
        _check_target(o.out, o.name, "--out")
        if o.compare is not None:
            bad_input("--compare simulates the profile by name: drop --out (or run `bench predict` later)")
    else:
        _check_target(target, o.name, "--name")
    return target


def _fit(o: CalibrateOpts) -> _Fits:
    from kvferry.sim.calibrate import fit, inputs
    from kvferry.sim.calibrate.inputs import CalibrationError
    from kvferry.sim.calibrate.posting import fit_flows

    try:
        tel = inputs.read_telemetry(o.telemetry)
        fab = fit.fit_fabric(tel.rows)
        kfit = fit.fit_kernels(inputs.read_kernels(o.kernels)) if o.kernels is not None else None
        flows = fit_flows(o.flow_telemetry, fab.post_cost_us) if o.flow_telemetry else None
        bench_rows = None
        if o.compare is not None:
            from kvferry.sim.calibrate.predict import read_bench

            bench_rows = read_bench(o.compare)
        rfit, host_share, read, note = None, None, None, None
        if o.rooms is not None:
            from kvferry.sim.calibrate.predict import layout_note, read_bench
            from kvferry.sim.calibrate.rooms import fit_rooms

            bench = [row for path in o.rooms for row in read_bench(path)]
            check = [row for path in o.rooms_check or () for row in read_bench(path)]
            note = layout_note(bench + check)
            given = {**_overrides(fab, kfit, flows), "control_handle_ns": round(o.control_handle_us * 1000)}
            # A READ's cost from the pull rows' ms, where no telemetry of READs gave it.
            read = None if _tel_read(flows) else _fit_read(bench, {**given, "control_jitter_ns": 0})
            if read is not None:  # the per-room fit sees the pull rows at their READ cost
                given["read_desc_ns"] = round(read.read_desc_us * 1000)
            rfit = fit_rooms(bench, DEFAULT_FABRIC, given, check=check)
            placed = {**given, "control_jitter_ns": 0, **rfit.overrides()}
            if read is not None:  # again, the per-room costs in place: see readpost.py
                read = _fit_read(bench, placed)
                placed["read_desc_ns"] = round(read.read_desc_us * 1000) if read is not None else 0
            host_share = _fit_host_share(bench, placed)
    except CalibrationError as e:
        bad_input(str(e))
    return _Fits(tel, fab, kfit, flows, rfit, bench_rows, host_share, read, note)


def _tel_read(flows: FlowFit | None) -> bool:
    return flows is not None and flows.read_desc_us is not None


def _fit_read(bench: list, fabric: dict[str, Any]) -> ReadFit | None:  # type: ignore[type-arg]
    """A READ's cost a descriptor, on the fit's pull rows with unequal TP (only --rooms rows)."""
    from kvferry.sim.calibrate.predict import predict
    from kvferry.sim.calibrate.readpost import fit_read_desc

    return fit_read_desc(bench, fabric, lambda row, fab: predict(row, DEFAULT_FABRIC, fab))


def _fit_host_share(bench: list, fabric: dict[str, Any]) -> HostShareFit | None:  # type: ignore[type-arg]
    """The host wire all processes share, on the fit rows with several host writers (only --rooms
    rows: the check rows never enter a fit), the per-room costs in place."""
    from kvferry.sim.calibrate.hostshare import fit_host_share
    from kvferry.sim.calibrate.predict import predict

    return fit_host_share(bench, fabric, lambda row, fab: predict(row, DEFAULT_FABRIC, fab))


def _result(o: CalibrateOpts, target: Path, fits: _Fits) -> dict[str, Any]:
    """The --json report (without --compare's rows)."""
    fab, tel, kfit, rfit = fits.fab, fits.tel, fits.kfit, fits.rfit
    result = {
        "profile": str(target),
        "name": o.name,
        "rows_used": fab.rows_fit,
        "rows_heldout": fab.rows_heldout,
        "rows_failed_dropped": tel.failed,
        "rows_descs_as_requested": tel.requested_descs,
        "rows_wall_clock_timed": tel.wall_timed,
        "sizes_fit_bytes": list(fab.sizes_fit),
        "sizes_heldout_bytes": list(fab.sizes_heldout),
        "mape_heldout_pct": fab.mape_heldout_pct,
        "mape_fit_pct": fab.mape_fit_pct,
        "fabric": {
            "bandwidth_gbps": fab.bandwidth_gbps,
            "latency_us": fab.latency_us,
            "post_cost_us": fab.post_cost_us,
            "per_desc_us": fab.per_desc_us,
        },
        "kernels": None
        if kfit is None
        else {
            "launch_us": kfit.launch_us,
            "launch_source": kfit.launch_source,
            "gpu_gbps": kfit.gpu_gbps,
            "pinned_gbps": kfit.pinned_gbps,
            "rows": kfit.rows,
            "mape_in_sample_pct": kfit.mape_pct,
        },
        "rooms": None if rfit is None else _rooms_result(rfit, o.control_handle_us),
    }
    if fits.flows is not None:
        result["flows"] = fits.flows.as_dict()
    if o.rooms is not None and not _tel_read(fits.flows):  # else under "flows"
        r = fits.read
        result["read"] = None if r is None else {
            "read_desc_us": r.read_desc_us,
            "rows": r.rows,
            "mape_before_pct": r.mape_before_pct,
            "mape_in_sample_pct": r.mape_pct,
        }  # fmt: skip
    if (h := fits.host_share) is not None:
        result["host_share"] = {
            "host_shared_bandwidth_gbps": h.gbps,
            "rows": h.rows,
            "mape_before_pct": h.mape_before_pct,
            "mape_in_sample_pct": h.mape_pct,
        }
    return result


def _rooms_result(rfit: RoomFit, control_handle_us: float) -> dict[str, Any]:
    return {
        "control_latency_us": rfit.control_latency_us,
        "completion_delay_us": rfit.completion_delay_us,
        "copy_submit_us": rfit.copy_submit_us,
        "staging_handle_us": rfit.staging_handle_us,
        "control_send_us": rfit.control_send_us,
        "room_handle_us": rfit.room_handle_us,
        "completion_handle_us": rfit.completion_handle_us,
        "push_handle_us": rfit.push_handle_us,
        "control_handle_us": control_handle_us,
        "rows_used": rfit.rows_fit,
        "rows_heldout": rfit.rows_heldout,
        "tokens_fit": list(rfit.tokens_fit),
        "tokens_heldout": list(rfit.tokens_heldout),
        "mape_heldout_pct": rfit.mape_heldout_pct,
        "mape_fit_pct": rfit.mape_fit_pct,
        "mape_heldout_without_pct": rfit.mape_heldout_without_pct,
    }


def _print_fit(fits: _Fits, control_handle_us: float) -> None:
    fab, tel, kfit, rfit = fits.fab, fits.tel, fits.kfit, fits.rfit
    typer.echo(
        f"fit on {fab.rows_fit} DONE writes of {len(fab.sizes_fit)} sizes ({_mb(fab.sizes_fit)}); "
        f"{tel.failed} failed row(s) dropped, {tel.requested_descs} charged as requested descriptors "
        f"(no NIXL count), {tel.wall_timed} timed by our wall clock (no NIXL duration)"
    )
    typer.echo(
        f"held out of the fit: {fab.rows_heldout} writes of {len(fab.sizes_heldout)} sizes "
        f"({_mb(fab.sizes_heldout)}): MAPE {fab.mape_heldout_pct:.1f}% on them "
        f"({fab.mape_fit_pct:.1f}% on the fit's own rows)"
    )
    typer.echo(
        f"fabric: {fab.bandwidth_gbps:.3f} GB/s, latency {fab.latency_us:.2f} us, "
        f"post {fab.post_cost_us:.1f} us + {fab.per_desc_us:.3f} us per descriptor"
    )
    if kfit is not None:
        rates = ", ".join(
            f"{k} {v:.1f} GB/s" for k, v in (("GPU", kfit.gpu_gbps), ("pinned", kfit.pinned_gbps)) if v
        )
        errs = ", ".join(f"{k} {v:.1f}%" for k, v in kfit.mape_pct.items())
        typer.echo(
            f"kernels ({kfit.rows} rows): launch {kfit.launch_us:.1f} us ({kfit.launch_source}), {rates}; "
            f"MAPE in sample {errs}"
        )
    if fits.flows is not None:
        typer.echo(fits.flows.summary())
    if rfit is not None:
        typer.echo(
            f"per-room control path from {rfit.rows_fit} bench rows ({_tok(rfit.tokens_fit)}): "
            f"control message {rfit.control_latency_us:.1f} us, "
            f"completion delay {rfit.completion_delay_us:.1f} us, "
            f"a copy's host work {rfit.copy_submit_us:.1f} us, "
            f"a staging message's {rfit.staging_handle_us:.1f} us, "
            f"a control message's send {rfit.control_send_us:.1f} us, "
            f"a room's plan {rfit.room_handle_us:.1f} us, a completion's {rfit.completion_handle_us:.1f} us, "
            f"a push registration's {rfit.push_handle_us:.1f} us; "
            f"held out {rfit.rows_heldout} rows ({_tok(rfit.tokens_heldout)}): MAPE of ms per room "
            f"{rfit.mape_heldout_pct:.1f}% ({rfit.mape_heldout_without_pct:.1f}% without these costs; "
            f"{rfit.mape_fit_pct:.1f}% on the fit's own rows)"
        )
    if rfit is not None and not _tel_read(fits.flows):  # else the flows' summary says it
        r = fits.read
        typer.echo(
            "READs: no pull row with unequal TP among --rooms, so a READ costs per_desc a descriptor "
            "(not fitted; no telemetry of READs given)"
            if r is None
            else f"READs: {r.read_desc_us:.3f} us a descriptor ({r.rows} pull rows with unequal TP, their "
            f"ms: MAPE {r.mape_before_pct:.1f}% at the WRITE's cost -> {r.mape_pct:.1f}% in sample; no "
            "telemetry of READs given)"
        )
    if (h := fits.host_share) is not None:
        typer.echo(
            f"host wire every process shares: {h.gbps:.2f} GB/s ({h.rows} pinned rows with several "
            f"prefill ranks: MAPE {h.mape_before_pct:.1f}% -> {h.mape_pct:.1f}% in sample)"
        )


def _tok(tokens: tuple[int, ...]) -> str:
    return ", ".join(str(t) for t in tokens) + " tokens"


def _overrides(
    fab: FabricFit, kfit: KernelFit | None, flows: FlowFit | None = None
) -> dict[str, float | int]:
    """A fit's numbers as a scenario's [fabric] keys, to simulate it before any profile holds it."""
    out: dict[str, float | int] = {
        "bandwidth_gbps": float(fab.bandwidth_gbps),
        "latency_ns": round(fab.latency_us * 1000),
        "post_cost_ns": round(fab.post_cost_us * 1000),
        "per_desc_ns": round(fab.per_desc_us * 1000),
    }
    if flows is not None:
        out.update(flows.overrides())
    if kfit is not None:
        out["kernel_launch_ns"] = round(kfit.launch_us * 1000)
        # float(): the fit's numpy scalars are not numbers to the scenario reader (msgspec)
        if kfit.gpu_gbps is not None:
            out["gpu_copy_gbps"] = float(kfit.gpu_gbps)
        if kfit.pinned_gbps is not None:
            out["pinned_copy_gbps"] = float(kfit.pinned_gbps)
    return out


def _predict_rows(rows: list, profile: str) -> list:  # type: ignore[type-arg]
    from kvferry.sim.calibrate.inputs import CalibrationError
    from kvferry.sim.calibrate.predict import predict as one

    out: list = []  # type: ignore[type-arg]
    so_far = lambda: f"{len(out)} of {len(rows)} bench rows simulated"  # noqa: E731
    try:
        with progress.interrupted_says(so_far), progress.Bar("predict", total=len(rows)) as bar:
            for r in rows:  # each row is a simulated run: seconds for a large room
                out.append(one(r, profile))
                bar.update(len(out))
    except CalibrationError as e:
        bad_input(str(e))
    return out


def _print_predictions(preds: list, profile: str) -> None:  # type: ignore[type-arg]
    typer.echo(f"measured (bench nixl) vs simulated on profile {profile}; ratio = measured / predicted")
    typer.echo(
        "config        flow     tokens  inflight  measured GB/s  predicted GB/s  ratio   raw GB/s"
        "  unexplained ms/batch"
    )
    for p in preds:
        d = p.as_dict()
        typer.echo(
            f"{d['config']:<13} {d['flow']:<8} {d['tokens']:>6}  {d['inflight']:>8}  "
            f"{d['measured_gbps']:>13.3f}  {d['predicted_gbps']:>14.3f}  {d['ratio']:>5.2f}  "
            f"{d['raw_gbps']:>9.3f}  {d['unexplained_ms']:>20.2f}"
        )


def predict(
    bench: Annotated[
        Path, typer.Argument(help="Rows of `kvferry bench nixl --json` (JSON lines, or a list).")
    ],
    profile: Annotated[
        str,
        typer.Option(help="Fabric profile to simulate: a fitted one (kvferry calibrate) or built in."),
    ] = "cpu-loopback",
    held_out_tokens: Annotated[
        str,
        typer.Option(
            help="Room sizes no fit saw, comma-separated (a fitted profile's [fit] room_tokens_heldout): "
            "the per-flow error of those rows is reported apart from the others'."
        ),
    ] = "",
    tp_pairs: Annotated[
        bool, typer.Option("--tp-pairs", help="A group per TP pair (1->1, 2->1, 1->2), not equal/unequal TP.")
    ] = False,
    all_tp: Annotated[
        bool,
        typer.Option(
            "--all-tp",
            help="One group per flow and rooms in flight, every TP pair in it (how the per-flow "
            "target reads the error).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per row.")] = False,
) -> None:
    """Simulate each bench row (TP pair, flow, tokens, rooms in flight) over the simulated fabric
    with a profile, through the real core and flows; print measured vs predicted GB/s."""
    from kvferry.sim import scenario as sc
    from kvferry.sim.calibrate.inputs import CalibrationError
    from kvferry.sim.calibrate.predict import layout_note, read_bench

    known = sc.fabric_profiles()
    if profile not in known:
        bad_input(f"--profile {profile!r}: unknown fabric profile (known: {', '.join(known)})")
    if tp_pairs and all_tp:
        bad_input("--tp-pairs and --all-tp are two groupings of the per-flow table: give one")
    try:
        held = frozenset(int(t) for t in held_out_tokens.split(",") if t.strip())
    except ValueError:
        bad_input(f"--held-out-tokens {held_out_tokens!r}: expected token counts, e.g. 1024,8192")
    try:
        rows = read_bench(bench)
    except CalibrationError as e:
        bad_input(str(e))
    preds = _predict_rows(rows, profile)
    if as_json:
        for p in preds:
            typer.echo(json.dumps({**p.as_dict(), "held_out": p.row.tokens in held}))
        return
    _print_predictions(preds, profile)
    _print_by_flow(preds, held, tp_pairs, all_tp)
    if note := layout_note(rows):
        typer.echo(note, err=True)


def _judged_pct(e: FlowError) -> float:
    """A flow group's error as judged: against its configurations' medians (the same as the
    rows' MAPE where each configuration ran once); a median error of 0 counts as 0."""
    return e.mape_pct if e.median_mape_pct is None else e.median_mape_pct


def _print_by_flow(preds: list, held: frozenset[int], pairs: bool, all_tp: bool) -> None:  # type: ignore[type-arg]
    from kvferry.sim.calibrate.predict import by_flow

    typer.echo("")
    typer.echo("per flow: MAPE of the ms per batch" + (f" (held out: {sorted(held)} tokens)" if held else ""))
    typer.echo("flow       inflight  TP       rows     count  MAPE   spread  MAPE of the medians")
    errs = by_flow(preds, held, pairs, all_tp)
    for e in errs:
        which = "held out" if e.held_out else ("fit" if held else "")
        spread = "-" if e.spread_pct is None else f"{e.spread_pct:5.1f}%"
        medians = "-" if e.spread_pct is None else f"{e.median_mape_pct:5.1f}%"
        typer.echo(
            f"{e.flow:<10} {e.inflight:>8}  {e.tp:<8} {which:<8} {e.rows:>5}  {e.mape_pct:5.1f}%  "
            f"{spread:>6}  {medians:>6}"
        )
    every = [abs(p.predicted_ms - p.measured_ms) / p.measured_ms for p in preds]
    typer.echo(
        f"all {len(every)} rows: MAPE {100 * sum(every) / len(every):.1f}%; "
        f"{sum(e.mape_pct <= 10 for e in errs)} of {len(errs)} groups within 10%, "
        f"{sum(_judged_pct(e) <= 10 for e in errs)}"
        " on the medians of repeated runs"
        " (spread: the largest (max - min) / min of one configuration's repeated rows)"
    )
