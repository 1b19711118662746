"""The executor seam without Ray: the per-item ledger (a stateful property test), the local
executor (results, a worker process killed mid-map, errors), seeds giving the same results on
any number of jobs, and the ``fuzz --ray`` errors that need no cluster."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvferry.sim import campaign as cp
from kvferry.sim import executors as ex
from typer.testing import CliRunner

from kvferry.cli import _register, app
from tests import executor_jobs as fns

_register()
runner = CliRunner()

# ---- the ledger -----------------------------------------------------------------------------------


class LedgerMachine(RuleBasedStateMachine):
    """Results and lost workers in any order, duplicates included: every item comes out once."""

    def __init__(self) -> None:
        super().__init__()
        self.items = list(range(6))
        self.max_attempts = 3
        self.fresh()

    def fresh(self) -> None:
        self.ledger: ex.Ledger[int] = ex.Ledger(self.items, self.max_attempts)
        self.yielded: Counter[int] = Counter()
        self.losses: Counter[int] = Counter()
        self.gave_up = False
        self.resent = 0

    @precondition(lambda self: not self.gave_up)
    @rule(item=st.integers(0, 5))
    def result_arrives(self, item: int) -> None:
        first = self.ledger.deliver(item)
        assert first == (self.yielded[item] == 0)
        if first:
            self.yielded[item] += 1

    @precondition(lambda self: not self.gave_up)
    @rule(batch=st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True))
    def worker_lost(self, batch: list[int]) -> None:
        """A worker holding ``batch`` died (delivered items among them: a late report)."""
        owed = [i for i in batch if not self.yielded[i]]
        self.losses.update(owed)
        spent = [i for i in owed if self.losses[i] >= self.max_attempts]
        if spent:
            with pytest.raises(ex.WorkerLost) as info:
                self.ledger.lost(batch)
            named = str(info.value)
            assert all(repr(i) in named for i in spent) and "lost its worker 3 time" in named
            self.gave_up = True
        else:
            assert self.ledger.lost(batch) == owed
            self.resent += len(owed)

    @precondition(lambda self: self.gave_up)
    @rule()
    def next_map(self) -> None:
        self.fresh()

    @invariant()
    def counted_once(self) -> None:
        s = self.ledger.stats
        assert all(n == 1 for n in self.yielded.values())
        assert s.done == sum(self.yielded.values()) and s.resent == self.resent
        assert set(self.ledger.owed) == {i for i in self.items if not self.yielded[i]}
        assert self.ledger.finished == (s.done == s.total)


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_items_must_differ() -> None:
    with pytest.raises(ValueError, match="given twice"):
        ex.Ledger([1, 2, 1], 3)


# ---- the local executor ---------------------------------------------------------------------------


@pytest.mark.parametrize("jobs", [1, 2])
def test_local_map_yields_every_item_once(jobs: int) -> None:
    seen: list[ex.MapStats] = []
    out = list(ex.LocalExecutor(jobs, chunksize=3).map(fns.square, range(20), progress=seen.append))
    assert sorted(out) == [(i, i * i) for i in range(20)]
    assert seen[-1].done == seen[-1].total == 20 and len(seen) == 20


@pytest.mark.parametrize("jobs", [1, 2])
def test_an_error_in_the_function_propagates(jobs: int) -> None:
    with pytest.raises(ValueError, match="bad item 7"):
        list(ex.LocalExecutor(jobs).map(functools.partial(fns.fail_on, 7), range(10)))


def test_local_worker_killed_mid_map_loses_nothing(tmp_path: Path) -> None:
    doomed = frozenset({3, 11})
    stats: list[ex.MapStats] = []
    pool = ex.LocalExecutor(2, chunksize=2)
    fn = functools.partial(fns.die_once, str(tmp_path), doomed)
    out = list(pool.map(fn, range(16), progress=stats.append))
    assert Counter(i for i, _ in out) == Counter(range(16))  # each once
    assert dict(out) == {i: i * i for i in range(16)}
    assert all((tmp_path / f"{i}.died").exists() for i in doomed)
    # Every item ran to completion at least once; a resent chunk may re-run a finished neighbour
    # whose result died with the pool, but it is yielded once.
    assert all((tmp_path / f"{i}.runs").exists() for i in range(16))
    assert stats[-1].resent >= len(doomed) and stats[-1].done == 16


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_in_a_map_terminates_its_workers(tmp_path: Path) -> None:
    """Ctrl-C (here raised in the progress callback once both workers hold a run that waits): the
    map ends with its workers gone, and nothing queued to them starts. Shutting the pool down
    without waiting left them running what had been handed to them (20 s and more in a fuzz)."""
    jobs = 2

    def started() -> list[Path]:
        return sorted(tmp_path.glob("*.started"))

    def ctrl_c(_: ex.MapStats) -> None:  # item 0 finished; items 1 and 2 are running
        give_up = time.monotonic() + 120  # a guard against hanging, not a measurement
        while len(started()) < jobs and time.monotonic() < give_up:
            time.sleep(0.02)
        raise KeyboardInterrupt

    fn = functools.partial(fns.wait_for_release, str(tmp_path))
    try:
        with pytest.raises(KeyboardInterrupt):
            list(ex.LocalExecutor(jobs, chunksize=1).map(fn, range(40), progress=ctrl_c))
        pids = {int(p.read_text()) for p in started()}
        assert len(started()) == len(pids) == jobs  # the two in flight, each on its own worker
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        (tmp_path / "release").touch()  # workers left running (the old way) finish and exit


def test_an_item_that_always_kills_its_worker_is_named() -> None:
    # Every item in flight at a loss is charged: the error names 5, perhaps with its neighbours.
    with pytest.raises(ex.WorkerLost, match=r"(item 5|one of items \[.*\b5\b.*\]) lost its worker 2 time"):
        list(ex.LocalExecutor(2, chunksize=1, max_attempts=2).map(fns.always_dies_on_5, range(8)))


def test_fuzz_names_a_seed_that_kills_its_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(
        cp, "seed_job", lambda base=None, hooks=(), liveness=False: fns.seed_5_kills_its_worker
    )
    r = runner.invoke(app, ["fuzz", "--seeds", "0-7", "--jobs", "2", "--save-dir", str(tmp_path)])
    assert r.exit_code == 1 and "Traceback" not in r.stdout + r.stderr
    # One error line; progress lines (every 5 s on a slow host) may come before it.
    (line,) = [x for x in r.stderr.splitlines() if not x.startswith("fuzz: ")]
    assert line.startswith("error: ") and "lost its worker 4 time" in line
    assert "try each seed alone: kvferry fuzz --seeds " in line and "5" in line.rsplit("--seeds ", 1)[1]


def test_an_unpicklable_function_is_refused_before_any_process_starts() -> None:
    with pytest.raises(TypeError, match="must be picklable"):
        list(ex.LocalExecutor(2).map(lambda x: x, range(4)))

    def nested(x: int) -> int:
        return x

    for fn, why in (
        (nested, "not a module-level function"),
        (functools.partial(fns.fail_on, object()), "not plain data"),
        (ex.LocalExecutor(1).describe, "not a module-level function"),
    ):
        with pytest.raises(TypeError, match=why):
            list(ex.LocalExecutor(2).map(fn, range(4)))


def test_seed_results_do_not_depend_on_jobs() -> None:
    seeds = list(range(8))
    one = {r.seed: r for r in cp.run_seeds(seeds, executor=ex.LocalExecutor(1))}
    two = {r.seed: r for r in cp.run_seeds(seeds, executor=ex.LocalExecutor(2))}
    assert one.keys() == two.keys() == set(seeds)
    for s in seeds:  # everything but the wall time
        a, b = one[s].as_dict(detail=True), two[s].as_dict(detail=True)
        a.pop("wall_s"), b.pop("wall_s")
        assert a == b
    # campaign() still hands them out in seed order
    assert [r.seed for r in cp.campaign(seeds, jobs=2)] == seeds


# ---- fuzz --ray without a cluster ------------------------------------------------------------------


def _fuzz(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, ["fuzz", "--seeds", "0-1", *args])
    assert "Traceback" not in r.stdout + r.stderr
    return r.exit_code, r.stderr


def test_ray_missing_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    code, err = _fuzz("--ray", "local")
    assert code == 2 and err.startswith("error: --ray needs Ray") and "kvferry[ray]" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--ray", ""], "is not a Ray address"),
        (["--ray", "--json"], "is not a Ray address"),
        (["--ray", "head"], "is not a Ray address"),
        (["--ray", "head:99999"], "is not a Ray address"),
        (["--ray", "http://head:6379"], "is not a Ray address"),
        (["--ray", "local", "--jobs", "2"], "--jobs and --ray do not go together"),
    ],
)
def test_bad_ray_options(args: list[str], match: str) -> None:
    code, err = _fuzz(*args)
    assert code == 2 and err.startswith("error: ") and match in err


def test_ray_addresses_accepted() -> None:
    for a in ("local", "auto", "10.0.0.5:6379", "ray://head.example:10001", "[::1]:6379"):
        assert ex.check_ray_address(a) == a
