"""Executors of the staged flows' gathers and scatters on a real rank: a "copy stream" per rank.

The core emits ``Gather``/``Scatter`` commands (``core.staging_layout.StagingMap``s between the KV
pool and one staging region); the driver hands them to ``Transport.post_copy`` under its lock and
polls ``check_copy`` from the progress thread. So ``submit`` must return at once and ``state``
must never block:

- ``HostCopyExecutor`` (DRAM pools): one thread runs the copies in submission order with
  ``staging_copy.copy_maps`` (numpy; whole head rows per index, the GIL released inside the copy
  loop) or, on a native-engine rank, ``native.hostcopy.copy_maps`` (C memcpy of head rows, the
  GIL released for the whole copy), so a gather of chunk N+1 overlaps the NIXL write of chunk N.
  Same bytes as the kernels.
- ``CudaCopyExecutor`` (VRAM pools): the Triton kernels of ``backends.kernels`` on one dedicated
  CUDA stream; completion is a CUDA event recorded after the kernel, polled with ``query()``; no
  device-wide or stream synchronize anywhere.

A copy that cannot run (a map outside the pool or the staging buffer, an unknown staging region)
ends ERR with its reason and fails only its room; nothing is written in that case.

On a native-engine rank (``fences``: the rank's ``NativeNixl``) both executors hand each copy's
end to the engine (backends/copy_fences.py): the copy thread signals a host fence, or the CUDA
event is given to the engine's thread, which queries it with cuEventQuery. The state of a handle
is then the engine's report, and ``settled()`` names the handles it reported, so the driver checks
only those and the data thread sleeps on the engine's wake-up. Without ``fences`` (the Python
executor, the reference) ``settled()`` is None and every copy is polled as before.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from kvferry.backends import lockcheck
from kvferry.backends.copy_fences import FenceBook, FenceEngine
from kvferry.backends.staging_copy import copy_maps
from kvferry.backends.transport import XferState
from kvferry.core.errors import KvferryError
from kvferry.core.staging_layout import StagingMap

__all__ = ["CopyExecutor", "CopyRefused", "CudaCopyExecutor", "HostCopyExecutor"]


class CopyRefused(KvferryError):
    """A gather/scatter this rank cannot run (unknown staging region, unknown handle)."""


class CopyExecutor(Protocol):
    def submit(self, kind: str, staging_region: int, maps: Sequence[StagingMap]) -> int: ...

    def state(self, handle: int) -> XferState: ...

    def reason(self, handle: int) -> str: ...

    def release(self, handle: int) -> None: ...

    def settled(self) -> set[int] | None: ...

    def close(self) -> None: ...


@dataclass
class _Job:
    kind: str
    staging_region: int
    maps: tuple[StagingMap, ...]
    state: XferState = XferState.PROC
    reason: str = ""


class HostCopyExecutor:
    """Copies between DRAM pool regions and DRAM staging buffers on one worker thread.

    ``regions``/``staging``: region id -> flat uint8 numpy view. ``copy``: what moves the bytes
    (``staging_copy.copy_maps``'s signature and checks). ``_jobs`` is shared with the copy
    thread: every access holds ``_lock``; the queue hands job ids over, with the job's host fence
    (0: none), which the copy thread signals even for a job released before it ran."""

    def __init__(
        self,
        regions: Mapping[int, np.ndarray],
        staging: Mapping[int, np.ndarray],
        name: str,
        copy: Callable[[str, Mapping[int, np.ndarray], np.ndarray, Sequence[StagingMap]], int] = copy_maps,
        fences: FenceEngine | None = None,
    ) -> None:
        self._copy = copy
        self._book = FenceBook(fences) if fences is not None else None
        self._regions = dict(regions)
        self._staging = dict(staging)
        self._lock = lockcheck.new_lock()  # checked by its tables in the lock-check debug mode
        self._jobs: dict[int, _Job] = lockcheck.guard_table({}, self._lock, "HostCopyExecutor._jobs")
        self._ids = itertools.count(1)
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-copy", daemon=True)
        self._thread.start()

    def submit(self, kind: str, staging_region: int, maps: Sequence[StagingMap]) -> int:
        if staging_region not in self._staging:
            raise CopyRefused(f"{kind}: this rank registered no staging region {staging_region}")
        hid = next(self._ids)
        fence = self._book.host_fence(hid) if self._book is not None else 0  # first: it may refuse
        with self._lock:
            self._jobs[hid] = _Job(kind, staging_region, tuple(maps))
        self._queue.put((hid, fence))
        return hid

    def _run(self) -> None:
        book = self._book
        while True:
            item = self._queue.get()
            if item is None:
                return
            hid, fence = item
            with self._lock:
                job = self._jobs.get(hid)
            if job is None:  # released before it ran (its room is gone)
                if book is not None and fence:
                    book.signal(fence, False)
                continue
            try:
                self._copy(job.kind, self._regions, self._staging[job.staging_region], job.maps)
                state, why = XferState.DONE, ""
            except Exception as exc:  # the thread must survive; the room learns the reason
                state, why = XferState.ERR, f"{type(exc).__name__}: {exc}"
            with self._lock:
                job.state, job.reason = state, why
            if book is not None and fence:  # after the state: the report may be read at once
                book.signal(fence, state is XferState.DONE)

    def _job(self, handle: int) -> _Job:
        with self._lock:
            job = self._jobs.get(handle)
        if job is None:
            raise CopyRefused(f"unknown copy handle {handle!r}")
        return job

    def state(self, handle: int) -> XferState:
        job = self._job(handle)
        if self._book is not None:
            return self._book.state(handle)[0]  # the engine's word, not the copy thread's
        with self._lock:
            return job.state

    def reason(self, handle: int) -> str:
        job = self._job(handle)
        if self._book is not None and not job.reason:
            return self._book.state(handle)[1]
        return job.reason

    def release(self, handle: int) -> None:
        with self._lock:
            self._jobs.pop(handle, None)
        if self._book is not None:
            self._book.release(handle)

    def settled(self) -> set[int] | None:
        """Handles the engine reported finished (None: no engine, poll every handle)."""
        return self._book.settled() if self._book is not None else None

    def pending(self) -> int:
        if self._book is not None:
            return self._book.pending()
        with self._lock:
            return sum(1 for j in self._jobs.values() if j.state is XferState.PROC)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10.0)


class CudaCopyExecutor:
    """Gathers and scatters by the Triton kernels on a dedicated CUDA stream of the pool's GPU.

    ``pool``: a ``backends.kernels.KVPool`` over the rank's VRAM regions (plane i = region i);
    ``staging``: region id -> tensor (VRAM, or pinned host memory which the kernels reach over
    PCIe), viewed here in the pool's element width. Called from the driver under its lock (submit)
    and from the progress thread (state): events are only queried, never waited on. ``fences``:
    the native engine, whose thread queries the events instead (see the module header)."""

    def __init__(
        self, pool: Any, staging: Mapping[int, Any], geometry: Any = None, fences: FenceEngine | None = None
    ) -> None:
        import torch

        self._torch = torch
        self._book = FenceBook(fences) if fences is not None else None
        self._pool = pool
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[pool.itemsize]
        self._staging = {
            rid: t.reshape(-1)
            .view(torch.uint8)[: t.numel() * t.element_size() // pool.itemsize * pool.itemsize]
            .view(width)
            for rid, t in staging.items()
        }
        self._stream = torch.cuda.Stream(device=pool.device)
        self._events: dict[int, Any] = {}
        self._reasons: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        if geometry is not None:
            self.precompile(geometry)

    def precompile(self, geometry: Any) -> int:
        """Compile (or load from Triton's cache) the kernels this rank's copies will use: gather
        and scatter, both staging formats, every head count a lane can have (a divisor of this
        rank's heads). A first compile takes seconds: paid here, not inside a room's deadline.
        Returns how many specializations were asked for."""
        from kvferry.backends.kernels.planner_maps import gather_map, scatter_map
        from kvferry.core.staging_layout import StagingFormat, staged_map

        if not self._staging:
            return 0
        buf = next(iter(self._staging.values()))
        heads = geometry.heads_per_rank
        pages = np.zeros(1, dtype=np.int64)
        n = 0
        with self._torch.cuda.device(self._stream.device):
            for nh in (d for d in range(1, heads + 1) if heads % d == 0):
                for fmt in StagingFormat:
                    smap = staged_map(
                        geometry, pages, geometry.head_start, nh, 0, min(16, geometry.page_size), fmt, 0
                    )
                    for run in (gather_map, scatter_map):
                        run(self._pool, buf, smap, stream=self._stream, compile_only=True)
                        n += 1
        return n

    def submit(self, kind: str, staging_region: int, maps: Sequence[StagingMap]) -> int:
        from kvferry.backends.kernels.planner_maps import gather_map, scatter_map

        buf = self._staging.get(staging_region)
        if buf is None:
            raise CopyRefused(f"{kind}: this rank registered no staging region {staging_region}")
        run = gather_map if kind == "gather" else scatter_map
        event = None
        # Triton launches on the current device: ranks of one process may sit on different GPUs.
        with self._torch.cuda.device(self._stream.device):
            for smap in maps:  # one stream: the maps of a command run in order
                event = run(self._pool, buf, smap, stream=self._stream) or event
            if event is None:  # nothing to move (dummy maps): done at once
                event = self._torch.cuda.Event()
                event.record(self._stream)
            hid = next(self._ids)
            if self._book is not None:  # on the event's device: the engine queries in its context
                self._book.cuda_event(hid, event)
            with self._lock:
                self._events[hid] = event
        return hid

    def state(self, handle: int) -> XferState:
        with self._lock:
            event = self._events.get(handle)
        if event is None:
            raise CopyRefused(f"unknown copy handle {handle!r}")
        if self._book is not None:
            return self._book.state(handle)[0]
        return XferState.DONE if event.query() else XferState.PROC

    def reason(self, handle: int) -> str:
        if self._book is not None:
            return self._book.state(handle)[1]
        return self._reasons.get(handle, "")

    def release(self, handle: int) -> None:
        with self._lock:
            self._events.pop(handle, None)
        if self._book is not None:
            self._book.release(handle)

    def settled(self) -> set[int] | None:
        """Handles the engine reported finished (None: no engine, poll every handle)."""
        return self._book.settled() if self._book is not None else None

    def pending(self) -> int:
        if self._book is not None:
            return self._book.pending()
        with self._lock:
            return sum(1 for e in self._events.values() if not e.query())

    def close(self) -> None:
        self._stream.synchronize()  # teardown only: the staging memory is about to be freed
