"""One contract for every option of every subcommand: bad input is ONE ``error: ...`` line on
stderr and exit status 2 -- never a traceback, never an unbounded allocation, never a nonsensical
value accepted in silence.

A table of known-bad invocations (each a bug a user met, or found reading the options), then a
property test that feeds every int, string and path option (found by walking the typer app)
negative, huge, empty, NUL-laden and odd values and checks the contract whatever happens.
``bench nixl`` never starts NIXL processes here: ``run_config`` is replaced by a stub, so a value
that happens to be valid only exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kvferry.backends.runtime import interference
from kvferry.sim.campaign import parse_seeds
from kvferry.sim.deploy import report as deploy_report
from typer.testing import CliRunner

from kvferry.cli import _register, app
from kvferry.tools import hostile, runtime_bench
from kvferry.tools import soak as loopback_soak
from kvferry.tools.chaos import netns
from kvferry.tools.chaos import run as chaos_run

ROOT = Path(__file__).resolve().parent.parent
QUICK = str(ROOT / "scenarios" / "quickstart.toml")
TELEMETRY = str(ROOT / "tests" / "data" / "telemetry-cpu-loopback.json")
BENCH_ROWS = str(ROOT / "tests" / "data" / "bench-nixl-two-rows.jsonl")
_register()
runner = CliRunner()
_REAL_RUN_CHAOS = chaos_run.run_chaos

# Run in a subprocess under a memory cap and a timeout: if their bound regressed they would take
# tens of GB or hours, which must fail this test, not the machine.
HAZARDS = [
    (["plan", "--model", "qwen3-8b", "--tokens", "99999999999"], "at most 4,194,304 pages"),
    (["plan", "--model", "qwen3-8b", "--decode-tp", str(10**15)], "TP up to 1024"),
    (["plan", "--layers", str(10**15), "--kv-heads", "8", "--head-dim", "8"], "up to 1024"),
    (["plan", "--layers", "2", "--kv-heads", str(10**15), "--head-dim", "8"], "up to 1024"),
    (["fuzz", "--seeds", "0-99999999999"], "at most 10,000,000"),
    (["plan", "--tokens", "abc"], "Invalid value for '--tokens'"),  # typer's own parse error
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("cli")
    (d / "binary.toml").write_bytes(bytes(range(256)) * 4)
    (d / "notes.toml").write_text("this is = = not toml\n")
    (d / "a-file").write_text("x")
    # calibrate: a row lacking a field, and telemetry of one transfer size only
    row = {
        "status": "DONE",
        "descs_requested": 1,
        "descs_posted": 1,
        "post_us": 1,
        "xfer_us": 2,
        "wall_ns": 9,
    }
    (d / "no-nbytes.json").write_text(json.dumps({"writes": [row]}))
    (d / "one-size.json").write_text(json.dumps({"writes": [{**row, "nbytes": 4096}] * 3}))
    return {
        "no_nbytes": str(d / "no-nbytes.json"),
        "one_size": str(d / "one-size.json"),
        "dir": str(d),
        "binary": str(d / "binary.toml"),
        "not_toml": str(d / "notes.toml"),
        "file": str(d / "a-file"),
        "missing": str(d / "no-such-file.toml"),
        "missing_dir_file": str(d / "no-such-folder" / "out.json"),
    }


def _fake_run_config(cfg: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    runtime_bench.check_config(cfg)  # what the real one does first
    return {
        "config": cfg.name,
        "mem": cfg.mem,
        "tokens": cfg.tokens,
        "room_mb": 1.0,
        "inflight": cfg.inflight,
        "kvferry_gbps": 1.0,
        "kvferry_s": 1.0,
        "raw_gbps": 1.0,
        "raw_s": 1.0,
        "ratio": 1.0,
        "descs_requested": 1,
        "descs_posted": 1,
        "bytes_ok": True,
    }


def _fake_run_soak(cfg: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    loopback_soak.check_config(cfg)  # what the real one does first
    return {
        "ok": True,
        "config": {**vars(cfg), "flows": list(cfg.flows)},
        "rooms_run": 0,
        "stopped_by_time": False,
        "interrupted": False,
        "wall_s": 0.0,
        "rooms_per_s": 0.0,
        "outcomes": {"success": 0, "aborted": 0, "killed": 0, "violation": 0},
        "by_flow": {},
        "kills": [],
        "rss": [],
        "end_state": {},
        "violation_count": 0,
        "violations": [],
        "replay": loopback_soak.replay_command(cfg),
    }


def _fake_interference(cfg: Any) -> dict[str, Any]:
    return {
        "executor": [cfg.engine],
        "rooms_moved": 0,
        "rooms_per_s": 0.0,
        "rooms_failed": 0,
        "lost_us_per_room": None,
        **{f"{p}_{k}": 1.0 for p in ("idle", "busy") for k in ("ratio_median", "ratio_min", "ratio_max")},
        **{f"{p}_step_us_median": 1.0 for p in ("absent", "idle", "busy")},
    }


def _fake_run_chaos(cfg: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The real run up to making the hosts: its checks, the seeded fault schedule and the report
    (of no rooms); the processes and namespaces cost seconds a value, one real run is below."""
    chaos_run.check_config(cfg)
    return chaos_run.Chaos(cfg, None)._report([], [], False)


def _small_plot(_sel: Any, path: Path) -> None:
    """``select --plot``'s file, written as the real plot writes it (matplotlib's savefig, PNG
    whatever the name) but of a blank 1-inch figure: the path is what the option rows vary, and
    drawing the two full panels cost ~2 s a valid path (tests/test_select.py draws them)."""
    plt = deploy_report._pyplot()
    fig = plt.figure(figsize=(1, 1))
    fig.savefig(path, dpi=10, format="png")
    plt.close(fig)


def _fake_live_fuzz(cfg: Any, *args: Any, **kwargs: Any) -> hostile.LiveFuzzResult:
    assert not cfg.problems()  # the command validated first
    return hostile.LiveFuzzResult(seed=cfg.seed)


@pytest.fixture(scope="module", autouse=True)
def _no_real_bench() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setattr(runtime_bench, "run_config", _fake_run_config)
    mp.setattr(loopback_soak, "run_soak", _fake_run_soak)
    mp.setattr(hostile, "run_live_fuzz", _fake_live_fuzz)
    mp.setattr(interference, "run", _fake_interference)
    mp.setattr(chaos_run, "run_chaos", _fake_run_chaos)
    mp.setattr(deploy_report, "plot", _small_plot)
    yield
    mp.undo()


@contextlib.contextmanager
def _memory_cap(extra: int = 4 << 30) -> Iterator[None]:
    """Address space capped at what the process has now plus ``extra``: a regressed bound fails
    with MemoryError instead of taking the shared machine's memory."""
    try:
        import resource

        vsz = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError):  # not Linux: run uncapped
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_AS)
    cap = vsz + extra if old[1] == resource.RLIM_INFINITY else min(vsz + extra, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def _check_contract(code: int, stdout: str, stderr: str, exc: BaseException | None = None) -> None:
    assert "Traceback" not in stdout + stderr, stdout + stderr
    assert exc is None or isinstance(exc, SystemExit), repr(exc)
    assert code in (0, 1, 2), (code, stderr)
    if code == 2:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr


def _invoke(args: list[str]) -> tuple[int, str, str]:
    with _memory_cap():
        r = runner.invoke(app, args)
    _check_contract(r.exit_code, r.stdout, r.stderr, r.exception)
    return r.exit_code, r.stdout, r.stderr


# (args, a piece of the message); {name} is filled from the ``files`` fixture.
BAD = [
    # plan
    (["plan", "--model", "qwen3-8b", "--tokens", "10000000"], "kvferry plan stops at"),
    (["plan", "--model", "qwen3-8b", "--tokens", "1" * 300], "pages"),
    (["plan", "--model", "qwen3-8b", "--tokens", "0"], "--tokens"),
    (["plan", "--model", "qwen3-8b", "--tokens", "1.5"], "Invalid value for '--tokens'"),
    (["plan", "--model", "qwen3-8b", "--prefill-tp", "0"], "TP size must be a positive integer"),
    (["plan", "--model", "qwen3-8b", "--decode-tp", "-1"], "TP size must be a positive integer"),
    (["plan", "--model", "qwen3-8b", "--decode-tp", "8000000"], "TP up to 1024"),
    (["plan", "--model", "qwen3-8b", "--page-size", str(10**15)], "2**48"),
    (["plan", "--model", "qwen3-8b", "--prefill-page-size", "-3"], "page_size"),
    (["plan", "--model", "qwen3-8b", "--seed", "-1"], "--seed"),
    (["plan", "--model", "qwen3-8b", "--seed", "-1", "--fragmented"], "--seed"),
    (["plan", "--layers", "2", "--kv-heads", "8", "--head-dim", str(10**15)], "2**48"),
    (["plan", "--layers", "-1", "--kv-heads", "8", "--head-dim", "8"], "num_layers"),
    (["plan", "--model", "qwen3-8b", "--chunk-tokens", "-1"], "--chunk-tokens"),
    (["plan", "--model", "deepseek-v3", "--tokens", "4194304", "--page-size", "1", "--fragmented"], "runs"),
    (["plan", "--model", ""], "unknown model preset"),
    (["plan", "--model", "qwen3-8b", "--dtype", "bogus"], "--dtype"),
    (["plan", "--model", "qwen3-8b", "--prefill-layout", "x"], "--prefill-layout"),
    (["plan", "--layers", "2"], "--kv-heads"),
    # replay
    (["replay", "{binary}"], "not a text (UTF-8) file"),
    (["replay", "{dir}"], "is a directory"),
    (["replay", ""], "is a directory"),
    (["replay", "{missing}"], "no such file"),
    (["replay", "{not_toml}"], "not valid TOML"),
    (["replay", "bad\0name.toml"], "null byte"),
    (["replay"], "Missing argument"),
    (["replay", QUICK, "--trace", "{missing_dir_file}"], "does not exist"),
    (["replay", QUICK, "--trace", "{dir}"], "is a directory"),
    (["replay", QUICK, "--trace", ""], "is a directory"),
    (["replay", QUICK, "--trace", "a\0b"], "null byte"),
    (["replay", QUICK, "--seed", "-1"], "--seed"),
    (["replay", QUICK, "--seed", str(2**63)], "--seed"),
    (["replay", QUICK, "--flow", "bogus"], "--flow"),
    # demo
    (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--trace", "{missing_dir_file}"], "does not exist"),
    (["demo", "--trace", ""], "is a directory"),
    # fuzz
    (["fuzz", "--seeds", "5-1"], "bad seed range"),
    (["fuzz", "--seeds", ""], "no seeds given"),
    (["fuzz", "--seeds", "abc"], "bad seed range"),
    (["fuzz", "--seeds", "-3"], "bad seed range"),
    (["fuzz", "--seeds", "0-3\n,x"], "bad seed range"),
    (["fuzz", "--seeds", str(2**63)], "2**63"),
    (["fuzz", "--seeds", "0-0", "--jobs", "0"], "--jobs"),
    (["fuzz", "--seeds", "0-0", "--jobs", "-1"], "--jobs"),
    (["fuzz", "--seeds", "0-0", "--jobs", str(10**15)], "--jobs"),
    (["fuzz", "--seeds", "0-0", "--scenario", "{dir}"], "is a directory"),
    (["fuzz", "--seeds", "0-0", "--scenario", "{binary}"], "not a text (UTF-8) file"),
    (["fuzz", "--seeds", "0-0", "--save-dir", "{file}"], "not a folder"),
    (["fuzz", "--seeds", "0-0", "--plant", "bogus"], "--plant"),
    # bench nixl (validation only: run_config is a stub here)
    (["bench", "nixl", "--mem", "HBM"], "--mem must be DRAM or VRAM"),
    (["bench", "nixl", "--mem", ""], "--mem must be DRAM or VRAM"),
    (["bench", "nixl", "--model", "gpt-5"], "model must be one of"),
    (["bench", "nixl", "--tokens", "-5"], "tokens must be in"),
    (["bench", "nixl", "--tokens", "0"], "tokens must be in"),
    (["bench", "nixl", "--tokens", str(10**15)], "tokens must be in"),
    (["bench", "nixl", "--tokens", "abc"], "Invalid value for '--tokens'"),
    (["bench", "nixl", "--rooms", "-1"], "--rooms"),
    (["bench", "nixl", "--rooms", "1000000"], "rooms must be in"),
    (["bench", "nixl", "--inflight", "0"], "inflight must be in"),
    (["bench", "nixl", "--inflight", "65"], "inflight must be in"),
    (["bench", "nixl", "--worker-chunks", "0"], "worker_chunks must be in"),
    (["bench", "nixl", "--worker-chunks", "65"], "worker_chunks must be in"),
    (["bench", "nixl", "--inflight", "64", "--tokens", "131072"], "GiB"),
    (["bench", "nixl", "--chunk-tokens", "-1"], "chunk_tokens"),
    (["bench", "nixl", "--direct-post", "fast"], "direct_post must be one of auto, prepped, oneshot"),
    (["bench", "nixl", "--active-poll-us", "-1"], "active_poll_us must be in"),
    (["bench", "nixl", "--active-poll-us", "2e6"], "active_poll_us must be in"),
    (["bench", "nixl", "--config", "bogus"], "unknown configuration"),
    (["bench", "nixl", "--telemetry", "{dir}"], "is a directory"),
    (["bench", "nixl", "--telemetry", "{missing_dir_file}"], "does not exist"),
    (["bench", "nixl", "--trace", "{file}"], "is a file, not a folder"),
    # calibrate and bench predict
    (["calibrate", "{missing}", "--name", "x"], "no such file"),
    (["calibrate", "{dir}", "--name", "x"], "is a directory"),
    (["calibrate", "{not_toml}", "--name", "x"], "not valid JSON"),
    (["calibrate", "{binary}", "--name", "x"], "cannot read"),
    (["calibrate", BENCH_ROWS, "--name", "x"], "not valid JSON"),
    (["calibrate", "{no_nbytes}", "--name", "x"], "writes[0]: missing 'nbytes'"),
    (["calibrate", "{one_size}", "--name", "x"], "1 distinct transfer size(s)"),
    (["calibrate", TELEMETRY], "--name is required"),
    (["calibrate", TELEMETRY, "--name", "Bad Name"], "a profile name is"),
    (["calibrate", TELEMETRY, "--name", "h100"], "not a fitted profile (gpu)"),
    (["calibrate", TELEMETRY, "--name", "h100-rdma"], "every scenario without a [fabric] profile"),
    (["calibrate", TELEMETRY, "--name", "x", "--out", "{file}"], "not a fitted profile"),
    (["calibrate", TELEMETRY, "--name", "x", "--out", "{missing_dir_file}"], "does not exist"),
    (["calibrate", TELEMETRY, "--name", "x", "--out", "{dir}/p.toml", "--compare", BENCH_ROWS], "drop --out"),
    (["calibrate", TELEMETRY, "--name", "x", "--out", "{dir}/p.toml", "--rooms", BENCH_ROWS], "fewer than 3"),
    (["calibrate", TELEMETRY, "--name", "x", "--out", "{dir}/p.toml", "--rooms", TELEMETRY], "missing 'tp'"),
    (
        ["calibrate", TELEMETRY, "--name", "x", "--out", "{dir}/p.toml", "--rooms", "{missing}"],
        "no such file",
    ),
    (
        ["calibrate", TELEMETRY, "--name", "x", "--out", "{dir}/p.toml", "--kernels", TELEMETRY],
        "not a kernel",
    ),
    (["select", "--control-path", "bogus"], "unknown hardware profile"),
    (["select", "--control-path", "h100"], "not a fabric profile"),
    (["bench", "predict", "{missing}"], "no such file"),
    (["bench", "predict", "{not_toml}"], "line 1: not valid JSON"),
    (["bench", "predict", TELEMETRY], "missing 'tp'"),
    (["bench", "predict", BENCH_ROWS, "--profile", "bogus"], "unknown fabric profile"),
    (["bench", "predict", BENCH_ROWS, "--tp-pairs", "--all-tp"], "two groupings"),
    # soak (validation only: run_soak is a stub here)
    (["soak", "--rooms", "0"], "--rooms must be in"),
    (["soak", "--rooms", "-5"], "--rooms must be in"),
    (["soak", "--rooms", str(10**9)], "--rooms must be in"),
    (["soak", "--prefill-tp", "3"], "--prefill-tp must be 1, 2 or 4"),
    (["soak", "--decode-tp", "0"], "--decode-tp must be 1, 2 or 4"),
    (["soak", "--flows", "ring,rnig"], "unknown flow"),
    (["soak", "--flows", ","], "--flows"),
    (["soak", "--abort-rate", "1.5"], "--abort-rate"),
    (["soak", "--abort-rate", "nan"], "--abort-rate"),
    (["soak", "--kill-every", "3"], "--kill-every must be 0"),
    (["soak", "--hold", "0"], "--hold must be in"),
    (["soak", "--hold", "17"], "--hold must be in"),
    (["soak", "--max-seconds", "0"], "--max-seconds"),
    (["soak", "--max-seconds", "inf"], "--max-seconds"),
    (["soak", "--rss-bound-mb", "0"], "--rss-bound-mb"),
    (["soak", "--warmup-s", "-1"], "--warmup-s"),
    (["soak", "--seed", "-1"], "--seed"),
    (["soak", "--rooms", "abc"], "Invalid value for '--rooms'"),
    # fuzz-live (validation only: run_live_fuzz is a stub here)
    (["fuzz-live", "--frames", "-1"], "--frames must be in"),
    (["fuzz-live", "--rooms", "0"], "--rooms must be in"),
    (["fuzz-live", "--max-seconds", "0"], "--max-seconds must be in"),
    (["fuzz-live", "--max-seconds", "nan"], "--max-seconds must be in"),
    (["fuzz-live", "--seed", "-1"], "--seed must be in"),
    # the root and version
    (["bogus"], "No such command"),
    (["--bogus"], "No such option"),
    (["version", "--bogus"], "No such option"),
    (["version", "extra"], "unexpected extra argument"),
]


@pytest.mark.parametrize(("args", "match"), BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_known_bad_input_is_one_error_line(args: list[str], match: str, files: dict[str, str]) -> None:
    code, _, err = _invoke([a.format(**files) if "{" in a else a for a in args])
    assert code == 2
    assert match in err


def test_vram_without_a_gpu_is_an_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --mem VRAM is valid here")
    code, _, err = _invoke(["bench", "nixl", "--mem", "VRAM"])
    assert code == 2 and "needs a CUDA GPU" in err


@pytest.mark.parametrize(("args", "match"), HAZARDS, ids=[" ".join(a)[:60] for a, _ in HAZARDS])
def test_hazards_fail_fast_through_the_real_entry_point(args: list[str], match: str) -> None:
    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    r = subprocess.run(
        [sys.executable, "-c", "from kvferry.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=cap if sys.platform == "linux" else None,
    )
    _check_contract(r.returncode, r.stdout, r.stderr)
    assert r.returncode == 2 and match in r.stderr


def test_good_input_still_runs(files: dict[str, str]) -> None:
    trace = Path(files["dir"]) / "t.json"
    assert _invoke(["replay", QUICK, "--trace", str(trace), "--json"])[0] == 0 and trace.exists()
    assert _invoke(["plan", "--model", "qwen3-8b", "--tokens", "466033", "--json"])[0] == 0
    assert _invoke(["bench", "nixl", "--mem", "dram", "--json", "--rooms", "2"])[0] == 0
    profile = Path(files["dir"]) / "fitted.toml"
    assert (
        _invoke(["calibrate", TELEMETRY, "--name", "t", "--out", str(profile)])[0] == 0 and profile.exists()
    )
    assert _invoke(["bench", "predict", BENCH_ROWS])[0] == 0
    code, out, _ = _invoke(["soak", "--rooms", "10", "--kill-every", "0"])
    assert code == 0 and "verdict: OK" in out
    code, out, _ = _invoke(["fuzz", "--seeds", "0-0", "--jobs", "1", "--json"])
    assert code == 0 and '"seeds": 1' in out


def test_chaos_runs_for_real_with_the_largest_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The option rows below stop ``kvferry chaos`` before its hosts and processes (a stub, as
    for the other commands that start processes); the largest valid seed goes through a real run."""
    monkeypatch.setattr(chaos_run, "run_chaos", _REAL_RUN_CHAOS)
    code, out, err = _invoke(["chaos", *BASE[("chaos",)], "--seed", str(2**63 - 1)])
    if netns.why_not_available():
        assert code == 2 and "chaos: " in err
    else:
        assert code == 0 and json.loads(out)["ok"] and json.loads(out)["rooms_run"] == 1, err


# ---- every option, generated values --------------------------------------------------------------


def _walk(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _walk(sub, (*path, name))
    else:
        yield path, cmd


def _kind(param: Any) -> str | None:
    """int, float, str or path; None for flags (nothing to feed them)."""
    if getattr(param, "is_flag", False):
        return None
    ann = param.type_descriptor.annotation if hasattr(param, "type_descriptor") else None
    if ann is None:  # typer on click: the click type's name
        return {"integer": "int", "float": "float", "path": "path"}.get(param.type.name, "str")
    if typing.get_origin(ann) is list:
        (ann,) = typing.get_args(ann)
    if ann is bool:
        return None
    if isinstance(ann, type) and issubclass(ann, Path):
        return "path"
    return {int: "int", float: "float"}.get(ann, "str")


# The cheapest run of each command, which the option under test then overrides.
BASE = {
    ("plan",): ["--model", "qwen3-8b", "--tokens", "16", "--json"],
    ("fuzz",): ["--seeds", "0-0", "--json"],
    ("replay",): [QUICK, "--json"],
    ("demo",): ["--json"],
    ("bench", "nixl"): ["--json"],
    ("bench", "predict"): [BENCH_ROWS, "--json"],
    ("bench", "interference"): ["--json"],
    ("calibrate",): [TELEMETRY, "--name", "t", "--out", "p.toml", "--json"],
    ("version",): [],
    ("soak",): ["--rooms", "1", "--json"],
    ("fuzz-live",): ["--rooms", "1", "--frames", "1", "--json"],
    ("chaos",): ["--rooms", "1", "--tp", "1-1", "--fault-share", "0", "--json"],
    ("select",): ["--concurrency", "1", "--requests", "1", "--isl", "16", "--osl", "2", "--json"],
}

OPTIONS = [
    (path, p.opts[0] if p.param_type_name == "option" else None, kind)
    for path, cmd in _walk(typer.main.get_command(app))
    for p in cmd.params
    if (kind := _kind(p)) is not None
]


def test_every_command_and_option_is_covered() -> None:
    assert {path for path, _ in _walk(typer.main.get_command(app))} == set(BASE)
    names = {(path, opt) for path, opt, _ in OPTIONS}
    for must in [
        (("plan",), "--tokens"),
        (("fuzz",), "--jobs"),
        (("replay",), None),
        (("bench", "nixl"), "--mem"),
        (("soak",), "--kill-every"),
        (("fuzz-live",), "--frames"),
    ]:
        assert must in names


_ODD = st.text(
    alphabet=st.sampled_from([*"09-,. /\\x", "\0", "\n", "\t", "\x1b", "é", "💥", "٣", "\u202e"]),
    max_size=12,
)
_INTS = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=10**9),
    st.sampled_from([-1, 2**31, 2**63 - 1, 2**63, 2**64, 10**15, 10**100]),
)
_STRINGS = st.one_of(
    _ODD, st.sampled_from(["", " ", "\0", "a\nb", "-1", "--json", "0-99999999999", "DRAM ", "hbm"])
)


def _values(kind: str) -> st.SearchStrategy[str]:
    if kind in ("int", "float"):
        nums = st.one_of(_INTS.map(str), st.sampled_from(["1.5", "nan", "inf", "-inf", "1e400", "0x10"]))
        return st.one_of(nums, _STRINGS)
    if kind == "path":
        return st.one_of(
            st.sampled_from(["{dir}", "{binary}", "{not_toml}", "{file}", "{missing}", "{missing_dir_file}"]),
            st.sampled_from(["", ".", "/", "\0", "a\0b", "{file}/below-a-file"]),
            _ODD,
        )
    return _STRINGS


@pytest.mark.parametrize(
    ("path", "opt", "kind"), OPTIONS, ids=[f"{' '.join(p)} {o or 'ARG'}" for p, o, _ in OPTIONS]
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_option_keeps_the_contract(
    path: tuple[str, ...], opt: str | None, kind: str, files: dict[str, str], data: st.DataObject
) -> None:
    value = data.draw(_values(kind), label=opt or "argument")
    if "{" in value and "}" in value:
        value = value.format(**files)
    if opt == "--seeds":  # a valid range is a campaign: keep to a few seeds
        with contextlib.suppress(ValueError):
            assume(len(parse_seeds(value)) <= 3)
    base = BASE[path]
    # The scenario argument replaces the base's, after '--' so that '-x' is a value.
    args = [*path, *base[1:], "--", value] if opt is None else [*path, *base, opt, value]
    # Relative paths that turn out valid (a trace, a save dir) land in a throwaway folder.
    with tempfile.TemporaryDirectory(dir=files["dir"]) as cwd, contextlib.chdir(cwd):
        _invoke(args)
