"""Copy fences on the native engine (backends/native/engine.c, backends/copy_fences.py): a copy's
end watched by the engine's thread and reported in the same event batches, behind the same
wake-up, as write completions. Host fences here (the CUDA kind: tests/test_native_fences_gpu.py),
and what the driver and the data thread do with the reports.

Every check that something was *not* reported waits for the engine to have polled the pending
fence again first (its fence-poll counter), so it holds whatever the machine's speed. The planted
``fence_early`` (a copy reported done when watched) must fail those checks."""

from __future__ import annotations

import ctypes.util
import random
import re
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from kvferry.backends.copy_exec import HostCopyExecutor
from kvferry.backends.driver import Driver
from kvferry.backends.native import hostcopy
from kvferry.backends.nixl import native
from kvferry.backends.runtime import RuntimeConfig
from kvferry.backends.runtime.base import EndpointBase
from kvferry.backends.transport import XferState
from kvferry.core.events import CopyDone
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.staging_layout import StagingFormat, StagingMap, staged_map

pytestmark = pytest.mark.timeout(120)


def _engine(monkeypatch: pytest.MonkeyPatch, plant: str = "") -> Iterator[native.NativeNixl]:
    monkeypatch.setenv("KVFERRY_NATIVE_PLANT", plant)
    eng = native.NativeNixl(f"kvferry-fence-{plant or 'ok'}-{time.monotonic_ns()}")
    monkeypatch.delenv("KVFERRY_NATIVE_PLANT")
    yield eng
    eng.stop()
    eng.destroy()


@pytest.fixture
def eng(monkeypatch: pytest.MonkeyPatch) -> Iterator[native.NativeNixl]:
    yield from _engine(monkeypatch)


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> Iterator[native.NativeNixl]:
    yield from _engine(monkeypatch, "fence_early")


def _until(eng: native.NativeNixl, cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Sleep on the engine's wake-up until cond holds (the timeout only guards against a hang)."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        eng.wait(0.01)


def _polled_again(eng: native.NativeNixl, passes: int = 3) -> None:
    """Return once the engine polled its pending fences ``passes`` more times."""
    start = eng.counters()["fence_polls"]
    _until(eng, lambda: eng.counters()["fence_polls"] >= start + passes, "the engine's fence polls")


def _watched_early(eng: native.NativeNixl) -> dict[int, int]:
    """Watch a host fence, let the engine poll it, and return what it reported before the signal
    (a correct engine: nothing). The fence is signalled and its report taken after."""
    fence = eng.new_host_fence()
    cookie = eng.watch_host(fence)
    _polled_again(eng)
    early = eng.take_fences()
    eng.signal_host_fence(fence, 0)
    eng.put_host_fence(fence)
    if cookie not in early:
        got: dict[int, int] = {}
        _until(eng, lambda: bool(got.update(eng.take_fences()) or got), "the fence's report")
        assert got == {cookie: 0}
    return early


def test_host_fence_is_reported_done_only_after_its_signal(eng: native.NativeNixl) -> None:
    assert _watched_early(eng) == {}
    assert eng.counters()["fence_events"] == 1 and eng.fences_watched() == 0


def test_planted_fence_reported_when_watched_is_caught(planted: native.NativeNixl) -> None:
    assert _watched_early(planted) != {}


def test_failed_host_fence_is_reported_failed_with_its_reason(eng: native.NativeNixl) -> None:
    fence = eng.new_host_fence()
    cookie = eng.watch_host(fence)
    eng.signal_host_fence(fence, -7)
    eng.put_host_fence(fence)
    got: dict[int, int] = {}
    _until(eng, lambda: bool(got.update(eng.take_fences()) or got), "the report")
    assert got == {cookie: -7}
    assert eng.fence_reason(-7) == "host copy failed"


def test_fence_signal_wakes_the_waiting_thread_through_the_eventfd(eng: native.NativeNixl) -> None:
    fence = eng.new_host_fence()
    eng.watch_host(fence)
    _polled_again(eng)
    eng.drain()
    eng.wait(0)  # nothing queued: a wait resets a wake-up whose events were drained
    assert select.select([eng.wake_fd], [], [], 0)[0] == []  # the fence is pending: no news
    signaller = threading.Thread(target=lambda: (eng.signal_host_fence(fence, 0), eng.put_host_fence(fence)))
    signaller.start()
    readable, _, _ = select.select([eng.wake_fd], [], [], 30.0)
    signaller.join()
    assert readable == [eng.wake_fd]
    assert list(eng.take_fences().values()) == [0]


def test_a_forgotten_fence_is_still_reported_by_the_engine_and_dropped(eng: native.NativeNixl) -> None:
    """A copy released while pending: the engine keeps watching (it holds its own reference on
    the fence), reports it once signalled, and the report goes nowhere."""
    fence = eng.new_host_fence()
    cookie = eng.watch_host(fence)
    _polled_again(eng)
    eng.forget_fence(cookie)
    eng.signal_host_fence(fence, 0)
    eng.put_host_fence(fence)  # the caller's reference goes first: the engine's keeps it alive
    _until(eng, lambda: eng.counters()["fence_events"] == 1, "the engine's report")
    assert eng.take_fences() == {} and eng.fences_watched() == 0


def test_many_fences_each_reported_once_with_its_own_status(eng: native.NativeNixl) -> None:
    rng = random.Random(7)
    fences = [eng.new_host_fence() for _ in range(400)]
    cookies = [eng.watch_host(f) for f in fences]
    want = {c: (0 if rng.random() < 0.5 else -7) for c in cookies}
    order = list(range(len(fences)))
    rng.shuffle(order)
    got: dict[int, int] = {}
    for k, i in enumerate(order):
        eng.signal_host_fence(fences[i], want[cookies[i]])
        eng.put_host_fence(fences[i])
        if k % 50 == 0:
            for c, st in eng.take_fences().items():
                assert c not in got  # once
                got[c] = st
    _until(eng, lambda: bool(got.update(eng.take_fences())) or len(got) == len(want), "every report")
    assert got == want
    assert eng.counters()["fence_events"] == len(want) and eng.fences_watched() == 0


def test_engine_stopped_with_a_fence_pending_reports_it_failed(eng: native.NativeNixl) -> None:
    fence = eng.new_host_fence()
    cookie = eng.watch_host(fence)
    eng.stop()
    assert eng.take_fences() == {cookie: -3}
    assert "stopped" in eng.fence_reason(-3)
    eng.signal_host_fence(fence, 0)  # the caller's reference is still good after the engine let go
    eng.put_host_fence(fence)
    after = eng.new_host_fence()
    late = eng.watch_host(after)  # watched after the stop: failed at once, not lost
    eng.put_host_fence(after)
    assert eng.take_fences() == {late: -3}


@pytest.mark.skipif(bool(ctypes.util.find_library("cuda")), reason="this machine has libcuda")
def test_cuda_fence_without_libcuda_fails_in_one_line_and_libcuda_is_never_loaded_before(
    eng: native.NativeNixl,
) -> None:
    # Creating an engine and host fences never load the driver library (torch, imported by other
    # tests of the same worker, may have mapped the runtime, libcudart: not what is asked here).
    assert not re.search(r"/libcuda\.so", Path("/proc/self/maps").read_text())

    class Recorded:  # stands for a recorded torch.cuda.Event (never queried: no libcuda)
        cuda_event = 0x1234

    cookie = eng.watch_cuda(Recorded())
    got: dict[int, int] = {}
    _until(eng, lambda: bool(got.update(eng.take_fences()) or got), "the report")
    assert got == {cookie: -6}
    assert eng.fence_reason(-6) == "CUDA fence: libcuda.so.1 (cuEventQuery) unavailable"
    assert eng.fences_watched() == 0  # the event the engine kept is let go with the report


# ---- the host copy executor on the engine's fences ------------------------------------------------
def _pool_and_map() -> tuple[dict[int, np.ndarray], np.ndarray, StagingMap]:
    geo = PoolGeometry(ModelGeometry("t", 2, 2, 8), 1, 0, 4, 8)
    rng = np.random.default_rng(3)
    regions = {r.region_id: rng.integers(0, 256, r.nbytes, dtype=np.uint8) for r in geo.regions}
    smap = staged_map(
        geo, np.array([1, 3]), geo.head_start, geo.heads_per_rank, 0, 8, StagingFormat.HEAD_MAJOR, 0
    )
    return regions, np.zeros(smap.nbytes, dtype=np.uint8), smap


class _Gate:
    """A host copy that waits for ``open`` before it moves anything (or raises, when told to)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.fail = False

    def __call__(
        self, kind: str, regions: Mapping[int, np.ndarray], staging: np.ndarray, maps: Sequence[StagingMap]
    ) -> int:
        self.open.wait(60)
        if self.fail:
            raise RuntimeError("planted copy failure")
        return hostcopy.copy_maps(kind, regions, staging, maps)


def _executor(eng: native.NativeNixl) -> tuple[HostCopyExecutor, _Gate, StagingMap, np.ndarray]:
    regions, staging, smap = _pool_and_map()
    gate = _Gate()
    ex = HostCopyExecutor(regions, {0: staging}, "fence-test", copy=gate, fences=eng)
    return ex, gate, smap, staging


def test_executor_copy_is_settled_only_after_the_engine_saw_it_end(eng: native.NativeNixl) -> None:
    ex, gate, smap, staging = _executor(eng)
    try:
        hid = ex.submit("gather", 0, (smap,))
        _polled_again(eng)
        assert ex.settled() == set() and ex.state(hid) is XferState.PROC and ex.pending() == 1
        gate.open.set()
        _until(eng, lambda: ex.settled() == {hid}, "the copy's fence")
        assert ex.state(hid) is XferState.DONE and staging.any()
        ex.release(hid)
        assert ex.settled() == set() and ex.pending() == 0
    finally:
        gate.open.set()
        ex.close()


def test_planted_early_fence_lets_the_executor_say_done_before_the_copy(planted: native.NativeNixl) -> None:
    ex, gate, smap, _ = _executor(planted)
    try:
        hid = ex.submit("gather", 0, (smap,))
        _polled_again(planted)
        assert ex.settled() == {hid}  # the bug: the bytes have not moved yet
    finally:
        gate.open.set()
        ex.close()


def test_executor_failed_copy_reports_its_own_reason(eng: native.NativeNixl) -> None:
    ex, gate, smap, _ = _executor(eng)
    gate.fail = True
    gate.open.set()
    try:
        hid = ex.submit("scatter", 0, (smap,))
        _until(eng, lambda: ex.settled() == {hid}, "the copy's fence")
        assert ex.state(hid) is XferState.ERR
        assert ex.reason(hid) == "RuntimeError: planted copy failure"
    finally:
        ex.close()


def test_executor_copy_released_before_it_ran_still_ends_its_fence(eng: native.NativeNixl) -> None:
    ex, gate, smap, _ = _executor(eng)
    try:
        first = ex.submit("gather", 0, (smap,))
        second = ex.submit("gather", 0, (smap,))
        ex.release(second)  # its room is gone before the copy thread got to it
        gate.open.set()
        _until(eng, lambda: eng.counters()["fence_events"] == 2, "both fences' reports")
        assert ex.settled() == {first} and ex.pending() == 0 and eng.fences_watched() == 0
    finally:
        gate.open.set()
        ex.close()


# ---- the driver ------------------------------------------------------------------------------------
class _FencedTransport:
    """Copies whose ends a transport learns from events: ``settled`` is what the events said."""

    def __init__(self) -> None:
        self.settled: set[int] = set()
        self.checked: list[int] = []
        self.released: list[int] = []

    def drain_notifs(self) -> list[bytes]:
        return []

    def settled_handles(self) -> set[int]:
        return set()

    def settled_copies(self) -> set[int]:
        return set(self.settled)

    def check_copy(self, handle: int) -> XferState:
        self.checked.append(handle)
        return XferState.DONE if handle in self.settled else XferState.PROC

    def release_copy(self, handle: int) -> None:
        self.released.append(handle)


class _Recorder:
    def __init__(self) -> None:
        self.events: list[object] = []

    def handle(self, event: object, now: int) -> list[object]:
        self.events.append(event)
        return []


def test_driver_checks_only_the_copies_the_transport_reports_settled() -> None:
    transport, engine = _FencedTransport(), _Recorder()
    driver = Driver(engine, transport)  # type: ignore[arg-type]
    driver.copies = {1: 10, 2: 20, 3: 30}  # op id -> copy handle, all in flight
    assert driver.pump_data(0) == 0
    assert transport.checked == [] and engine.events == []  # nothing reported: nothing checked
    transport.settled = {20}
    assert driver.pump_data(0) == 1
    assert transport.checked == [20] and transport.released == [20]
    assert engine.events == [CopyDone(op_id=2)] and set(driver.copies) == {1, 3}


@pytest.mark.parametrize(
    ("executor", "fenced", "slow"),
    [("native", True, True), ("native", False, False), ("python", False, False)],
)
def test_data_thread_keeps_the_fast_pace_only_for_copies_nobody_watches(
    executor: str, fenced: bool, slow: bool
) -> None:
    """A room in flight with a copy in flight: the data thread sleeps up to its idle cap when the
    engine watches the copy (its wake-up ends the sleep), and polls at the fast pace otherwise."""
    cfg = RuntimeConfig(control_insecure=True)
    ep = SimpleNamespace(
        board=SimpleNamespace(in_flight=lambda: 1),
        transport=SimpleNamespace(executor=executor, copies_fenced=fenced),
        driver=SimpleNamespace(copies={7: 70}),
        config=cfg,
    )
    cap = EndpointBase._data_idle_cap(ep)  # type: ignore[arg-type]
    assert cap == (cfg.idle_max_s if slow else cfg.active_idle_max_s)
    assert cfg.idle_max_s > cfg.active_idle_max_s
