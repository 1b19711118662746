"""CUDA fences on the native engine (needs a GPU: ``KVFERRY_TEST_DEVICE=cuda``, else skipped).

- A CUDA event recorded after a long kernel (``torch.cuda._sleep``) is reported done by the
  engine's thread (cuEventQuery through the libcuda torch loaded) only once the kernel finished.
- Ring and pinned rooms between two processes on VRAM, both on the native engine: the gathers'
  and scatters' events are watched by the engines, and every room's bytes arrive right.

On the device, from the repository root:
  KVFERRY_TEST_DEVICE=cuda python -m pytest -q -p no:xdist tests/test_native_fences_gpu.py
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvferry.backends.nixl.native import NativeNixl

pytestmark = [
    pytest.mark.skipif(os.environ.get("KVFERRY_TEST_DEVICE") != "cuda", reason="KVFERRY_TEST_DEVICE=cuda"),
    pytest.mark.timeout(300),
]


@pytest.fixture
def eng() -> Iterator[NativeNixl]:
    e = NativeNixl(f"kvferry-cuda-fence-{time.monotonic_ns()}")
    yield e
    e.stop()
    e.destroy()


def test_cuda_fence_is_done_only_after_its_kernel_finished(eng: NativeNixl) -> None:
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(3e9))  # about 1.5-2 s of GPU clock cycles
    event = torch.cuda.Event()
    event.record(stream)
    cookie = eng.watch_cuda(event)
    seen_running = False
    got: dict[int, int] = {}
    end = time.monotonic() + 120
    while cookie not in got:
        assert time.monotonic() < end, "the CUDA fence was never reported"
        got.update(eng.take_fences())  # first what the engine said, then what CUDA says now
        finished = event.query()
        if cookie in got:
            assert finished, "the engine reported the fence before its kernel finished"
        elif not finished:
            seen_running = True
        eng.wait(0.01)
    assert got == {cookie: 0}
    assert seen_running  # the check above ran while the kernel was still going
    counters = eng.counters()
    assert counters["fence_events"] == 1 and counters["fence_polls"] > 1


def test_cuda_fence_forgotten_while_its_kernel_runs_keeps_the_event_alive(eng: NativeNixl) -> None:
    """A copy released while its kernel runs: the caller drops its event at once, the engine still
    queries it (kept alive on the Python side until reported) and its report is dropped."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(1e9))
    event = torch.cuda.Event()
    event.record(stream)
    cookie = eng.watch_cuda(event)
    eng.forget_fence(cookie)
    del event  # the caller's reference: the engine's watch must not depend on it
    assert eng.fences_watched() == 1
    end = time.monotonic() + 120
    while eng.counters()["fence_events"] < 1:
        assert time.monotonic() < end, "the forgotten CUDA fence was never reported"
        eng.wait(0.01)
    assert eng.take_fences() == {} and eng.fences_watched() == 0
    stream.synchronize()


@pytest.mark.parametrize(("tp", "flow"), [((1, 1), "ring"), ((2, 1), "ring"), ((4, 2), "pinned")])
def test_staged_rooms_on_vram_with_the_engine_watching_the_copies(
    monkeypatch: pytest.MonkeyPatch, tp: tuple[int, int], flow: str
) -> None:
    monkeypatch.setenv("KVFERRY_E2E_ENGINE", "native")
    monkeypatch.setenv("KVFERRY_E2E_MEM", "VRAM")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_nixl_e2e as e2e
    import workload as wl

    seed, n = 31, 24
    plans = wl.rooms(seed, n, abort_rate=0.2)
    out = e2e._run_rooms(seed, n, 0.2, tp, flow)
    assert set(out["d"]["executor"]) == set(out["p"]["executor"]) == {"native"}
    assert e2e._check_rooms(plans, out, tp) >= n // 2
    assert all(f > 0 for f in out["p"]["fences"] + out["d"]["fences"]), (
        out["p"]["fences"],
        out["d"]["fences"],
    )
