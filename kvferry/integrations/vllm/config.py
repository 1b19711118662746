"""kvferry's settings inside vLLM: ``kv_transfer_config.kv_connector_extra_config``, checked here.

vLLM hands the connector one free-form dict; a typo there would otherwise be ignored silently, so
every key is known, typed and bounded, and a bad one raises ``ValueError`` naming it. No vLLM
import: the checks run (and are tested) without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvferry.backends.runtime import RuntimeConfig
from kvferry.backends.runtime.base import MAX_LATE_WRITE_S
from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.deadlines import SEC, Timeouts

__all__ = ["FLOWS", "KNOBS", "ConnectorSettings", "parse_extra_config"]

# key -> (type, default, one line for the docs and the error message)
KNOBS: dict[str, tuple[type, Any, str]] = {
    "server": (str, "", "this instance's name on the control plane (default: vLLM's engine_id)"),
    "host": (str, "127.0.0.1", "address the control plane binds and advertises to peers"),
    "port": (int, 0, "control-plane port of TP rank 0 (rank r uses port + r; 0: any free port)"),
    "control_key_file": (str, "", "file holding the control-plane key (else $KVFERRY_CONTROL_KEY[_FILE])"),
    "control_insecure": (bool, False, "allow an unauthenticated control plane (tests on one host only)"),
    "num_queues": (int, 4, "prefill transfer worker threads per rank"),
    "worker_chunks_in_flight": (int, 1, "chunks a prefill worker keeps in flight before waiting"),
    "aux_rows": (int, 1024, "rooms a rank can have open at once (one aux row each)"),
    "bootstrap_timeout_s": (float, 30.0, "prefill waits this long for decode to ask for a request's KV"),
    "transfer_timeout_s": (float, 60.0, "a room's transfer must finish within this"),
    "heartbeat_timeout_s": (float, 10.0, "a peer silent this long is lost; its rooms fail"),
    "fence_timeout_s": (
        float,
        180.0,
        "decode frees a failed room's blocks without prefill's word after this",
    ),
    # Writes a lost peer may still deliver (UCX over TCP lands them after a partition heals):
    # RuntimeConfig's two bounds, None deriving them from fence_timeout_s.
    "write_quarantine_s": (
        float,
        None,
        "decode: how long past the fence a failed room's blocks wait for every writer's word "
        "(default fence_timeout_s)",
    ),
    "lost_peer_drain_s": (
        float,
        None,
        "how long a lost peer's transfers are kept until they end (default fence + quarantine)",
    ),
    "metrics": (bool, False, "Prometheus metrics of the kvferry endpoints (extra 'metrics')"),
    "flow": (
        str,
        "direct",
        "prefill's transfer flow: direct, pull, push, ring, pinned or layerwise (a request may override it)",
    ),
    "nixl_engine": (str, "python", "who executes NIXL's transfers: python or native (backends/native)"),
    # Staging memory (bytes, 0: none), taken from the KV cache's device: only the staged flows use it.
    "worker_buffer_bytes": (int, 0, "prefill: each transfer worker's gather buffer (the ring flow)"),
    "prefill_pinned_bytes": (int, 0, "prefill: the pinned host pool the pinned flow gathers into"),
    "ring_bytes": (int, 0, "decode: the staging ring the ring flow writes into"),
    "pinned_bytes": (int, 0, "decode: the pinned host pool the pinned flow writes into"),
}
STAGING_BYTES = ("worker_buffer_bytes", "prefill_pinned_bytes", "ring_bytes", "pinned_bytes")
# Inclusive bounds of the late-write settings (RuntimeConfig's own): a quarantine may be 0 (blocks
# freed at the fence deadline), a drain may not (a lost peer's transfers are kept a moment at least).
LATE_WRITE_RANGES = {
    "write_quarantine_s": (0.0, MAX_LATE_WRITE_S),
    "lost_peer_drain_s": (1e-3, MAX_LATE_WRITE_S),
}
# What prefill's own staging needs for each staged flow (decode's side is checked when its room opens:
# a decode rank that registered no ring or pinned region fails the room, and vLLM recomputes it).
FLOW_NEEDS = {"ring": "worker_buffer_bytes", "pinned": "prefill_pinned_bytes"}

# Every flow fits vLLM's life cycle (docs/vllm.md): ring and pinned with staging sizes given,
# layerwise with vLLM's attention layers calling save_kv_layer.
FLOWS = ("direct", "pull", "push", "ring", "pinned", "layerwise")
CHOICES: dict[str, tuple[str, ...]] = {"flow": FLOWS, "nixl_engine": ("python", "native")}


@dataclass(frozen=True)
class ConnectorSettings:
    server: str
    host: str
    port: int
    control_key_file: str
    control_insecure: bool
    num_queues: int
    worker_chunks_in_flight: int
    aux_rows: int
    bootstrap_timeout_s: float
    transfer_timeout_s: float
    heartbeat_timeout_s: float
    fence_timeout_s: float
    write_quarantine_s: float | None
    lost_peer_drain_s: float | None
    metrics: bool
    flow: str
    nixl_engine: str
    worker_buffer_bytes: int
    prefill_pinned_bytes: int
    ring_bytes: int
    pinned_bytes: int

    def runnable_flows(self) -> tuple[str, ...]:
        """The flows this server can send by (a staged flow needs its prefill staging memory)."""
        return tuple(f for f in FLOWS if f not in FLOW_NEEDS or getattr(self, FLOW_NEEDS[f]))

    def runtime_config(self, tp_rank: int) -> RuntimeConfig:
        base = Timeouts()
        timeouts = Timeouts(
            bootstrap_ns=int(self.bootstrap_timeout_s * SEC),
            waiting_ns=max(base.waiting_ns, int(self.bootstrap_timeout_s * SEC)),
            transfer_ns=int(self.transfer_timeout_s * SEC),
            heartbeat_interval_ns=min(base.heartbeat_interval_ns, int(self.heartbeat_timeout_s * SEC) // 4),
            heartbeat_timeout_ns=int(self.heartbeat_timeout_s * SEC),
            fence_ns=int(self.fence_timeout_s * SEC),
            tombstone_ns=max(base.tombstone_ns, int(self.fence_timeout_s * SEC)),
        )
        return RuntimeConfig(
            num_queues=self.num_queues,
            worker_chunks_in_flight=self.worker_chunks_in_flight,
            timeouts=timeouts,
            write_quarantine_s=self.write_quarantine_s,
            lost_peer_drain_s=self.lost_peer_drain_s,
            aux_rows=self.aux_rows,
            host=self.host,
            port=self.port + tp_rank if self.port else 0,
            control_key_file=self.control_key_file,
            control_insecure=self.control_insecure,
            metrics=self.metrics,
            nixl_engine=self.nixl_engine,
            # Only the staging memory asked for: the runtime's defaults (a 1 GiB ring per decode
            # endpoint, 256 MiB per prefill queue, in the pool's device memory) would take GPU
            # memory from vLLM's KV cache for flows a server may never run.
            staging=StagingConfig(
                worker_buffer_bytes=self.worker_buffer_bytes,
                prefill_pinned_bytes=self.prefill_pinned_bytes,
                ring_bytes=self.ring_bytes,
                pinned_bytes=self.pinned_bytes,
            ),
        )


def _check(key: str, value: Any) -> Any:
    kind, default, what = KNOBS[key]
    if value is None and default is None:  # null: derived, as when the key is left out
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(
            f"kv_connector_extra_config[{key!r}]: expected {kind.__name__}, got {value!r} ({what})"
        )
    if key in LATE_WRITE_RANGES:
        low, high = LATE_WRITE_RANGES[key]
        if not low <= value <= high:  # NaN fails too
            raise ValueError(
                f"kv_connector_extra_config[{key!r}]: must be in [{low:g}, {high:g}] s, "
                f"got {value!r} ({what})"
            )
    elif key in STAGING_BYTES:
        if not 0 <= value < 1 << 44:
            raise ValueError(
                f"kv_connector_extra_config[{key!r}]: must be in [0, 2**44), got {value!r} ({what})"
            )
    elif kind in (int, float) and key != "port" and value <= 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}]: must be > 0, got {value!r} ({what})")
    if key in CHOICES and value not in CHOICES[key]:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}]: expected one of {', '.join(CHOICES[key])}, got {value!r}"
        )
    if key == "port" and not 0 <= value < 65536:
        raise ValueError(f"kv_connector_extra_config['port']: must be in [0, 65535], got {value!r}")
    return value


def parse_extra_config(extra: Mapping[str, Any] | None, engine_id: str) -> ConnectorSettings:
    """The connector's settings from vLLM's ``kv_connector_extra_config``; unknown keys and values
    of the wrong type or range raise ``ValueError`` naming the key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KNOBS))
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(KNOBS))})"
        )
    values = {key: _check(key, extra[key]) if key in extra else KNOBS[key][1] for key in KNOBS}
    values["server"] = values["server"] or engine_id
    needs = FLOW_NEEDS.get(values["flow"])
    if needs and not values[needs]:
        raise ValueError(
            f"kv_connector_extra_config[{needs!r}]: flow {values['flow']!r} needs it > 0 ({KNOBS[needs][2]})"
        )
    if not values["server"]:
        raise ValueError("kv_connector_extra_config['server']: empty, and vLLM gave no engine_id")
    assert {f.name for f in fields(ConnectorSettings)} == set(KNOBS)
    return ConnectorSettings(**values)
