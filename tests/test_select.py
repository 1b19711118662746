"""``kvferry select``: a ranked table and a recommendation, JSON, plots, and bad input as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvferry.cli import _register, app

ROOT = Path(__file__).resolve().parent.parent
_register()
runner = CliRunner()
SMALL = ["select", "--concurrency", "1,4", "--requests", "6", "--isl", "800", "--osl", "8"]


def _json(args: list[str]) -> dict:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_unequal_tp_compares_every_flow_and_recommends_staging() -> None:
    out = _json(SMALL)
    assert sorted(out["ranking"]) == ["direct", "pinned", "pull", "push", "ring"]
    assert out["recommendation"] == out["ranking"][0] in ("ring", "pinned")
    assert out["deployment"]["flow"] == out["recommendation"]  # the JSON agrees with the table
    assert out["nic"]["transport"] == "ib_verbs" and "per_desc_us" in out["nic"]["estimates"]
    assert out["reason"].startswith(out["recommendation"] + ":")
    for flow, points in out["results"].items():
        assert [p["label"] for p in points] == ["c=1", "c=4"]
        assert all(p["completed"] == 6 and not p["violations"] for p in points), flow
    knobs = out["knobs"]
    assert knobs["flow"] == out["recommendation"]
    assert any("SGLANG_DISAGGREGATION_QUEUE_SIZE" in k for k in knobs)
    assert knobs["staging_buffer_per_worker_mb"] > 0


def test_equal_tp_compares_the_unstaged_flows_and_pull_pays_its_round_trip() -> None:
    out = _json([*SMALL, "--prefill-tp", "2", "--decode-tp", "2"])
    assert sorted(out["ranking"]) == ["direct", "layerwise", "pull", "push"]
    res = {f: rs[-1] for f, rs in out["results"].items()}
    # Pull starts only once prefill's offer reaches decode, then READs: never ahead of a write
    # posted the moment the chunk is computed (vLLM PR 35264's reason for push).
    assert res["pull"]["ttft_ms"]["p50"] > res["push"]["ttft_ms"]["p50"]
    assert out["recommendation"] != "pull"
    assert "staging (SGLANG_DISAGG_STAGING_BUFFER)" not in out["knobs"]
    assert all(v == 0 for r in res.values() for v in r["extra_memory_bytes"].values())


def test_a_tail_within_five_percent_is_a_tie_decided_by_the_median() -> None:
    from kvferry.sim.deploy.select import _score

    class R:  # the fields _score reads
        def __init__(self, p50: float, p99: float) -> None:
            self.ttft_ms = type("P", (), {"p50": p50, "p99": p99})()
            self.failed = self.unfinished = 0
            self.violations: list[str] = []
            self.slo_attained = 1.0
            self.overload = ""

    assert _score([R(25, 140)]) > _score([R(45, 139)])  # p99s tie: the lower median wins
    assert _score([R(45, 100)]) > _score([R(25, 140)])  # a real tail difference wins first


def test_table_progress_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "sel.png"
    r = runner.invoke(app, [*SMALL, "--flows", "direct,ring", "--plot", str(png)])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "recommendation: ring" in r.stdout and "TTFT" in r.stdout
    assert "[1/4] direct at c=1" in r.stderr and "[4/4] ring at c=4" in r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


RATE = ["select", "--isl", "800", "--osl", "8", "--instances", "1"]


def test_poisson_rate_and_workload_file(tmp_path: Path) -> None:
    out = _json([*RATE, "--flows", "ring", "--rate", "20", "--duration-s", "2", "--warmup-s", "0.5"])
    point = out["results"]["ring"][0]
    assert point["label"] == "20 req/s" and point["warmup_s"] == 0.5
    assert not point["overload"] and point["completed"] == point["requests"] > 0
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens,prefix_hit_tokens\n0,900,4,0\n0.01,900,4,800\n")
    out = _json(["select", "--osl", "8", "--flows", "ring", "--workload", str(trace)])
    assert out["results"]["ring"][0]["completed"] == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trace", "x.csv"], "--trace was renamed --workload"),
        (["--workload", "x.csv", "--rate", "2"], "--workload gives the arrivals: --rate does not apply"),
        (["--rate", "2", "--concurrency", "4"], "--rate (open loop) and --concurrency (closed loop)"),
        (["--rate", "2", "--requests", "4"], "--requests is for --concurrency"),
        (["--duration-s", "4"], "--duration-s needs --rate"),
        (["--rate", "2", "--capacity", "--instances", "2"], "the capacity search chooses the instance"),
        (["--rate", "2", "--warmup-s", "40"], "--warmup-s must be >= 0 and below --duration-s"),
        (["--seeds", "0"], "--seeds must be in"),
        (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
    ],
)
def test_conflicting_workload_options_are_one_error_line(args: list[str], needle: str) -> None:
    r = runner.invoke(app, ["select", *args])
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_a_scenario_file_gives_the_deployment() -> None:
    preset = ROOT / "scenarios" / "presets" / "qwen3-8b-8k-tp1-tp4.toml"
    out = _json(["select", "--scenario", str(preset), "--osl", "4", "--concurrency", "2", "--flows", "ring"])
    d = out["deployment"]
    assert (d["model"], d["prefill_tp"], d["decode_tp"]) == ("qwen3-8b", 1, 4)
    assert out["results"]["ring"][0]["requests"] == 2


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--flows", "magic"], "--flows: expected names from direct, ring, pinned"),
        (["--prefill-tp", "2", "--decode-tp", "2", "--flows", "ring"], "ring does not apply"),
        (["--prefill-tp", "3"], "TP 3 does not divide 8 KV heads"),
        (["--gpu", "a100"], "unknown hardware profile 'a100'"),
        (["--model", "gpt-5"], "unknown model preset"),
        (["--concurrency", "0"], "--concurrency: each value must be in"),
        (["--concurrency", "1,x"], "comma-separated integers"),
        (["--requests", "1000001"], "--requests must be in"),
        (["--rate", "nan", "--instances", "1"], "--rate must be a number >= 0"),
        (["--ttft-slo-ms", "-1"], "--ttft-slo-ms must be a positive number"),
        (["--model", "deepseek-v3", "--prefill-tp", "8", "--decode-tp", "8"], "does not fit a h100"),
        (["--scenario", str(ROOT / "scenarios" / "quickstart.toml")], "is not a preset"),
        (["--seed", "-1"], "--seed"),
        (["--decode-instances", "0"], "--decode-instances must be in [1, 64], got 0"),
        (["--prefill-instances", "65"], "--prefill-instances must be in [1, 64], got 65"),
        (["--instances", "0"], "--instances must be in [1, 64], got 0"),
        (["--pull-orchestration", "eager"], "--pull-orchestration: expected one of overlapped, serial"),
        (["--proxy-hop-ms", "-1"], "--proxy-hop-ms must be in [0, 10000]"),
        (["--proxy-hop-ms", "nan"], "--proxy-hop-ms must be in [0, 10000]"),
    ],
)
def test_bad_input_is_one_error_line(extra: list[str], needle: str) -> None:
    r = runner.invoke(app, [*SMALL, *extra])
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_unequal_instances_run_as_one_deployment() -> None:
    out = _json([*SMALL, "--flows", "ring", "--prefill-instances", "2", "--decode-instances", "3"])
    d = out["deployment"]
    assert (d["prefill_instances"], d["decode_instances"]) == (2, 3)
    for point in out["results"]["ring"]:
        assert point["completed"] == point["requests"] and point["violations"] == []
        assert sorted(point["instances"]) == ["decode0", "decode1", "decode2", "prefill0", "prefill1"]
        assert sum(point["instances"][f"prefill{i}"]["requests"] for i in range(2)) == point["requests"]
    # --instances sets both sides; a side's own option wins.
    both = _json(
        [*SMALL, "--flows", "ring", "--concurrency", "2", "--instances", "2", "--decode-instances", "1"]
    )
    assert (both["deployment"]["prefill_instances"], both["deployment"]["decode_instances"]) == (2, 1)


def test_knobs_say_when_the_ring_was_too_small() -> None:
    tight = _json(
        [*SMALL, "--flows", "ring", "--concurrency", "16", "--requests", "16", "--staging-chunks", "1"]
    )
    roomy = _json(
        [*SMALL, "--flows", "ring", "--concurrency", "16", "--requests", "16", "--staging-chunks", "8"]
    )
    assert tight["knobs"]["decode_ring_peak_in_use_mb"] > 0
    assert "filled up at c=16" in tight["knobs"]["sizing"]
    assert "of the ring in use" in roomy["knobs"]["sizing"]
    assert roomy["results"]["ring"][0]["staging_peak_bytes"]["ring"] > 0


def test_seed_003s_deployment_runs_from_the_command_line() -> None:
    # Qwen3.5-397B-A17B on GB200, TP 4 prefill -> DEP4 decode (experts over the four ranks).
    out = _json(
        [
            *SMALL,
            *("--model", "qwen3.5-397b-a17b", "--prefill-tp", "4", "--decode-tp", "1"),
            *("--decode-instances", "4", "--decode-ep", "4", "--gpu", "gb200", "--fp8-weights"),
            *("--max-batch", "64", "--flows", "ring,direct"),
        ]
    )
    assert out["recommendation"] == "ring"
    for flow, points in out["results"].items():
        assert all(p["completed"] == 6 and not p["violations"] for p in points), flow
    r = runner.invoke(
        app, [*SMALL, "--model", "qwen3.5-397b-a17b", "--decode-instances", "4", "--decode-ep", "3"]
    )
    assert r.exit_code != 0 and "decode_ep" in r.stdout + r.stderr


def test_serial_pull_orchestration_reaches_the_pull_runs_and_costs_its_hop() -> None:
    args = [*SMALL, "--prefill-tp", "2", "--decode-tp", "2", "--flows", "pull,push"]
    base = _json(args)
    serial = _json([*args, "--pull-orchestration", "serial", "--proxy-hop-ms", "20"])
    d = serial["deployment"]
    assert (d["pull_orchestration"], d["proxy_hop_ms"]) == ("serial", 20.0)
    assert base["deployment"]["pull_orchestration"] == "overlapped"
    for b, s in zip(base["results"]["pull"], serial["results"]["pull"], strict=True):
        assert s["completed"] == s["requests"] and not s["violations"]
        assert s["ttft_ms"]["mean"] >= b["ttft_ms"]["mean"] + 19.0  # at least the hop, per request
    # Push ignores the option (wall time aside, the runs are the same).
    assert [p["ttft_ms"] for p in serial["results"]["push"]] == [
        p["ttft_ms"] for p in base["results"]["push"]
    ]


def test_page_allocator_option_reaches_the_runs() -> None:
    args = [*SMALL, "--prefill-tp", "2", "--decode-tp", "2", "--flows", "direct"]
    assert _json(args)["deployment"]["page_allocator"] == "sglang"
    old = _json([*args, "--page-allocator", "lowest-first"])
    assert old["deployment"]["page_allocator"] == "lowest-first"
    assert all(p["completed"] == p["requests"] and not p["violations"] for p in old["results"]["direct"])
    r = runner.invoke(app, [*args, "--page-allocator", "buddy"])
    assert r.exit_code == 2 and "--page-allocator: expected one of sglang, lowest-first" in r.stderr


def test_decode_reserved_tokens_option_reaches_the_runs() -> None:
    args = [*SMALL, "--prefill-tp", "2", "--decode-tp", "2", "--flows", "direct"]
    assert _json(args)["deployment"]["decode_reserved_tokens"] == 512
    got = _json([*args, "--decode-reserved-tokens", "0"])
    assert got["deployment"]["decode_reserved_tokens"] == 0
    assert all(p["retractions"] == 0 and not p["violations"] for p in got["results"]["direct"])
    for bad in ("-1", str(1 << 21)):
        r = runner.invoke(app, [*args, "--decode-reserved-tokens", bad])
        assert r.exit_code == 2 and "--decode-reserved-tokens must be in [0, 1048576]" in r.stderr


def test_knobs_say_when_decode_ran_out_of_pages() -> None:
    from dataclasses import replace

    from kvferry.sim.deploy import workload as wl
    from kvferry.sim.deploy.run import build_scenario, simulate
    from kvferry.sim.deploy.select import knobs
    from kvferry.sim.deploy.spec import DeploySpec

    spec = DeploySpec(prefill_tp=2, decode_tp=2, flow="direct")
    lengths = (wl.DeployRequest(0, 100, 4),)
    r = simulate(spec, wl.Arrivals(concurrency=1, total=1), lengths, label="c=1")
    s = build_scenario(spec, lengths)
    calm = knobs(spec, "direct", s, [r])
    assert calm["num_reserved_decode_tokens (--num-reserved-decode-tokens)"] == 512
    assert r.retractions == 0 and "decode_memory" not in calm
    short = knobs(spec, "direct", s, [r, replace(r, label="c=64", retractions=7, swap_ms=12.4)])
    assert short["decode_memory"].startswith("decode ran out of pages at c=64: 7 retractions, 12 ms")
    old = knobs(replace(spec, page_allocator="lowest-first"), "direct", s, [r])
    assert "num_reserved_decode_tokens (--num-reserved-decode-tokens)" not in old


# A scenario's [deploy] table (sim/scenario_deploy.py): DeploySpec knobs for select.
SCENARIO = """\
name = "qwen3-8b-select"
move_bytes = false

[model]
preset = "qwen3-8b"

[topology]
prefill_tp = 2
decode_tp = 2

[workload]
rooms = 4
tokens_min = 800
tokens_max = 800
chunk_tokens = 0
"""


def _scenario(tmp_path: Path, deploy: str = "", model: str = "") -> Path:
    path = tmp_path / "s.toml"
    text = SCENARIO if not model else SCENARIO.replace('preset = "qwen3-8b"', model)
    path.write_text(text + (f"\n[deploy]\n{deploy}\n" if deploy else ""))
    return path


def test_a_scenarios_deploy_table_changes_what_select_simulates(tmp_path: Path) -> None:
    args = ["--osl", "8", "--concurrency", "2", "--flows", "direct"]
    plain = _json(["select", "--scenario", str(_scenario(tmp_path)), *args])
    assert (plain["deployment"]["gpu"], plain["deployment"]["page_allocator"]) == ("h100", "sglang")
    path = _scenario(tmp_path, 'gpu = "h200"\npage_allocator = "lowest-first"')
    # The file wins over the options, given or not, as its model and TP do.
    out = _json(["select", "--scenario", str(path), *args, "--gpu", "h100", "--page-allocator", "sglang"])
    d = out["deployment"]
    assert (d["gpu"], d["page_allocator"]) == ("h200", "lowest-first")
    assert (d["model"], d["prefill_tp"], d["decode_tp"], d["chunk_tokens"]) == ("qwen3-8b", 2, 2, 800)
    before, after = plain["results"]["direct"][0], out["results"]["direct"][0]
    assert after["completed"] == after["requests"] == 4 and not after["violations"]
    # H200's faster HBM makes memory-bound decode steps shorter.
    assert after["tpot_ms"]["p50"] < before["tpot_ms"]["p50"]


@pytest.mark.parametrize(
    ("deploy", "needle"),
    [
        ('gpuu = "h200"', "[deploy].gpuu: unknown field (did you mean 'gpu'? known: gpu, nic,"),
        ("prefill_tp = 4", "[deploy].prefill_tp: not a [deploy] key: it belongs in [topology].prefill_tp"),
        ('flow = "ring"', "[deploy].flow: not a [deploy] key: kvferry select runs and compares every"),
        ("max_batch = true", "[deploy].max_batch: expected an integer, got True"),
        ("max_batch = 64.0", "[deploy].max_batch: expected an integer, got 64.0"),
        ('ttft_slo_ms = "fast"', "[deploy].ttft_slo_ms: expected a number, got 'fast'"),
        ("proxy_hop_ms = nan", "[deploy].proxy_hop_ms: expected a finite number, got nan"),
        ("gpu = 200", "[deploy].gpu: expected a string, got 200"),
        ('page_allocator = "buddy"', "[deploy]: page_allocator: expected one of sglang, lowest-first"),
        ("decode_ep = 2", "[deploy]: decode_ep must divide decode_instances (1), got 2"),
        ("max_batch = 100000", "[deploy].max_batch must be in [1, 65536], got 100000"),
        ('gpu = "h200"', "[deploy]: needs a model preset"),
    ],
)
def test_a_bad_deploy_table_is_one_error_line(tmp_path: Path, deploy: str, needle: str) -> None:
    # A model given by its shape, not a preset: [deploy] has nothing to time it with.
    custom = 'name = "tiny"\nnum_layers = 2' if "needs a model preset" in needle else ""
    path = _scenario(tmp_path, deploy, model=custom)
    r = runner.invoke(app, ["select", "--scenario", str(path), "--json"])
    assert r.exit_code == 2 and r.stdout == ""
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: [deploy]"), r.stderr
    assert needle in lines[0], r.stderr


def test_rate_without_instance_counts_is_the_capacity_search(tmp_path: Path) -> None:
    png = tmp_path / "cap.png"
    args = ["select", "--rate", "30", "--isl", "2000", "--osl", "20", "--flows", "ring,direct"]
    args += ["--max-instances", "2", "--duration-s", "3", "--warmup-s", "1", "--max-rate-steps", "1"]
    r = runner.invoke(app, [*args, "--json", "--plot", str(png), "--jobs", "1"])
    assert r.exit_code == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "capacity" and out["rate"] == 30
    a = out["answer"]
    assert a["met"] and a["gpus"] == a["prefill_instances"] * 4 + a["decode_instances"] * 2
    d = out["deployment"]  # the deployment as answered
    assert (d["flow"], d["prefill_instances"], d["decode_instances"]) == (
        a["flow"], a["prefill_instances"], a["decode_instances"],
    )  # fmt: skip
    assert {c["flow"] for c in out["candidates"]} == {"ring", "direct"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = runner.invoke(app, [*args, "--jobs", "1"])
    assert table.exit_code == 0 and "answer: " in table.stdout and "capacity for 30 req/s" in table.stdout
    assert "identical TP groups" in " ".join(table.stdout.split())  # TP 4 -> 2: one of two ran


def test_the_table_says_when_one_tp_group_ran_and_every_rank_runs_them_all() -> None:
    """SMALL is qwen3-8b TP 4 -> 2: two identical TP groups; the caption says one ran. With the
    fabric's jitter on, one group draws fewer jitters (tests/test_deploy_groups.py has the exact
    comparison with jitter off), so a request may join a neighbouring decode step: the numbers
    agree within a step, not exactly."""
    r = runner.invoke(app, [*SMALL, "--flows", "ring"])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "identical TP groups" in " ".join(r.stdout.split())
    one = _json([*SMALL, "--flows", "ring"])
    every = _json([*SMALL, "--flows", "ring", "--every-rank"])
    assert every["deployment"]["every_rank"] is True and one["deployment"]["every_rank"] is False
    for a, b in zip(one["results"]["ring"], every["results"]["ring"], strict=True):
        assert a["completed"] == b["completed"] and a["ttft_ms"]["p50"] == pytest.approx(
            b["ttft_ms"]["p50"], rel=0.05
        )
