"""Hardware profiles: GPUs and NICs as data files (sim/deploy/profiles/*.toml, each number sourced
in a comment there), and the simulated fabric they make.

A profile fitted to this machine's own telemetry (``kvferry calibrate``: NIXL posting and kernel
figures) would be one more file here; that command is another engineer's work and not built yet.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import Any

from kvferry.backends.simfabric.spec import FabricSpec, KernelSpec, NicSpec
from kvferry.core.errors import KvferryError

__all__ = ["GpuProfile", "NicProfile", "ProfileError", "fabric_spec", "gpu", "names", "nic"]


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


def names(kind: str) -> tuple[str, ...]:
    """The shipped profiles of one kind ("gpu" or "nic")."""
    return tuple(sorted(f[:-5] for f in _files() if _read(f[:-5]).get("kind") == kind))


def _read(name: str) -> dict[str, Any]:
    ok = bool(name) and name.replace("-", "").replace("_", "").isalnum() and name.isascii()
    entry = resources.files("kvferry.sim.deploy").joinpath("profiles", f"{name}.toml")
    if not ok or not entry.is_file():
        known = ", ".join(n[:-5] for n in sorted(_files()))
        raise ProfileError(f"unknown hardware profile {name!r} (known: {known})")
    try:
        return tomllib.loads(entry.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"profile {name}: not valid TOML: {e}") from None


def _files() -> list[str]:
    folder = resources.files("kvferry.sim.deploy").joinpath("profiles")
    return [e.name for e in folder.iterdir() if e.name.endswith(".toml")]


def _load(name: str, kind: str, cls: type) -> Any:
    data = _read(name)
    if data.get("kind") != kind:
        known = ", ".join(names(kind))
        raise ProfileError(f"{name!r} is not a {kind} profile (known: {known})")
    want = {f.name for f in fields(cls)}
    missing, extra = want - set(data), set(data) - want - {"kind"}
    if missing or extra:
        raise ProfileError(f"profile {name}: missing {sorted(missing)}, unknown {sorted(extra)}")
    for k, v in data.items():
        if k not in ("kind", "name") and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0):
            raise ProfileError(f"profile {name}: {k} must be a positive number, got {v!r}")
    return cls(**{k: (float(v) if k != "name" else v) for k, v in data.items() if k != "kind"})


def gpu(name: str) -> GpuProfile:
    return _load(name, "gpu", GpuProfile)


def nic(name: str) -> NicProfile:
    return _load(name, "nic", NicProfile)


def fabric_spec(g: GpuProfile, n: NicProfile) -> FabricSpec:
    """The simulated fabric of one GPU + NIC per rank (control plane and the rest as h100-rdma)."""
    base = FabricSpec()
    return replace(
        base,
        nic=replace(
            NicSpec(),
            bandwidth_bps=int(n.bandwidth_gbps * 1e9),
            latency_ns=int(n.latency_us * 1000),
            post_cost_ns=int(n.post_cost_us * 1000),
            per_desc_ns=int(n.per_desc_us * 1000),
            # A deployment's transfers are long; an ERR must not beat a healthy write (assumption).
            error_timeout_ns=2_000_000_000,
        ),
        kernel=replace(
            KernelSpec(),
            launch_ns=int(g.kernel_launch_us * 1000),
            gpu_bps=int(g.copy_gpu_gbps * 1e9),
            pinned_bps=int(g.copy_pinned_gbps * 1e9),
        ),
    )
