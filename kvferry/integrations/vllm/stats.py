"""kvferry's transfer counts through vLLM's connector stats hooks.

Each worker's ``get_kv_connector_stats`` hands vLLM one interval's counts (``worker.new_stats``);
vLLM sums the workers' intervals (``aggregate``), logs ``reduce()`` with its periodic stats line,
and, when it serves Prometheus metrics, feeds every payload to ``KvferryPromMetrics.observe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvferry.integrations.vllm.worker import new_stats

COUNTS = tuple(key for key, value in new_stats().items() if isinstance(value, int))


@dataclass
class KvferryStats(KVConnectorStats):
    def __post_init__(self) -> None:
        self.data = {**new_stats(), **self.data}

    def reset(self) -> None:
        self.data = new_stats()

    def aggregate(self, other: KVConnectorStats) -> KvferryStats:
        for key in COUNTS:
            self.data[key] += other.data.get(key, 0)
        self.data["transfer_s"] = [*self.data["transfer_s"], *other.data.get("transfer_s", ())]
        return self

    def reduce(self) -> dict[str, int | float]:
        times = self.data["transfer_s"]
        out: dict[str, int | float] = {key: self.data[key] for key in COUNTS}
        out["avg_transfer_ms"] = round(1e3 * sum(times) / len(times), 3) if times else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in COUNTS)


# Prometheus names: vLLM's own prefix, kvferry's counters (a Counter gains "_total").
_COUNTERS = {
    "rooms_sent": "Rooms whose KV this prefill worker finished sending",
    "rooms_received": "Rooms whose KV this decode worker finished receiving",
    "rooms_send_failed": "Rooms that failed on prefill",
    "rooms_recv_failed": "Rooms that failed on decode (their prompts are recomputed)",
    "bytes_sent": "KV bytes of the rooms sent",
    "bytes_received": "KV bytes of the rooms received",
}
_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class KvferryPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvferry_{key}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, doc in _COUNTERS.items()
        }
        self.transfer_seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvferry_transfer_seconds",
                documentation="Seconds from a room's open to its last byte, per successful room",
                labelnames=labelnames,
                buckets=_BUCKETS,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, counter in self.counters.items():
            if transfer_stats_data.get(key):
                counter[engine_idx].inc(transfer_stats_data[key])
        for seconds in transfer_stats_data.get("transfer_s", ()):
            self.transfer_seconds[engine_idx].observe(seconds)
