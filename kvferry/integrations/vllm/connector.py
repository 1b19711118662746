"""``KvferryConnector``: kvferry as a vLLM v1 KV connector, loaded by module path::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.integrations.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

vLLM builds it twice: in the scheduler process (role SCHEDULER, ``scheduler.py``) and in each
worker (role WORKER, ``worker.py``). This class only routes vLLM's calls to the half it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.core.sched.output import SchedulerOutput

from kvferry.integrations.vllm.config import parse_extra_config
from kvferry.integrations.vllm.meta import KvferryConnectorMetadata, KvferryHandshake
from kvferry.integrations.vllm.scheduler import SchedulerHalf
from kvferry.integrations.vllm.stats import KvferryPromMetrics, KvferryStats
from kvferry.integrations.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class KvferryConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_extra_config(transfer.kv_connector_extra_config, str(transfer.engine_id or ""))
        self.scheduler_half: SchedulerHalf | None = None
        self.worker_half: WorkerHalf | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler_half = SchedulerHalf(
                self.settings.server,
                vllm_config.cache_config.block_size,
                self.settings.flow,
                flows=self.settings.runnable_flows(),
            )
        else:
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            self.worker_half = WorkerHalf(
                self.settings,
                is_producer=transfer.is_kv_producer,
                tp_size=tp_size,
                tp_rank=_tp_rank(tp_size),
                total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # NHD blocks; LBHNC (HND) works too, forced by VLLM_KV_CACHE_LAYOUT (worker.py)

    @property
    def _sched(self) -> SchedulerHalf:
        assert self.scheduler_half is not None, "a scheduler call on a worker connector"
        return self.scheduler_half

    @property
    def _worker(self) -> WorkerHalf:
        assert self.worker_half is not None, "a worker call on a scheduler connector"
        return self.worker_half

    def _meta(self) -> KvferryConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata)
        return meta

    # ---- scheduler side -------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.finished(request)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._sched.set_handshake(
            {rank: m for rank, m in metadata.items() if isinstance(m, KvferryHandshake)}
        )

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KvferryHandshake | None:
        return self._worker.handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: vLLM schedules a loading request only after ``get_finished``
        reported its whole prompt in."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """A layer of this step is computed: the layerwise rooms' KV of it leaves now (other
        flows wait for ``wait_for_save``, which hands their chunk over with every layer)."""
        self._worker.layer_saved(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        # Returns at once: kvferry's workers post the writes, the blocks stay held until the
        # request is reported in finished_sending.
        self._worker.save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recving, failed = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    # ---- stats ----------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvferryStats | None:
        if self.worker_half is None:
            return None  # the counts live on the workers
        stats = KvferryStats(self.worker_half.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvferryStats:
        return KvferryStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any) -> KvferryPromMetrics:
        """vLLM's (vllm_config, metric_types, labelnames, per_engine_labelvalues), passed on."""
        return KvferryPromMetrics(*args)

    def shutdown(self) -> None:
        if self.worker_half is not None:
            self.worker_half.close()
