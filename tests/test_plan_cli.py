"""``kvferry plan``: the README command, JSON contents, flags, and clean errors on bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from kvferry.core.geometry import PRESETS, make_pools
from kvferry.core.planner import plan_room
from typer.testing import CliRunner

from kvferry.commands import register_all

README_ARGS = ["plan", "--model", "qwen3-8b", "--prefill-tp", "4", "--decode-tp", "2", "--page-size", "16"]


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Root."""

    register_all(app)
    return app


def _run(app: typer.Typer, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def _json(app: typer.Typer, *args: str) -> dict:
    code, out, err = _run(app, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_readme_command_prints_a_table(app: typer.Typer) -> None:
    code, out, _ = _run(app, *README_ARGS, "--tokens", "4096")
    assert code == 0
    assert "qwen3-8b" in out and "1,179,648" in out and "576.00 MiB" in out and "head_major" in out


def test_json_matches_the_planner(app: typer.Typer) -> None:
    report = _json(app, *README_ARGS, "--tokens", "4096")
    q = PRESETS["qwen3-8b"]
    pages = np.arange(256)
    room = plan_room(make_pools(q, 4, 16, 256), make_pools(q, 2, 16, 256), pages, pages, 0, 4096)
    assert report["total_bytes"] == room.total_bytes == 4096 * q.token_bytes
    assert report["descriptors"] == room.count == 4 * 4096 * 72
    assert report["descriptors_unmerged"] == room.descriptors_unmerged
    pairs = report["pairs"]
    assert [(p["prefill_rank"], p["decode_rank"]) for p in pairs] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert sum(p["descriptors"] for p in pairs) == report["descriptors"]
    assert sum(p["bytes"] for p in pairs) == report["total_bytes"]
    assert report["staged"]["head_major"]["descriptors"] == 4
    assert report["staged"]["layer_major"]["bytes"] == report["total_bytes"]
    assert report["dummies"] == []


def test_flows_section_counts_what_the_flows_post(app: typer.Typer) -> None:
    report = _json(app, *README_ARGS, "--tokens", "4096", "--chunk-tokens", "1000")
    f = report["flows"]
    assert f["policy_choice"] == "ring"  # TP 4 -> 2: heads differ
    assert f["ring"]["chunks"] == f["pinned"]["chunks"] == 5  # 4 x 1000 + 96
    assert f["ring"]["descriptors"] == f["pinned"]["descriptors"] == 4 * 5  # one WRITE per lane
    assert f["direct"]["descriptors"] == report["descriptors"]
    q = PRESETS["qwen3-8b"]
    # A decode rank of TP 2 takes 4 of 8 heads for each of the 1000 tokens of the biggest chunk.
    assert f["ring"]["decode_space_per_chunk_bytes"] == 1000 * q.token_bytes // 2
    # Cross-check with the flows themselves: a staged room's lanes move exactly these bytes.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import harness as H

    w = H.World(
        q,
        4,
        2,
        num_pages=64,
        page_size=16,
        flow="ring",
        ring_bytes=1 << 22,
        pinned_bytes=0,
        worker_buffer_bytes=1 << 22,
        memory=False,
    )
    req = w.open_room(1, "t", 40, [40])
    assert req is not None
    for p in range(4):
        w.chunk_ready(req, p)
    w.flush()
    lanes = [
        lane
        for r in w.prefill
        for room in r.engine.rooms.values()
        for lane in r.engine.staged.lanes(room.key)
    ]
    assert len(lanes) == 4 and all(lane.length == 40 * q.token_bytes // 4 for lane in lanes)


def test_fragmented_is_seeded_and_costs_descriptors(app: typer.Typer) -> None:
    args = ("plan", "--model", "llama-3.1-70b", "--prefill-tp", "2", "--decode-tp", "2", "--tokens", "1000")
    dense = _json(app, *args)
    frag = _json(app, *args, "--fragmented", "--seed", "7")
    again = _json(app, *args, "--fragmented", "--seed", "7")
    other = _json(app, *args, "--fragmented", "--seed", "8")
    assert dense["descriptors"] == 2 * 160  # one run per region and rank pair
    assert frag == again
    assert frag["descriptors"] > dense["descriptors"] and frag["total_bytes"] == dense["total_bytes"]
    assert other["seed"] == 8


def test_separate_page_sizes_and_explicit_model(app: typer.Typer) -> None:
    report = _json(
        app,
        "plan",
        "--layers",
        "3",
        "--kv-heads",
        "4",
        "--head-dim",
        "64",
        "--dtype",
        "fp8_e4m3",
        "--prefill-tp",
        "1",
        "--decode-tp",
        "4",
        "--prefill-page-size",
        "1",
        "--decode-page-size",
        "64",
        "--tokens",
        "100",
    )
    assert report["model"] == {
        "name": "custom",
        "layers": 3,
        "kv_heads": 4,
        "head_dim": 64,
        "dtype": "fp8_e4m3",
        "mla": False,
    }
    assert (report["prefill_page_size"], report["decode_page_size"]) == (1, 64)
    assert report["total_bytes"] == 100 * 6 * 4 * 64
    assert len(report["pairs"]) == 4


def test_mla_reports_dummies(app: typer.Typer) -> None:
    report = _json(app, "plan", "--model", "deepseek-v3", "--prefill-tp", "4", "--decode-tp", "2")
    assert report["dummies"] == [{"prefill_rank": 1, "decode_rank": 0}, {"prefill_rank": 3, "decode_rank": 1}]
    assert report["descriptors"] == 2 * 61


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "qwen3-8b", "--prefill-tp", "3"], "TP 3 does not divide 8"),
        (["--model", "gpt-9"], "unknown model preset"),
        (["--layers", "2"], "--kv-heads"),
        (["--model", "qwen3-8b", "--tokens", "0"], "--tokens"),
        (["--model", "qwen3-8b", "--page-size", "0"], "page_size"),
        (["--model", "qwen3-8b", "--mla"], "MLA"),
    ],
)
def test_bad_input_is_a_clean_error(app: typer.Typer, args: list[str], match: str) -> None:
    code, out, err = _run(app, "plan", *args)
    assert code == 2
    assert err.startswith("error:") and match in err
    assert "Traceback" not in err + out


def test_help(app: typer.Typer) -> None:
    code, out, _ = _run(app, "plan", "--help")
    assert code == 0 and "--prefill-tp" in out and "--fragmented" in out
