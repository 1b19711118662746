"""The layer-wise flow between two real processes over NIXL (UCX on DRAM), the threaded runtime:
prefill hands each chunk over when its forward "starts" and reports its layers one by one
(``KVSender.layers_ready``, tests/nixl_procs/prefill_proc.py); aborts from both sides, early and
mid-transfer; a peer killed mid-stream. Every Success room's bytes are compared with what prefill
computed, every table ends empty (the helpers of tests/test_nixl_e2e.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_nixl_e2e import _check_rooms, _empty, _run_rooms, _start  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "nixl_procs"))
import workload as wl  # noqa: E402

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


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_peer_killed_mid_stream_fails_the_survivors_rooms(victim: str) -> None:
    """Each room's first chunk is handed over and only its first layer reported: the rooms are
    mid-stream (a layer landed, the next never computed) when the peer dies."""
    seed, n = 5, 8
    pre, dec = _start(seed, n, 0.0, hold=True, tp=(2, 1), flow="layerwise")
    try:
        dec.expect("ready")
        pre.tell("go")
        dec.tell("go")
        survivor, dead = (dec, pre) if victim == "prefill" else (pre, dec)
        dec.expect("inflight", 60)
        pre.expect("inflight", 60)
        dead.kill()
        survivor.tell("killed")
        out = survivor.expect("done", 60)
        survivor.tell("exit")
        closed = survivor.expect("closed")
    finally:
        dec.close()
        pre.close()
    assert len(out["rooms"]) == n
    for res in out["rooms"].values():
        statuses = res["status"] if isinstance(res["status"], list) else [res["status"]]
        assert all(s == KVPoll.Failed for s in statuses), res
        reasons = res["reason"] if isinstance(res["reason"], list) else [res["reason"]]
        died = ("lost (no heartbeat)", "write failed", "ended in ERR", "REMOTE_DISCONNECT")
        assert all(any(d in r for d in died) for r in reasons), res
    assert out["after_kill_s"] is not None
    assert closed["stuck"] == []
    if victim == "decode":
        assert _empty(out["leaks"]), out["leaks"]
