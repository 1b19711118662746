"""``kvferry bench nixl`` for real: a process a rank (or a side), real NIXL on DRAM, rooms small
enough for CI.

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


@pytest.mark.parametrize("flow", ["direct", "ring"])
def test_a_process_per_rank_row_moves_and_reports_what_one_process_a_side_does(
    flow: str, tmp_path: Path
) -> None:
    """TP 2->2 with each rank its own process, as a serving engine runs them: every decode rank's
    bytes checked, each rank's telemetry merged into the one file, each process's trace read,
    the same counts as one process a side reports."""
    rows, writes = {}, {}
    for per_rank in (False, True):
        out = tmp_path / f"{flow}.{per_rank}"
        out.mkdir()
        cfg = BenchConfig(
            "tp2->2 nhd", 2, 2, tokens=32, rooms=2, flow=flow, process_per_rank=per_rank,
            telemetry_path=str(out / "t.json"), trace_dir=str(out),
        )  # fmt: skip
        rows[per_rank] = run_config(cfg, timeout_s=120.0)
        writes[per_rank] = json.loads((out / "t.json").read_text())["writes"]
        left = sorted(p.name for p in out.iterdir())
        want = ["decode0", "decode1", "prefill0", "prefill1"] if per_rank else ["decode", "prefill"]
        assert left == sorted([*(f"{n}.rows.json" for n in want), "t.json", "trace.json"])
    one, each = rows[False], rows[True]
    assert each["bytes_ok"] is True and each["process_per_rank"] is True
    assert len(each["kvferry_batches_s"]) == 2 and all(t > 0 for t in each["kvferry_batches_s"])
    for key in ("room_mb", "descs_requested", "scattered"):
        assert each[key] == one[key], key
    # Hop labels follow the order events met (a race), so not their count: every rank's are there.
    assert {h["label"].split()[0] for h in each["hops"]} >= {"prefill0", "prefill1", "decode0", "decode1"}
    assert len(writes[True]) == len(writes[False]) > 0
    assert sorted(w["nbytes"] for w in writes[True]) == sorted(w["nbytes"] for w in writes[False])


def test_a_process_per_rank_batch_spans_every_decode_process() -> None:
    """With several decode processes a batch runs from the first one's first init to the last
    one's Success, and every process's counts add up."""
    from kvferry.tools.runtime_bench import _decode_summary

    part = {"executor": ["python"], "room_bytes": 10, "counters": {"scattered_ring": 2}, "reads": [1]}
    a = {**part, "durations": [0.5], "check": {"ok": True, "rooms_checked": 1}}
    b = {**part, "durations": [0.7], "check": {"ok": False, "rooms_checked": 1}}
    got = _decode_summary([a, b], [0.9])
    assert got["durations"] == [0.9]  # the span, not either process's own
    assert got["room_bytes"] == 20 and got["counters"] == {"scattered_ring": 4} and got["reads"] == [1, 1]
    assert got["check"] == {"ok": False, "rooms_checked": 2}
    assert _decode_summary([a], [0.9])["durations"] == [0.5]  # one process: its own time


def test_the_process_layout_option_reaches_every_run() -> None:
    from kvferry.commands.bench import NixlRoomOpts, NixlRuntimeOpts, _nixl_runs
    from kvferry.tools.runtime_bench import DEFAULT_CONFIGS

    assert NixlRuntimeOpts().process_per_rank is True  # as serving engines run their ranks
    for per_rank in (True, False):
        opts = NixlRuntimeOpts(process_per_rank=per_rank)
        runs = _nixl_runs(list(DEFAULT_CONFIGS[:2]), ["ring", "direct"], NixlRoomOpts(), opts)
        assert [c.process_per_rank for c in runs] == [per_rank] * 4
