"""``kvferry bench nixl`` for real: two processes, real NIXL on DRAM, rooms small enough for CI.

The bench's numbers are not asserted (no timing in tests); what is: every row's bytes were
checked on decode, and the direct flow's row carries the baseline of NIXL alone with the room's
own descriptors (and only the direct flow's: staged flows post other descriptors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvferry.tools.runtime_bench import BenchConfig, run_config


@pytest.mark.parametrize("flow", ["direct", "ring"])
def test_a_small_bench_row_checks_its_bytes_and_says_what_nixl_alone_costs(flow: str) -> None:
    cfg = BenchConfig("tp2->1 nhd", 2, 1, tokens=32, rooms=2, inflight=2, flow=flow)
    row = run_config(cfg, timeout_s=120.0)
    assert row["bytes_ok"] is True
    assert row["kvferry_gbps"] > 0 and row["raw_gbps"] > 0
    if flow == "direct":
        assert row["planned_raw_gbps"] > 0
        assert row["ratio_to_planned"] == pytest.approx(row["kvferry_gbps"] / row["planned_raw_gbps"])
        assert row["planned_of_raw"] == pytest.approx(row["planned_raw_gbps"] / row["raw_gbps"])
    else:
        assert row["planned_raw_gbps"] is None and row["ratio_to_planned"] is None
        assert row["scattered"]["ring"] > 0  # the ring really ran


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_room_ending_inside_a_page_checks_its_bytes(engine: str) -> None:
    """8 tokens in 16-token pages: the rest of the last page stays zero, and the check expects
    exactly that many zero bytes (it once counted them as wrong bytes)."""
    cfg = BenchConfig("tp1->1 nhd", 1, 1, tokens=8, rooms=2, flow="direct", engine=engine)
    row = run_config(cfg, timeout_s=120.0)
    assert row["bytes_ok"] is True


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_the_zeros_expected_count_the_same_on_numpy_and_torch_regions(kind: str) -> None:
    """VRAM rows check torch tensors (CPU rows numpy arrays): the expected zeros must come out the
    same on both (a ``.size`` read once broke every VRAM row)."""
    import numpy as np

    from kvferry.tools.runtime_bench import _counts, _expect_zeros

    regions: dict[int, Any] = {0: np.zeros(64, dtype=np.uint8), 1: np.zeros(64, dtype=np.uint8)}
    for r in regions.values():
        r[16:22] = 1  # slot 1 of 4: six bytes written of sixteen
    if kind == "torch":
        torch = pytest.importorskip("torch")
        regions = {k: torch.from_numpy(v) for k, v in regions.items()}
    want = {1: 12}
    _expect_zeros(want, regions, 4)
    assert want == {1: 12, 0: 20} == _counts(regions, 4, 1)


@pytest.mark.parametrize("poll_us", [0.0, 50.0, 5000.0])
def test_the_active_poll_interval_reaches_the_runtime_below_the_idle_sleep(poll_us: float) -> None:
    from kvferry.tools.runtime_bench import _config

    rc = _config(BenchConfig("tp1->1 nhd", 1, 1, active_poll_us=poll_us, flow="direct"))
    assert rc.active_idle_max_s == poll_us / 1e6
    assert rc.idle_max_s >= rc.active_idle_max_s  # a rank with work never sleeps longer than an idle one


def test_a_spinning_poll_still_moves_every_byte() -> None:
    # 0 us: the data thread and a waiting worker never sleep while a room is in flight.
    row = run_config(
        BenchConfig("tp1->1 nhd", 1, 1, tokens=32, rooms=2, flow="direct", active_poll_us=0.0),
        timeout_s=120.0,
    )
    assert row["bytes_ok"] is True and row["active_poll_us"] == 0.0


def test_a_pull_rows_telemetry_holds_decodes_reads(tmp_path: Path) -> None:
    """Pull's READs are decode's: its telemetry (prefill writes none) is what the READ cost is
    fitted from (`kvferry calibrate --flow-telemetry`)."""
    path = tmp_path / "pull.json"
    cfg = BenchConfig("tp2->1 nhd", 2, 1, tokens=32, rooms=2, flow="pull", telemetry_path=str(path))
    row = run_config(cfg, timeout_s=120.0)
    assert row["bytes_ok"] is True
    data = json.loads(path.read_text())
    assert data["writes"] == []
    # two timed rooms, each read from both prefill ranks: a head slice a descriptor
    assert len(data["reads"]) == 4
    assert all(r["op"] == "READ" and r["status"] == "DONE" for r in data["reads"])
    assert {r["descs_requested"] for r in data["reads"]} == {36 * 2 * 32}
