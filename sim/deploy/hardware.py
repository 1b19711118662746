"""Hardware profiles: GPUs and NICs as data files (sim/deploy/profiles/*.toml, each number sourced
in a comment there), and the simulated fabric they make.

A profile fitted to a machine's own telemetry (``kvferry calibrate``: NIXL posting and wire
figures, and the copy kernels when their bench was given) is one more file here, of kind
``fabric``: it serves wherever a NIC profile does (``--nic NAME``), its kernel figures replace the
GPU profile's in the simulated fabric, and scenarios name it as ``[fabric] profile``.
"""

from __future__ import annotations

import copy
import functools
import math
import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from kvferry.backends.simfabric.spec import FabricSpec, KernelSpec, NicSpec
from kvferry.core.errors import KvferryError

__all__ = [
    "TRANSPORTS",
    "GpuProfile",
    "NicProfile",
    "ProfileError",
    "fabric_spec",
    "fitted",
    "gpu",
    "names",
    "nic",
]


class ProfileError(KvferryError, ValueError):
    """An unknown or malformed hardware profile."""


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    bf16_tflops: float
    hbm_tbps: float
    hbm_gb: float
    pcie_gbps: float
    copy_gpu_gbps: float
    copy_pinned_gbps: float
    kernel_launch_us: float
    flops_efficiency: float
    hbm_efficiency: float
    prefill_step_overhead_us: float
    decode_step_overhead_us: float
    memory_fraction: float

    @property
    def flops(self) -> float:
        """Achieved BF16 FLOP/s."""
        return self.bf16_tflops * 1e12 * self.flops_efficiency

    @property
    def hbm_bps(self) -> float:
        """Achieved HBM bytes/s."""
        return self.hbm_tbps * 1e12 * self.hbm_efficiency


@dataclass(frozen=True, slots=True)
class NicProfile:
    name: str
    bandwidth_gbps: float
    latency_us: float
    post_cost_us: float
    per_desc_us: float
    # A READ's cost a descriptor where a fit found one of its own (NicSpec.read_desc_ns); absent:
    # READs cost per_desc_us.
    read_desc_us: float | None = None
    # Only in fitted (kind "fabric") profiles, and only when the kernel bench was fitted too.
    kernel_launch_us: float | None = None
    copy_gpu_gbps: float | None = None
    copy_pinned_gbps: float | None = None
    # The runtime's per-room control path (``kvferry calibrate --rooms``): one control message's
    # latency through the runtime (threads, ZMQ, engine) and the delay before a notification or
    # completion is handled (the data thread's next poll). Absent: the fabric's ideal defaults.
    control_latency_us: float | None = None
    completion_delay_us: float | None = None
    # Measured with every rank on one GPU (kvferry calibrate): a descriptor's cost on that shared
    # GPU and the wire between pinned host buffers (UCX cma); and, given rather than fitted, how long
    # a control thread holds each message (ControlSpec.handle_ns).
    # A scenario naming the profile charges them, shared as its `[fabric] one_gpu` places the ranks
    # (every rank on one GPU, as measured, or a GPU each and a host per server); a deployment
    # (``select --nic``, fabric_spec) does not: its ranks have a GPU each, and its pinned flow keeps
    # the NIC's wire.
    shared_desc_us: float | None = None
    control_handle_us: float | None = None
    # The staged flows' host work per staging message (ControlSpec.staging_handle_ns), fitted by
    # ``kvferry calibrate --rooms`` from staged rows; a deployment charges it like the control path.
    staging_handle_us: float | None = None
    # The runtime's host work per gather or scatter on the rank's thread (KernelSpec.submit_ns).
    copy_submit_us: float | None = None
    # The sender's host work per control message on the rank's thread (ControlSpec.send_ns).
    control_send_us: float | None = None
    # A rank's host work per room planned (TransferInfo or PullOffer) and per notification or DONE,
    # on its runtime thread (NicSpec.room_handle_ns, completion_handle_ns); a deployment charges them.
    room_handle_us: float | None = None
    completion_handle_us: float | None = None
    # The push flow's extra host work per registration taken (NicSpec.push_handle_ns).
    push_handle_us: float | None = None
    host_bandwidth_gbps: float | None = None
    # The host wire all initiators share (NicSpec.host_shared_bandwidth_bps), fitted from bench
    # rows with several prefill ranks writing host to host at once.
    host_shared_bandwidth_gbps: float | None = None
    # What moves the bytes (TRANSPORTS), where the two posting costs come from, and which of the
    # profile's numbers are estimates rather than measurements.
    transport: str = "unstated"
    post_cost_source: str = ""
    per_desc_source: str = ""
    estimates: tuple[str, ...] = ()


# The transports a profile may name: NIXL over UCX's cuda_ipc (GPUs of one host, over NVLink),
# InfiniBand or RoCE verbs (UCX rc_x), AWS EFA (libfabric), TCP, UCX's CMA copies between
# processes of one host (CPU memory), and "fitted" for a fit whose transport the telemetry does
# not name.
TRANSPORTS = ("cuda_ipc", "ib_verbs", "efa", "tcp", "cma", "fitted", "unstated")
_TEXT = frozenset({"name", "transport", "post_cost_source", "per_desc_source"})


def names(kind: str) -> tuple[str, ...]:
    """The shipped profiles of one kind ("gpu" or "nic")."""
    where = folder()  # resolved once: it costs more than reading a profile
    return tuple(sorted(f[:-5] for f in _files(where) if _read(f[:-5], where).get("kind") == kind))


def _read(name: str, where: Traversable | None = None) -> dict[str, Any]:
    ok = bool(name) and name.replace("-", "").replace("_", "").isalnum() and name.isascii()
    where = where or folder()
    entry = where.joinpath(f"{name}.toml")
    if not ok or not entry.is_file():
        known = ", ".join(n[:-5] for n in sorted(_files(where)))
        raise ProfileError(f"unknown hardware profile {name!r} (known: {known})")
    try:
        return copy.deepcopy(_parse(entry.read_text()))  # a caller may change what it was given
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"profile {name}: not valid TOML: {e}") from None


# Every scenario parse lists the fabric profiles (reading each file), and a calibration parses
# thousands of scenarios: the parse is cached by the file's text, so an edited file reads anew.
@functools.lru_cache(maxsize=256)
def _parse(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


def folder() -> Traversable:
    """The profile folder (``kvferry calibrate`` writes fitted profiles here)."""
    return resources.files("kvferry.sim.deploy").joinpath("profiles")


def _files(where: Traversable | None = None) -> list[str]:
    return [e.name for e in (where or folder()).iterdir() if e.name.endswith(".toml")]


# Costs a fit may find to be nil (a fitted profile may hold 0 for them); every rate stays positive.
_MAY_BE_ZERO = frozenset(
    {"latency_us", "post_cost_us", "per_desc_us", "read_desc_us", "kernel_launch_us"}
    | {"control_latency_us", "completion_delay_us", "shared_desc_us"}
    | {"control_handle_us", "staging_handle_us", "copy_submit_us", "control_send_us"}
    | {"room_handle_us", "completion_handle_us", "push_handle_us"}
)
# Kinds a loader accepts: a fitted fabric profile serves as a NIC profile.
_KINDS = {"gpu": ("gpu",), "nic": ("nic", "fabric"), "fabric": ("fabric",)}


def _load(name: str, kind: str, cls: type) -> Any:
    data = _read(name)
    if data.get("kind") not in _KINDS[kind]:
        known = ", ".join(sorted({n for k in _KINDS[kind] for n in names(k)}))
        raise ProfileError(f"{name!r} is not a {kind} profile (known: {known})")
    data = {k: v for k, v in data.items() if k != "fit"}  # a fitted profile's provenance table
    want = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING}
    missing, extra = required - set(data), set(data) - want - {"kind"}
    if missing or extra:
        raise ProfileError(f"profile {name}: missing {sorted(missing)}, unknown {sorted(extra)}")
    for k, v in data.items():
        if k == "kind":
            continue
        if k in _TEXT:
            if not isinstance(v, str):
                raise ProfileError(f"profile {name}: {k} must be a string, got {v!r}")
            if k == "transport" and v not in TRANSPORTS:
                raise ProfileError(
                    f"profile {name}: transport must be one of {', '.join(TRANSPORTS)}, got {v!r}"
                )
            continue
        if k == "estimates":
            if not isinstance(v, list) or any(x not in want for x in v):
                raise ProfileError(f"profile {name}: estimates must list the profile's own fields, got {v!r}")
            continue
        low = 0 if k in _MAY_BE_ZERO else None
        bad = isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
        if bad or v < 0 or (low is None and v == 0):
            what = "a number >= 0" if low is not None else "a positive number"
            raise ProfileError(f"profile {name}: {k} must be {what}, got {v!r}")
    out = {k: (float(v) if k not in _TEXT else v) for k, v in data.items() if k not in ("kind", "estimates")}
    if "estimates" in data:
        out["estimates"] = tuple(data["estimates"])
    return cls(**out)


def gpu(name: str) -> GpuProfile:
    return _load(name, "gpu", GpuProfile)


def nic(name: str) -> NicProfile:
    """A NIC profile, or a fitted fabric profile (``kvferry calibrate``) read as one."""
    return _load(name, "nic", NicProfile)


def fitted(name: str) -> NicProfile:
    """A fitted fabric profile only (what ``[fabric] profile`` of a scenario may name)."""
    return _load(name, "fabric", NicProfile)


def fabric_spec(g: GpuProfile, n: NicProfile) -> FabricSpec:
    """The simulated fabric of one GPU + NIC per rank (control plane and the rest as h100-rdma);
    a fitted profile's kernel figures, where it has them, replace the GPU profile's."""
    base = FabricSpec()
    launch = g.kernel_launch_us if n.kernel_launch_us is None else n.kernel_launch_us
    gpu_gbps = g.copy_gpu_gbps if n.copy_gpu_gbps is None else n.copy_gpu_gbps
    pinned_gbps = g.copy_pinned_gbps if n.copy_pinned_gbps is None else n.copy_pinned_gbps
    return replace(
        base,
        nic=replace(
            NicSpec(),
            bandwidth_bps=int(n.bandwidth_gbps * 1e9),
            latency_ns=int(n.latency_us * 1000),
            post_cost_ns=int(n.post_cost_us * 1000),
            per_desc_ns=int(n.per_desc_us * 1000),
            read_desc_ns=0 if n.read_desc_us is None else round(n.read_desc_us * 1000),
            completion_delay_ns=0 if n.completion_delay_us is None else round(n.completion_delay_us * 1000),
            room_handle_ns=0 if n.room_handle_us is None else round(n.room_handle_us * 1000),
            completion_handle_ns=0
            if n.completion_handle_us is None
            else round(n.completion_handle_us * 1000),
            push_handle_ns=0 if n.push_handle_us is None else round(n.push_handle_us * 1000),
            # A deployment's transfers are long; an ERR must not beat a healthy write (assumption).
            error_timeout_ns=2_000_000_000,
        ),
        control=replace(
            base.control,
            latency_ns=base.control.latency_ns
            if n.control_latency_us is None
            else round(n.control_latency_us * 1000),
            # Per-rank host work of the runtime, not the shared GPU: a deployment pays it too.
            staging_handle_ns=0 if n.staging_handle_us is None else round(n.staging_handle_us * 1000),
            send_ns=0 if n.control_send_us is None else round(n.control_send_us * 1000),
        ),
        kernel=replace(
            KernelSpec(),
            launch_ns=int(launch * 1000),
            submit_ns=0 if n.copy_submit_us is None else round(n.copy_submit_us * 1000),
            gpu_bps=int(gpu_gbps * 1e9),
            pinned_bps=int(pinned_gbps * 1e9),
        ),
    )
