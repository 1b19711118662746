"""The layer-wise flow between two real processes over NIXL (UCX on DRAM), the threaded runtime:
prefill hands each chunk over when its forward "starts" and reports its layers one by one
(``KVSender.layers_ready``, tests/nixl_procs/prefill_proc.py); aborts from both sides, early and
mid-transfer. Every Success room's bytes are compared with what prefill computed, every table ends
empty (the helpers of tests/test_nixl_e2e.py). A peer killed mid-stream (a room's first layer
landed, the next never computed): tests/test_nixl_e2e.py's killed-peer test, under layerwise too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_nixl_e2e import _check_rooms, _run_rooms

sys.path.insert(0, str(Path(__file__).resolve().parent / "nixl_procs"))
import workload as wl

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_layers_stream_between_two_processes_with_aborts(tp: tuple[int, int]) -> None:
    seed, n = 29, 40
    plans = wl.rooms(seed, n, abort_rate=0.2)
    assert {x.abort for x in plans if x.abort}  # aborts from both sides, early and mid-transfer
    out = _run_rooms(seed, n, 0.2, tp, "layerwise")
    assert _check_rooms(plans, out, tp) >= n // 2
    pre = {k: sum(c.get(k, 0) for c in out["p"]["counters"]) for c in out["p"]["counters"] for k in c}
    # Layers left as they were reported, before their chunk's last layer: the flow streamed.
    assert pre.get("layers_posted_early", 0) > 0, pre
    assert pre.get("layers_ignored", 0) == 0, pre
