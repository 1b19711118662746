"""Writing a fit as a fitted fabric profile (kind ``fabric``) in sim/deploy/profiles/.

The file holds the numbers the simulator reads (sim/deploy/hardware.py) and a ``[fit]`` table
saying where they came from: the input files, the rows used and dropped, the held-out sizes and
the MAPE on them. ``kvferry select --nic NAME`` and a scenario's ``[fabric] profile = NAME`` use it.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

from kvferry.sim.calibrate.fit import FabricFit, KernelFit
from kvferry.sim.calibrate.hostshare import HostShareFit
from kvferry.sim.calibrate.inputs import CalibrationError, Telemetry
from kvferry.sim.calibrate.posting import FlowFit
from kvferry.sim.calibrate.readpost import ReadFit
from kvferry.sim.calibrate.rooms import RoomFit
from kvferry.sim.deploy import hardware

__all__ = ["NAME_RE", "profile_path", "render", "write"]

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def profile_path(name: str) -> Path:
    """Where a profile of this name lives (the installed package's profile folder)."""
    if not NAME_RE.fullmatch(name):
        raise CalibrationError(
            f"--name {name!r}: a profile name is 1-64 characters of a-z, 0-9, - and _, "
            "starting with a letter or digit"
        )
    return Path(str(hardware.folder().joinpath(f"{name}.toml")))


def _s(v: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's (raw UTF-8, so no surrogate-pair escapes)."""
    return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")  # DEL: JSON leaves it raw


def _num(v: float) -> str:
    return f"{v:.6g}" if "e" not in f"{v:.6g}" else repr(float(v))


def render(
    name: str,
    fab: FabricFit,
    tel: Telemetry,
    sources: list[str],
    kernels: KernelFit | None = None,
    kernel_source: str = "",
    rooms: RoomFit | None = None,
    rooms_sources: list[str] | None = None,
    flows: FlowFit | None = None,
    control_handle_us: float = 0.0,
    transport: str = "fitted",
    rooms_check_sources: list[str] | None = None,
    host_share: HostShareFit | None = None,
    read: ReadFit | None = None,
) -> str:
    lines = [
        *_fabric_lines(name, fab, flows, transport),
        *_flow_lines(flows),
        *_read_lines(read, rooms is not None, flows),
        *_kernel_lines(kernels, kernel_source),
        *_room_lines(rooms, control_handle_us),
        *_host_share_lines(host_share),
        "",
        *_fit_table(fab, tel, sources),
        *_fit_rooms(rooms, rooms_sources, rooms_check_sources),
        *_fit_flows(flows),
        *_fit_by_ms("host_share", host_share),
        *_fit_by_ms("read", read),
        *_fit_kernels(kernels),
    ]
    return "\n".join(lines) + "\n"


def _fabric_lines(name: str, fab: FabricFit, flows: FlowFit | None, transport: str) -> list[str]:
    """The header and the fabric's cost model: what every fitted profile has."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    posting = None if flows is None else flows.posting
    return [
        f"# Fitted by `kvferry calibrate` on {when} from NIXL per-write telemetry",
        "# (`kvferry bench nixl --telemetry`); the [fit] table says from which rows and how well.",
        'kind = "fabric"',
        f"name = {_s(name)}",
        f"transport = {_s(transport)}"
        + (
            "  # the telemetry does not name it: --transport cuda_ipc, ib_verbs, efa, tcp or cma"
            if transport == "fitted"
            else ""
        ),
        'post_cost_source = "kvferry calibrate: fitted to NIXL per-write telemetry ([fit] sources)"',
        'per_desc_source = "kvferry calibrate: fitted to NIXL per-write telemetry ([fit] '
        + ('flow_sources)"' if posting is not None else 'sources)"'),
        "# total_us = post_cost_us + per_desc_us * descriptors + bytes / bandwidth + 2 * latency_us,",
        "# non-negative least squares of relative error on the fit sizes (sim/calibrate/fit.py).",
        f"bandwidth_gbps = {_num(fab.bandwidth_gbps)}",
        f"latency_us = {_num(fab.latency_us)}",
        f"post_cost_us = {_num(fab.post_cost_us)}",
        f"per_desc_us = {_num(fab.per_desc_us if posting is None else posting.per_desc_us)}",
    ]


def _flow_lines(flows: FlowFit | None) -> list[str]:
    """The shared posting cost and the pinned flow's host bandwidth, where the flows gave them."""
    lines: list[str] = []
    if flows is not None and flows.posting is not None:
        lines += [
            "# Descriptor-bound writes (one descriptor per token and layer) of one process alone and of",
            "# several at once on the same GPU, from the telemetry in [fit] flow_sources",
            "# (sim/calibrate/posting.py): per_desc_us above is one process's cost a descriptor,",
            "# shared_desc_us the GPU's that all posting processes share (k at once: max(per_desc,",
            "# k * shared_desc) each).",
            f"shared_desc_us = {_num(flows.posting.shared_desc_us)}",
        ]
    if flows is not None and flows.host_gbps is not None:
        lines += [
            "# The pinned flow's host-to-host writes (UCX cma), from the same telemetry.",
            f"host_bandwidth_gbps = {_num(flows.host_gbps)}",
        ]
    return lines


def _read_lines(read: ReadFit | None, had_rooms: bool, flows: FlowFit | None) -> list[str]:
    """A READ's own cost a descriptor, from READ telemetry or pull rows; else why READs cost
    per_desc_us."""
    if flows is not None and flows.read_desc_us is not None:
        return [
            "# A READ's cost a descriptor (pull: decode posts them), from the pull rooms' READs in",
            "# [fit] flow_sources (sim/calibrate/posting.py), the shared GPU's cost as above.",
            f"read_desc_us = {_num(flows.read_desc_us)}",
        ]
    if read is None:
        why = "no pull row with unequal TP in --rooms" if had_rooms else "no bench rows (--rooms)"
        return [f"# READs cost per_desc_us a descriptor: not fitted ({why}; sim/calibrate/readpost.py)."]
    return [
        "# A READ's cost a descriptor (pull: decode posts them), fitted to the ms of the [fit]",
        "# room_sources' pull rows with unequal TP (sim/calibrate/readpost.py): no telemetry of",
        "# READs given (`kvferry bench nixl --telemetry` records them since 2026-12-02).",
        f"read_desc_us = {_num(read.read_desc_us)}",
    ]


def _kernel_lines(kernels: KernelFit | None, kernel_source: str) -> list[str]:
    if kernels is None:
        return ["# No kernel bench given: the GPU profile's copy kernels apply."]
    lines = [
        f"# Copy kernels from {kernel_source}: seconds = launch + bytes / rate per memory kind.",
        f"# Launch cost: {kernels.launch_source}.",
        # the bare launch, on the stream; with --rooms the runtime's host work per copy is fitted below
        f"kernel_launch_us = {_num(kernels.launch_us)}",
    ]
    if kernels.gpu_gbps is not None:
        lines.append(f"copy_gpu_gbps = {_num(kernels.gpu_gbps)}")
    if kernels.pinned_gbps is not None:
        lines.append(f"copy_pinned_gbps = {_num(kernels.pinned_gbps)}")
    return lines


def _room_lines(rooms: RoomFit | None, control_handle_us: float) -> list[str]:
    """The runtime's per-room control path: fitted (--rooms) and given (--control-handle-us)."""
    if rooms is not None:
        lines = [
            "# The runtime's per-room control path, fitted to the ms per room of the bench rows in",
            "# [fit] room_sources (sim/calibrate/rooms.py): one control message's latency, the",
            "# delay before a notification or completion is handled, and the host work that holds",
            "# a rank's runtime thread: each gather or scatter's submit and completion pickup, each",
            "# staging message (StagingReq, StagingRsp, Watermark) handled, each control message sent,",
            "# each TransferInfo or PullOffer handled (the room's plan), each notification or DONE handled,",
            "# and the push flow's extra per registration (a push room's TransferInfo).",
            f"control_latency_us = {_num(rooms.control_latency_us)}",
            f"completion_delay_us = {_num(rooms.completion_delay_us)}",
            f"copy_submit_us = {_num(rooms.copy_submit_us)}",
            f"staging_handle_us = {_num(rooms.staging_handle_us)}",
            f"control_send_us = {_num(rooms.control_send_us)}",
            f"room_handle_us = {_num(rooms.room_handle_us)}",
            f"completion_handle_us = {_num(rooms.completion_handle_us)}",
            f"push_handle_us = {_num(rooms.push_handle_us)}",
        ]
    else:
        lines = ["# No bench rows given (--rooms): no per-room control path, the fabric's defaults."]
    if control_handle_us:
        lines += [
            "# Given, not fitted (kvferry calibrate --control-handle-us): a control thread holds",
            "# each message this long (measured: the control plane over the ZMQ under it).",
            f"control_handle_us = {_num(control_handle_us)}",
        ]
    return lines


def _host_share_lines(host_share: HostShareFit | None) -> list[str]:
    if host_share is None:
        return []
    return [
        "# The host wire every process's host-to-host writes share (UCX cma copies through one",
        "# host's memory), fitted to the ms of the [fit] room_sources' pinned rows with several",
        "# prefill ranks (sim/calibrate/hostshare.py), the per-room costs above in place.",
        f"host_shared_bandwidth_gbps = {_num(host_share.gbps)}",
    ]


def _fit_by_ms(prefix: str, fit: HostShareFit | ReadFit | None) -> list[str]:
    """The [fit] rows of a cost fitted to bench rows' ms (hostshare.py, readpost.py)."""
    if fit is None:
        return []
    return [
        f"{prefix}_rows = {fit.rows}",
        f"{prefix}_mape_before_pct = {fit.mape_before_pct:.2f}",
        f"{prefix}_mape_in_sample_pct = {fit.mape_pct:.2f}",
    ]


def _fit_table(fab: FabricFit, tel: Telemetry, sources: list[str]) -> list[str]:
    """The [fit] table's fabric rows: the input files, the rows used and dropped, the MAPEs."""
    return [
        "[fit]",
        f"sources = [{', '.join(_s(s) for s in sources)}]",
        f"rows_used = {fab.rows_fit}",
        f"rows_heldout = {fab.rows_heldout}",
        f"rows_failed_dropped = {tel.failed}",
        f"rows_descs_as_requested = {tel.requested_descs}",
        f"rows_wall_clock_timed = {tel.wall_timed}",
        f"sizes_fit_bytes = [{', '.join(str(s) for s in fab.sizes_fit)}]",
        f"sizes_heldout_bytes = [{', '.join(str(s) for s in fab.sizes_heldout)}]",
        f"mape_fit_pct = {fab.mape_fit_pct:.2f}",
        f"mape_heldout_pct = {fab.mape_heldout_pct:.2f}",
    ]


def _fit_rooms(rooms: RoomFit | None, rooms_sources: list[str] | None, check: list[str] | None) -> list[str]:
    if rooms is None:
        return []
    # --rooms-check: the held-out rows are those files' (no room size of the fit files held out)
    checked = [f"room_check_sources = [{', '.join(_s(s) for s in check)}]"] if check else []
    return [
        f"room_sources = [{', '.join(_s(s) for s in rooms_sources or ())}]",
        *checked,
        f"room_rows_used = {rooms.rows_fit}",
        f"room_rows_heldout = {rooms.rows_heldout}",
        f"room_tokens_fit = [{', '.join(str(t) for t in rooms.tokens_fit)}]",
        f"room_tokens_heldout = [{', '.join(str(t) for t in rooms.tokens_heldout)}]",
        f"room_mape_fit_pct = {rooms.mape_fit_pct:.2f}",
        f"room_mape_heldout_pct = {rooms.mape_heldout_pct:.2f}",
        f"room_mape_heldout_without_pct = {rooms.mape_heldout_without_pct:.2f}",
    ]


def _fit_flows(flows: FlowFit | None) -> list[str]:
    if flows is None:
        return []
    posting = flows.posting
    lines = [
        f"flow_sources = [{', '.join(_s(s) for s in flows.sources)}]",
        f"posting_rows = {0 if posting is None else posting.rows}",
        f"host_rows = {flows.host_rows}",
    ]
    if posting is not None:
        lines.append(f"posting_mape_in_sample_pct = {posting.mape_pct:.2f}")
    if flows.host_gbps is not None:
        lines.append(f"host_mape_in_sample_pct = {flows.host_mape_pct:.2f}")
    if flows.read_desc_us is not None:
        lines += [f"read_rows = {flows.read_rows}", f"read_mape_in_sample_pct = {flows.read_mape_pct:.2f}"]
    return lines


def _fit_kernels(kernels: KernelFit | None) -> list[str]:
    if kernels is None:
        return []
    return [
        f"kernel_rows = {kernels.rows}",
        *(f"kernel_{k}_mape_in_sample_pct = {v:.2f}" for k, v in kernels.mape_pct.items()),
    ]


def write(path: Path, text: str) -> None:
    path.write_text(text)
