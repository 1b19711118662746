"""Copy completions learned from the native engine's fences, for the copy executors of a
native-engine rank (backends/copy_exec.py).

On such a rank a copy's end is not polled by the data thread: the engine's progress thread
watches the copy's fence (a host fence the copy thread signals, or the CUDA event recorded after
the kernels) and reports it in the batch that also carries write completions, behind the same
wake-up. ``FenceBook`` maps those reports back to copy handles: a handle's state is what the
engine said (PROC until it said anything), so the driver feeds ``CopyDone`` only on the engine's
word, never on the executor's own.

A handle released while its fence is pending is forgotten here and on the engine's side; the
engine still reports the fence (every watch ends in exactly one report) and that report is
dropped. ``_lock`` guards the three tables (the driver's threads and the copy thread call in).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from kvferry.backends.transport import XferState

__all__ = ["FenceBook", "FenceEngine"]


class FenceEngine(Protocol):
    """What ``FenceBook`` needs of the engine (``backends.nixl.native.NativeNixl``)."""

    def new_host_fence(self) -> int: ...

    def signal_host_fence(self, fence: int, status: int = 0) -> None: ...

    def put_host_fence(self, fence: int) -> None: ...

    def watch_host(self, fence: int) -> int: ...

    def watch_cuda(self, event: Any) -> int: ...

    def forget_fence(self, cookie: int) -> None: ...

    def take_fences(self) -> dict[int, int]: ...

    def fence_reason(self, status: int) -> str: ...


class FenceBook:
    def __init__(self, engine: FenceEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._handle_of: dict[int, int] = {}  # cookie -> copy handle, until reported
        self._cookie_of: dict[int, int] = {}  # copy handle -> cookie, until reported
        self._final: dict[int, tuple[XferState, str]] = {}  # reported, not released

    def host_fence(self, handle: int) -> int:
        """A host fence for ``handle``, watched by the engine. The caller signals it once the
        copy ended (``signal``), exactly once, whether or not the handle was released."""
        fence = self.engine.new_host_fence()
        try:
            self._note(handle, self.engine.watch_host(fence))
        except BaseException:
            self.engine.put_host_fence(fence)
            raise
        return fence

    def signal(self, fence: int, ok: bool) -> None:
        self.engine.signal_host_fence(fence, 0 if ok else -7)
        self.engine.put_host_fence(fence)  # the engine keeps its own reference while it watches

    def cuda_event(self, handle: int, event: Any) -> None:
        """Watch the recorded CUDA event of ``handle`` (the engine keeps it alive meanwhile)."""
        self._note(handle, self.engine.watch_cuda(event))

    def _note(self, handle: int, cookie: int) -> None:
        with self._lock:
            self._handle_of[cookie] = handle
            self._cookie_of[handle] = cookie

    def settled(self) -> set[int]:
        """Handles the engine reported (done or failed) and not yet released."""
        got = self.engine.take_fences()
        with self._lock:
            for cookie, status in got.items():
                handle = self._handle_of.pop(cookie, None)
                if handle is None:
                    continue  # released meanwhile
                del self._cookie_of[handle]
                if status == 0:
                    self._final[handle] = (XferState.DONE, "")
                else:
                    self._final[handle] = (XferState.ERR, self.engine.fence_reason(status))
            return set(self._final)

    def state(self, handle: int) -> tuple[XferState, str]:
        """The engine's word on ``handle``: (PROC, "") until it reported."""
        with self._lock:
            final = self._final.get(handle)
        if final is None:
            self.settled()
            with self._lock:
                final = self._final.get(handle)
        return final or (XferState.PROC, "")

    def pending(self) -> int:
        with self._lock:
            return len(self._cookie_of)

    def release(self, handle: int) -> None:
        with self._lock:
            self._final.pop(handle, None)
            cookie = self._cookie_of.pop(handle, None)
            if cookie is not None:
                del self._handle_of[cookie]
        if cookie is not None:
            self.engine.forget_fence(cookie)
