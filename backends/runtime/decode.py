"""Decode rank endpoint: the receiver engine driven by one progress/notification thread.

Two threads drive it: the control thread (control messages, deadlines and heartbeats, never
blocked by the data plane) and the data thread (NIXL notifications, landed aux rows, scatter
completions). API calls (open, abort, release) come from the
scheduler's thread. Ownership follows base.py: the engine and driver only under ``self.lock``.

Pages: a failed room's pages may still be written by a prefill rank until it confirms it stopped
(or the fence deadline passes). ``KVReceiver.pages_freed()`` says when the allocator may take them
back; a successful room's pages belong to the scheduler as soon as poll() says Success.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from kvferry.backends.driver import Driver
from kvferry.backends.nixl.memory import MemRegion
from kvferry.backends.runtime.base import EndpointBase, RuntimeConfig, now_ns
from kvferry.core import topology
from kvferry.core.errors import LocalMisuseError
from kvferry.core.events import AbortRoom, ReceiverOpen, ReleaseRoom, SenderSpec
from kvferry.core.geometry import PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import Endpoint
from kvferry.core.receiver import ReceiverEngine


def sender_specs(pool: PoolGeometry, prefill_server: str, prefill_tp: int) -> tuple[SenderSpec, ...]:
    """The prefill ranks this decode rank pairs with (``core.topology``, the one copy of the rule)."""
    return topology.sender_specs(pool.model, prefill_tp, pool.tp_size, pool.tp_rank, prefill_server)


class DecodeEndpoint(EndpointBase):
    """One decode TP rank. ``prefill_addresses[r]``: control address of prefill rank ``r`` (the
    bootstrap information a router hands out); replies from prefill find us by themselves."""

    role = "decode"

    def __init__(
        self,
        server: str,
        pool: PoolGeometry,
        *,
        prefill_server: str,
        prefill_addresses: Sequence[str],
        buffers: Mapping[int, Any] | None = None,
        aux: Any | None = None,
        config: RuntimeConfig | None = None,
        extra_groups: Mapping[str, Sequence[MemRegion]] | None = None,
    ) -> None:
        config = config or RuntimeConfig()
        super().__init__(server, pool, buffers=buffers, aux=aux, config=config, extra_groups=extra_groups)
        self.specs = sender_specs(pool, prefill_server, len(prefill_addresses))
        for rank, address in enumerate(prefill_addresses):
            self.transport.connect(Endpoint(server=prefill_server, rank=rank), address)
        self.engine = ReceiverEngine(
            self.transport.registration(),
            timeouts=config.timeouts,
            quarantine_ns=int(config.write_quarantine() * 1e9),
        )
        self.driver = Driver(
            self.engine,
            self.transport,
            lock=self.lock,
            on_status=self._on_status,
            on_free_pages=self._on_free_pages,
        )
        self._loops.extend(self._progress_loops())

    def receiver(self, room: int, transfer_id: str) -> KVReceiver:
        self._check_open()
        return KVReceiver(self, room, transfer_id)


class KVReceiver:
    """One room on one decode rank, shaped like SGLang's KVReceiver (init, poll,
    failure_exception, abort, clear)."""

    def __init__(self, endpoint: DecodeEndpoint, room: int, transfer_id: str) -> None:
        self.ep = endpoint
        self.room = room
        self.transfer_id = transfer_id
        endpoint.board.track(room, transfer_id)
        self._cleared = False

    def init(self, dst_pages: Any, num_tokens: int, aux_index: int) -> None:
        """Pages are allocated: ask every prefill rank of the room for its KV."""
        self._usable()
        self.ep._check_open()
        self.ep.driver.feed(
            ReceiverOpen(
                room=self.room,
                transfer_id=self.transfer_id,
                dst_pages=np.asarray(dst_pages, dtype=np.int64),
                num_tokens=int(num_tokens),
                aux_index=int(aux_index),
                senders=self.ep.specs,
            ),
            now_ns(),
        )
        self.ep._sync(self.room, self.transfer_id)

    def poll(self) -> KVPoll:
        return self.ep.poll(self.room, self.transfer_id)

    def wait(self, timeout_s: float) -> KVPoll | None:
        return self.ep.board.wait_for(self.room, self.transfer_id, {KVPoll.Success, KVPoll.Failed}, timeout_s)

    def failure_exception(self) -> None:
        self.ep.failure_exception(self.room, self.transfer_id)

    def pages_freed(self) -> bool:
        """True once a failed room's pages are fenced (no prefill write can still land)."""
        view = self.ep.board.get(self.room, self.transfer_id)
        return view is not None and view.pages_freed

    def abort(self, reason: str = "aborted by the scheduler") -> None:
        self._usable()
        self.ep.driver.feed(AbortRoom(room=self.room, transfer_id=self.transfer_id, reason=reason), now_ns())

    def _usable(self) -> None:
        if self._cleared:
            raise LocalMisuseError(f"room {self.room}: this handle was cleared")

    def clear(self) -> None:
        self.ep.driver.feed(ReleaseRoom(room=self.room, transfer_id=self.transfer_id), now_ns())
        self.ep.board.drop(self.room, self.transfer_id)
        self._cleared = True
