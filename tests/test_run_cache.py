"""The capacity search's run cache (sim/deploy/run_cache.py): a kept run is the run, any change of
its job or of the code is another entry, a broken entry is simulated again, and the CLI's answer
from kept runs is the answer from simulated ones."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim.deploy import capacity, run_cache
from kvferry.sim.deploy.capacity import Runner, Workload, steady_runs
from kvferry.sim.deploy.run_cache import RunCache
from kvferry.sim.deploy.spec import DeploySpec
from typer.testing import CliRunner

from kvferry.cli import _register, app

_register()
runner = CliRunner()

SPEC = DeploySpec(model="qwen3-8b", prefill_tp=1, decode_tp=1, flow="direct", ttft_slo_ms=1000.0)
W = Workload(isl=1024, osl=2, duration_s=3.0, warmup_s=1.0)
JOB = (SPEC, 4.0, W, (1,), 0.9)


def _same(a: object, b: object) -> bool:
    """Equal results, NaN percentiles included (NaN != NaN for ==)."""
    return msgspec.msgpack.encode(a) == msgspec.msgpack.encode(b)


@pytest.fixture(scope="module")
def simulated() -> list:
    return steady_runs(SPEC, 4.0, W, (1,), 0.9)


def test_a_kept_run_is_the_run(tmp_path: Path, simulated: list) -> None:
    cache = RunCache(tmp_path)
    assert cache.get(JOB) is None and (cache.hits, cache.misses) == (0, 1)
    cache.put(JOB, simulated)
    got = cache.get(JOB)
    assert got is not None and _same(got, simulated) and cache.hits == 1
    assert got[0].completed == simulated[0].completed > 0


# Every field of a job a search varies: a change of any one must be another entry.
_CHANGES = {
    "rate": lambda j: (j[0], j[1] * 1.01, *j[2:]),
    "seed": lambda j: (*j[:3], (2,), j[4]),
    "target": lambda j: (*j[:4], 0.95),
    "flow": lambda j: (replace(j[0], flow="ring"), *j[1:]),
    "instances": lambda j: (replace(j[0], prefill_instances=2), *j[1:]),
    "isl": lambda j: (j[0], j[1], replace(j[2], isl=2048), *j[3:]),
    "duration": lambda j: (j[0], j[1], replace(j[2], duration_s=4.0), *j[3:]),
}


def _every_change_misses(cache: RunCache, results: list, change: str) -> bool:
    cache.put(JOB, results)
    return cache.get(_CHANGES[change](JOB)) is None


@settings(max_examples=len(_CHANGES) * 2)
@given(change=st.sampled_from(sorted(_CHANGES)))
def test_any_change_of_the_job_is_another_entry(
    tmp_path_factory: pytest.TempPathFactory, simulated: list, change: str
) -> None:
    assert _every_change_misses(RunCache(tmp_path_factory.mktemp("c")), simulated, change)


def test_a_key_that_forgets_a_field_is_caught(tmp_path: Path, simulated: list) -> None:
    """The check above can fail: a planted key that hashes the spec alone hits on a new rate."""

    class RateBlind(RunCache):
        def key(self, job: run_cache.Job) -> str:
            return super().key((job[0], 0.0, job[2], job[3], job[4]))

    assert not _every_change_misses(RateBlind(tmp_path), simulated, "rate")


def test_other_code_is_another_entry(
    tmp_path: Path, simulated: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = RunCache(tmp_path)
    cache.put(JOB, simulated)
    monkeypatch.setattr(run_cache, "_digest", "0" * 64)  # as if a source file had changed
    assert cache.get(JOB) is None


def test_the_code_digest_covers_the_simulator_and_its_profiles(tmp_path: Path) -> None:
    import kvferry.sim.deploy.capacity as cap_mod
    from kvferry.backends.simfabric import fabric

    files = run_cache.digested_files()
    paths = {p for _, p in files}
    for needed in (Path(cap_mod.__file__), Path(fabric.__file__)):
        assert needed.resolve() in paths, needed
    assert any(name.endswith("sim/deploy/profiles/h100.toml") for name, _ in files)
    assert run_cache.code_digest() == run_cache.digest_of(files)
    # One byte more in any of them (a copy: the tree is not touched) is another digest.
    copy = tmp_path / "fabric.py"
    copy.write_bytes(Path(fabric.__file__).read_bytes() + b"#")
    changed = [(n, copy if p == Path(fabric.__file__).resolve() else p) for n, p in files]
    assert run_cache.digest_of(changed) != run_cache.code_digest()


def test_a_broken_entry_is_simulated_again_and_rewritten(tmp_path: Path, simulated: list) -> None:
    cache = RunCache(tmp_path)
    cache.put(JOB, simulated)
    path = next(tmp_path.rglob("*.msgpack"))
    path.write_bytes(path.read_bytes()[:40])  # cut short, as a full disk might leave it
    assert cache.get(JOB) is None and cache.bad == 1
    cache.put(JOB, simulated)
    assert _same(cache.get(JOB), simulated)
    assert not list(tmp_path.rglob(".part-*"))  # no temporary file left behind


def test_the_runner_simulates_only_what_is_not_kept_and_keeps_the_order(
    tmp_path: Path, simulated: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []
    real = capacity._runs

    def counted(job: capacity.Job) -> list:
        calls.append(job[1])
        return real(job)

    monkeypatch.setattr(capacity, "_runs", counted)
    cache = RunCache(tmp_path)
    cache.put(JOB, simulated)  # the middle job is kept
    jobs = [(SPEC, 3.0, W, (1,), 0.9), JOB, (SPEC, 5.0, W, (1,), 0.9)]
    got = Runner(1, cache).map(jobs)
    assert calls == [3.0, 5.0]
    assert _same(got[1], simulated) and got[0][0].label == "3 req/s" and got[2][0].label == "5 req/s"
    again = Runner(1, cache).map(jobs)
    assert calls == [3.0, 5.0] and _same(again, got)  # everything kept now


ASK = ["select", "--rate", "20", "--isl", "2000", "--osl", "20", "--flows", "direct"]
ASK += ["--max-instances", "2", "--duration-s", "3", "--warmup-s", "1", "--max-rate-steps", "1"]
ASK += ["--jobs", "1"]


def test_the_same_question_again_is_answered_from_kept_runs(tmp_path: Path) -> None:
    def ask() -> dict:
        r = runner.invoke(app, [*ASK, "--cache-dir", str(tmp_path), "--json"])
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "run cache " in r.stderr  # said on stderr
        return json.loads(r.stdout)

    first, second = ask(), ask()
    a, b = first.pop("run_cache"), second.pop("run_cache")
    assert a["kept"] == 0 and a["simulated"] > 0
    assert b == {"dir": str(tmp_path), "kept": a["simulated"], "simulated": 0}
    assert first == second


def test_no_cache_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path))
    r = runner.invoke(app, [*ASK, "--no-cache", "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["run_cache"] is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cache-dir", "FILE"], "--cache-dir: cannot keep runs in"),
        (["--no-cache", "--instances", "1"], "--no-cache is the capacity search's"),
        (["--cache-dir", "x", "--instances", "1"], "--cache-dir is the capacity search's"),
    ],
)
def test_bad_cache_options_are_one_error_line(tmp_path: Path, args: list[str], needle: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = [str(blocker / "runs") if a == "FILE" else a for a in args]
    r = runner.invoke(app, [*ASK, *args])
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_a_write_that_fails_leaves_nothing_behind(
    tmp_path: Path, simulated: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(_src: object, _dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_cache.os, "replace", full)
    cache = RunCache(tmp_path)
    cache.put(JOB, simulated)  # not an error: the search goes on
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    assert cache.get(JOB) is None
