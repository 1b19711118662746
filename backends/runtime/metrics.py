"""Prometheus metrics of one endpoint (optional extra ``metrics``: prometheus-client).

On with ``RuntimeConfig(metrics=True)``; ``metrics_port`` >= 0 also serves them over HTTP
(0: a free port, see ``EndpointMetrics.port``). Each endpoint has its own registry, so several
endpoints in one process do not collide; every series carries ``server``, ``rank``, ``role``.

Two sources, so the runtime needs only two hooks (``attach`` at start, ``on_status`` from the
driver's status callback, lock held):
- events: rooms by outcome and failure reason (a bounded set of reasons, ``reason_class``) and
  each room's latency from its first status to its terminal one, per flow; and every NIXL transfer
  as it completes (the agent's telemetry is tapped), its latency per flow and op;
- state read at scrape time: bytes and descriptors posted (NIXL telemetry totals), the engine's
  counters (chunk deferrals, failure notices resent and given up) and staging occupancy (ring and
  pinned pools) read under the endpoint lock, frames the control plane rejected by reason.
The ``flow`` label is the room's flow as its ledger records it (direct, ring, pinned, pull, push).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from kvferry.core.flows.staged_receiver import StagedReceiver
from kvferry.core.kvpoll import KVPoll

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("metrics need prometheus-client: pip install 'kvferry[metrics]'") from exc

__all__ = ["EndpointMetrics", "attach", "reason_class"]

_LAT_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# (substring of the core's reason, label): first match wins; anything else is "other", so a
# peer cannot grow the label set with the reasons it sends.
_REASONS = (
    ("after release", "failed_after_release"),
    ("failed on ", "peer_failed"),  # the peer's own reason follows: not ours to classify
    ("aborted", "aborted"),
    ("timed out", "timeout"),
    ("registration refused", "refused"),
    ("stopped sending", "peer_stopped"),
    ("(no heartbeat)", "peer_lost"),
    ("node down", "peer_lost"),
    ("scatter failed", "copy_failed"),
    ("RoomError", "remote_violation"),
    ("RoomStateError", "local_state"),
    ("Nixl", "transfer_error"),
    ("ERR", "transfer_error"),
)
_NOTICES = {  # engine counter -> (kind, resent or gave_up)
    "failure_resent": ("room_failed", "resent"),
    "failure_notice_gave_up": ("room_failed", "gave_up"),
    "abort_resent": ("abort", "resent"),
    "info_resent": ("transfer_info", "resent"),
    "staged_note_resent": ("staged_note", "resent"),
    "staged_note_gave_up": ("staged_note", "gave_up"),
}


def reason_class(reason: str) -> str:
    """A room failure's reason as one of a fixed set of labels."""
    for needle, label in _REASONS:
        if needle in reason:
            return label
    return "other"


class EndpointMetrics:
    """The metrics of one endpoint; ``close()`` stops its exporter."""

    def __init__(self, endpoint: Any, port: int = -1, host: str = "127.0.0.1") -> None:
        self.ep = endpoint
        self.registry = CollectorRegistry(auto_describe=True)
        names = ("server", "rank", "role")
        self._labels = {
            "server": endpoint.endpoint.server,
            "rank": str(endpoint.endpoint.rank),
            "role": endpoint.role,
        }
        r = self.registry
        self.rooms = Counter(
            "kvferry_rooms", "Rooms ended on this rank, by outcome and failure reason.",
            (*names, "outcome", "reason"), registry=r,
        )  # fmt: skip
        self.room_seconds = Histogram(
            "kvferry_room_seconds", "A room's first status to its terminal one, on this rank.",
            (*names, "flow", "outcome"), buckets=_LAT_BUCKETS, registry=r,
        )  # fmt: skip
        self.xfer_seconds = Histogram(
            "kvferry_transfer_seconds", "One NIXL transfer, posted to observed completion.",
            (*names, "flow", "op", "status"), buckets=_LAT_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_StateCollector(self))
        self._first: dict[tuple[int, str], float] = {}  # (room, tid) -> first status time
        self._lock = threading.Lock()
        self._server: Any = None
        self.port = -1
        self._tap_telemetry()
        if port >= 0:
            self._server, _thread = start_http_server(port, addr=host, registry=r)
            self.port = self._server.server_port

    # ---- hooks ---------------------------------------------------------------------------------
    def on_status(self, room: int, tid: str, status: KVPoll, reason: str) -> None:
        """A room's status changed on this rank (driver lock held: quick, no callbacks)."""
        now = time.monotonic()
        key = (room, tid)
        with self._lock:
            t0 = self._first.setdefault(key, now)
            if status is not KVPoll.Success and status is not KVPoll.Failed:
                return
            del self._first[key]
        outcome = "success" if status is KVPoll.Success else "failed"
        why = "" if status is KVPoll.Success else reason_class(reason)
        self.rooms.labels(**self._labels, outcome=outcome, reason=why).inc()
        flow = self._flow(room)
        self.room_seconds.labels(**self._labels, flow=flow, outcome=outcome).observe(now - t0)

    def _flow(self, room: int) -> str:
        r = self.ep.engine.rooms.get(room)  # the lock is held (on_status runs under it)
        ledger = getattr(r, "ledger", None)
        flow = getattr(ledger, "flow", None)
        return flow.value if flow is not None else "direct"

    def _tap_telemetry(self) -> None:
        """Observe every NIXL transfer record as the agent makes it (any thread)."""
        tel = self.ep.transport.agent.telemetry
        record = tel.record
        labels = self._labels

        def tapped(rec: Any) -> None:
            record(rec)
            status = "done" if rec.status == "DONE" else "err"
            # NIXL transfers of the real backend are the direct flow's writes (module header).
            self.xfer_seconds.labels(**labels, flow="direct", op=rec.op.lower(), status=status).observe(
                rec.wall_ns / 1e9
            )

        tel.record = tapped

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _StateCollector(Collector):
    """What is read at scrape time: telemetry totals, engine counters and staging, rejections."""

    def __init__(self, m: EndpointMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Any]:
        m, ep = self.m, self.m.ep
        names, values = list(m._labels), list(m._labels.values())

        def family(kind: type, name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return kind(name, doc, labels=[*names, *extra])

        tot = ep.transport.agent.telemetry.totals()
        posted = family(CounterMetricFamily, "kvferry_bytes_posted", "Bytes of NIXL transfers completed.")
        posted.add_metric(values, tot.nbytes)
        descs = family(
            CounterMetricFamily, "kvferry_descriptors", "Descriptors of completed transfers.", ("kind",)
        )
        descs.add_metric([*values, "requested"], tot.descs_requested)
        descs.add_metric([*values, "posted"], tot.descs_posted)  # after NIXL's dense-run merge
        xfers = family(CounterMetricFamily, "kvferry_transfers", "NIXL transfers completed.", ("status",))
        xfers.add_metric([*values, "done"], tot.transfers - tot.errors)
        xfers.add_metric([*values, "err"], tot.errors)
        with ep.lock:  # the engine only under its lock
            counters = dict(ep.engine.counters)
            pools = _staging(ep.engine)
        deferred = family(
            CounterMetricFamily, "kvferry_chunk_deferrals", "Staged chunks that waited for space."
        )
        deferred.add_metric(values, counters.get("chunk_deferred", 0))
        notices = family(
            CounterMetricFamily,
            "kvferry_notices",
            "Messages a peer must answer: resent, or given up on.",
            ("kind", "event"),
        )
        for counter, (kind, event) in sorted(_NOTICES.items()):
            notices.add_metric([*values, kind, event], counters.get(counter, 0))
        used = family(GaugeMetricFamily, "kvferry_staging_used_bytes", "Staging bytes in use.", ("pool",))
        cap = family(GaugeMetricFamily, "kvferry_staging_capacity_bytes", "Staging bytes.", ("pool",))
        for pool, (u, c) in sorted(pools.items()):
            used.add_metric([*values, pool], u)
            cap.add_metric([*values, pool], c)
        stats = ep.transport.control.stats
        rejected = family(
            CounterMetricFamily, "kvferry_control_frames_rejected", "Control frames dropped.", ("reason",)
        )
        for reason, n in sorted({**stats.rejected, "malformed": stats.malformed}.items()):
            rejected.add_metric([*values, reason], n)
        yield from (posted, descs, xfers, deferred, notices, used, cap, rejected)


def _staging(engine: Any) -> dict[str, tuple[int, int]]:
    """The staging pools of the engine's staged half: decode's ring and pinned pool, prefill's
    pinned pool (core/flows/staged_receiver.py, staged_sender.py)."""
    staged = engine.staged
    pools = {"pinned": staged.pinned}
    if isinstance(staged, StagedReceiver):
        pools["ring"] = staged.ring
    return {name: (pool.used, pool.capacity) for name, pool in pools.items() if pool is not None}


def attach(endpoint: Any) -> EndpointMetrics | None:
    """The endpoint's metrics if its config asks for them (called once, at start)."""
    cfg = endpoint.config
    if not cfg.metrics:
        return None
    return EndpointMetrics(endpoint, port=cfg.metrics_port, host=cfg.host)
