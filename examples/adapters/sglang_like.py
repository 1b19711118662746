"""Adapters shaped like SGLang's disaggregation KV classes, over kvferry's runtime endpoints.

SGLang (``python/sglang/srt/disaggregation/base/conn.py`` and its mooncake/nixl backends) has one
``KVManager`` per TP rank of each server and a ``KVSender``/``KVReceiver`` per request on every
rank. The mapping:

- ``KVArgs`` -> SGLang's ``KVArgs``: the rank's KV buffers as pointer and length lists, K of every
  layer first, then V of every layer (SGLang's MHA order). The geometry (``PoolGeometry``) is given
  besides, where SGLang derives it from the model config.
- ``KVManager`` -> ``BaseKVManager``: owns one ``PrefillEndpoint`` or ``DecodeEndpoint`` (one rank)
  and the rank's aux rows. ``close()`` stops it.
- ``KVSender`` -> ``BaseKVSender``: ``init(num_kv_indices, aux_index)``, ``send(kv_indices)`` with
  the page ids of the next chunk (kvferry wants the room's page ids from token 0 and the chunk's
  ``token_end``: the adapter accumulates them; the chunk that completes ``num_kv_indices`` pages is
  the last one), ``poll()``, ``failure_exception()``, ``abort()``, ``clear()``.
- ``KVReceiver`` -> ``BaseKVReceiver``: ``init(kv_indices, aux_index)``, ``poll()``,
  ``failure_exception()``, ``abort()``, ``clear()``, plus ``pages_freed()``.
- ``KVPoll`` is kvferry's, with SGLang's names and values (Failed=0 ... Success=4).

Simplified, or different from SGLang:

- Token count: kvferry needs the room's exact length on both sides (a non-last chunk ends on a page
  boundary, the last one at the room's last token). Both ``init`` calls take ``num_tokens``
  (SGLang: ``len(req.origin_input_ids)``); left out, it is ``num_kv_indices * page_size``.
- Bootstrap: no bootstrap server. A decode ``KVManager`` is built with the prefill server's name and
  every prefill rank's control address (what SGLang's bootstrap server hands out); a receiver's
  ``bootstrap_addr`` must be that name. One prefill server per decode manager.
- Pairing: ``transfer_id`` is ``str(bootstrap_room)`` on both sides; ``dest_tp_ranks``, ``pp_rank``
  and ``data_parallel_rank`` are accepted and ignored (kvferry derives which prefill ranks pair with
  which decode ranks from the TP sizes, ``core/topology.py``).
- Aux: kvferry's aux row starts with the room id (the landing check), so it is not SGLang's
  metadata buffers: each manager owns ``aux_rows`` rows of ``aux_row_bytes`` bytes; a sender's
  ``aux_payload`` (e.g. the first output token) follows the room id, and a successful receiver's
  ``aux_payload()`` reads it back.
- Status across TP ranks: each handle polls its own rank; the scheduler takes the minimum over
  ranks (``kvferry.core.kvpoll.min_status``), as SGLang's ``poll_and_all_reduce`` does.
- No PP, no DP attention, no hybrid-model state indices, no MLA-specific sender selection beyond
  what the runtime does.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.core.geometry import KVKind, PoolGeometry
from kvferry.core.kvpoll import KVPoll

__all__ = ["DisaggregationMode", "KVArgs", "KVManager", "KVPoll", "KVReceiver", "KVSender"]

ROOM_BYTES = 8  # an aux row starts with the room id


class DisaggregationMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class KVArgs:
    """One rank's KV memory, as SGLang's ``KVArgs`` lists it: K of layers 0..L-1, then V. Only
    addresses: the caller owns the memory and must keep it alive until the manager is closed
    (NIXL holds a registration of it until then)."""

    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    mem: str = "DRAM"  # "VRAM" for GPU pointers
    gpu_id: int = 0
    aux_rows: int = 1024
    aux_row_bytes: int = 64


class KVManager:
    """One TP rank of a prefill or decode server."""

    def __init__(
        self,
        args: KVArgs,
        mode: DisaggregationMode,
        pool: PoolGeometry,
        *,
        server: str,
        prefill_server: str = "",
        prefill_addresses: Sequence[str] = (),
        config: RuntimeConfig | None = None,
    ) -> None:
        layers = pool.model.num_layers
        if pool.model.is_mla:
            ids = [pool.region_id(layer, KVKind.LATENT) for layer in range(layers)]
        else:
            ids = [pool.region_id(layer, KVKind.K) for layer in range(layers)]
            ids += [pool.region_id(layer, KVKind.V) for layer in range(layers)]
        if len(args.kv_data_ptrs) != len(ids) or len(args.kv_data_lens) != len(ids):
            raise ValueError(f"expected {len(ids)} KV buffers for {pool.model.name}")
        buffers = {
            rid: (ptr, nbytes, args.mem, args.gpu_id)
            for rid, ptr, nbytes in zip(ids, args.kv_data_ptrs, args.kv_data_lens, strict=True)
        }
        config = msgspec.structs.replace(
            config or RuntimeConfig(), aux_rows=args.aux_rows, aux_row_bytes=args.aux_row_bytes
        )
        self.args, self.mode, self.pool = args, mode, pool
        self.aux = np.zeros(args.aux_rows * args.aux_row_bytes, np.uint8)  # kvferry's aux rows
        self.prefill_server = prefill_server
        self.endpoint: PrefillEndpoint | DecodeEndpoint
        if mode is DisaggregationMode.PREFILL:
            self.endpoint = PrefillEndpoint(server, pool, buffers=buffers, aux=self.aux, config=config)
        else:
            self.endpoint = DecodeEndpoint(
                server,
                pool,
                prefill_server=prefill_server,
                prefill_addresses=prefill_addresses,
                buffers=buffers,
                aux=self.aux,
                config=config,
            )
        self.endpoint.start()

    @property
    def address(self) -> str:
        """This rank's control address (a prefill rank's goes to the decode managers)."""
        return self.endpoint.address

    def aux_row(self, aux_index: int) -> bytes:
        n = self.args.aux_row_bytes
        return self.aux[aux_index * n : (aux_index + 1) * n].tobytes()

    def close(self) -> list[str]:
        return self.endpoint.close()


class KVSender:
    """One request on one prefill rank (SGLang's ``BaseKVSender``)."""

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        dest_tp_ranks: Sequence[int] | None = None,
        pp_rank: int = 0,
    ) -> None:
        assert isinstance(mgr.endpoint, PrefillEndpoint)
        self.mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.handle = mgr.endpoint.sender(bootstrap_room, str(bootstrap_room))
        self.aux_payload = b""  # set before the last send; decode reads it with aux_payload()
        self._pages: list[int] = []
        self._num_pages = 0
        self._num_tokens = 0
        self._aux_index = 0

    def init(
        self, num_kv_indices: int, aux_index: int | None = None, *, num_tokens: int | None = None
    ) -> None:
        if aux_index is None:
            raise ValueError("kvferry needs an aux row (the landing check)")
        self._num_pages = num_kv_indices
        self._num_tokens = num_kv_indices * self.mgr.pool.page_size if num_tokens is None else num_tokens
        self._aux_index = aux_index
        self.handle.init(aux_index)

    def send(self, kv_indices: Sequence[int] | np.ndarray) -> None:
        """The next chunk's page ids (SGLang sends full pages only, until the last chunk)."""
        self._pages.extend(int(p) for p in kv_indices)
        if len(self._pages) > self._num_pages:
            raise ValueError(f"room {self.bootstrap_room}: more pages than init's {self._num_pages}")
        is_last = len(self._pages) == self._num_pages
        token_end = self._num_tokens if is_last else len(self._pages) * self.mgr.pool.page_size
        if is_last:
            room = self.bootstrap_room.to_bytes(ROOM_BYTES, "little", signed=True)
            row = room + self.aux_payload.ljust(self.mgr.args.aux_row_bytes - ROOM_BYTES, b"\0")
            self.handle.write_aux(self._aux_index, row)
        self.handle.send(np.asarray(self._pages, dtype=np.int64), token_end, is_last)

    def layers_ready(self, first_layer: int, end_layer: int) -> None:
        """Layers ``[first_layer, end_layer)`` of the chunk the last ``send`` handed over are
        computed. Only for the layer-wise flow (``StagingConfig(flow="layerwise")``), where
        ``send`` comes as the chunk's forward starts; the layers' KV leaves at once."""
        self.handle.layers_ready(first_layer, end_layer)

    def poll(self) -> KVPoll:
        return self.handle.poll()

    def failure_exception(self) -> None:
        self.handle.failure_exception()

    def abort(self) -> None:
        self.handle.abort()

    def clear(self) -> None:
        self.handle.clear()


class KVReceiver:
    """One request on one decode rank (SGLang's ``BaseKVReceiver``)."""

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
        data_parallel_rank: int | None = None,
    ) -> None:
        assert isinstance(mgr.endpoint, DecodeEndpoint)
        if bootstrap_addr != mgr.prefill_server:
            raise ValueError(f"this manager pairs with {mgr.prefill_server!r}, not {bootstrap_addr!r}")
        if bootstrap_room is None:
            raise ValueError("kvferry needs the room id")
        self.mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.handle = mgr.endpoint.receiver(bootstrap_room, str(bootstrap_room))
        self._aux_index = 0

    def init(
        self,
        kv_indices: Sequence[int] | np.ndarray,
        aux_index: int | None = None,
        *,
        num_tokens: int | None = None,
    ) -> None:
        if aux_index is None:
            raise ValueError("kvferry needs an aux row (the landing check)")
        pages = np.asarray(kv_indices, dtype=np.int64)
        self._aux_index = aux_index
        if num_tokens is None:
            num_tokens = len(pages) * self.mgr.pool.page_size
        self.handle.init(pages, num_tokens, aux_index)

    def poll(self) -> KVPoll:
        return self.handle.poll()

    def failure_exception(self) -> None:
        self.handle.failure_exception()

    def pages_freed(self) -> bool:
        """A failed room's pages may be reused only once this is true (read it before clear())."""
        return self.handle.pages_freed()

    def aux_payload(self) -> bytes:
        """The rest of the aux row after the room id: the sender's ``aux_payload``, zero-padded
        (valid once poll() is Success)."""
        return self.mgr.aux_row(self._aux_index)[ROOM_BYTES:]

    def abort(self) -> None:
        self.handle.abort()

    def clear(self) -> None:
        self.handle.clear()
