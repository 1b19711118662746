"""The Ray executor on a local instance (2 CPUs, one session for the module): the same seeds give
the same results as the local executor, a worker killed mid-campaign loses no seed and counts none
twice (through Ray's retries, and through the executor's own re-sending when Ray has none left),
failing seeds come back with the same scenario files and replay commands, and errors are loud."""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from kvferry.sim import campaign as cp  # noqa: E402
from kvferry.sim import executors as ex  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from kvferry.cli import _register, app  # noqa: E402
from tests import executor_jobs as fns  # noqa: E402

_register()
SEEDS = list(range(12))


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    # "local": a fresh instance for this module, never a cluster found on the machine.
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    # Workers cannot import a test module: its helpers travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(fns)
    yield
    ray.cloudpickle.unregister_pickle_by_value(fns)
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


def _comparable(res: Any) -> dict[str, Any]:
    d = res.as_dict(detail=True)
    d.pop("wall_s")  # the only field that is not a function of the seed
    d["scenario_toml"] = res.scenario_toml
    return d


@pytest.fixture(scope="module")
def local_results() -> dict[int, dict[str, Any]]:
    return {r.seed: _comparable(r) for r in cp.run_seeds(SEEDS, executor=ex.LocalExecutor(1))}


def _ray_campaign(
    executor: ex.Executor, fn: Callable[[int], bytes]
) -> tuple[list[int], dict[int, dict[str, Any]], list[ex.MapStats]]:
    stats: list[ex.MapStats] = []
    order, results = [], {}
    for seed, data in executor.map(fn, SEEDS, progress=stats.append):
        order.append(seed)
        results[seed] = _comparable(cp.decode_result(data))
    return order, results, stats


def test_same_seeds_same_results_under_local_and_ray(local_results: dict[int, dict[str, Any]]) -> None:
    with ex.RayExecutor("local", max_retries=0) as rx:
        assert not rx.owns_session  # the module's session, reused
        order, results, stats = _ray_campaign(rx, cp.seed_job())
    assert Counter(order) == Counter(SEEDS)
    assert results == local_results
    assert [s.done for s in stats] == list(range(1, len(SEEDS) + 1)) and stats[-1].resent == 0


@pytest.mark.parametrize(("max_retries", "resent"), [(3, 0), (0, 2)], ids=["ray-retries", "own-resend"])
def test_a_worker_killed_mid_campaign_loses_no_seed(
    max_retries: int, resent: int, tmp_path: Path, local_results: dict[int, dict[str, Any]]
) -> None:
    doomed = frozenset({2, 9})
    fn = functools.partial(fns.die_once, str(tmp_path), doomed, job=cp.seed_job())
    with ex.RayExecutor("local", max_retries=max_retries) as rx:
        order, results, stats = _ray_campaign(rx, fn)
    assert all((tmp_path / f"{s}.died").exists() for s in doomed)  # the workers really died
    assert Counter(order) == Counter(SEEDS)  # none dropped, none twice
    assert results == local_results
    # With Ray's retries the seeds never come back lost; without, the executor sends them again.
    assert stats[-1].resent == resent and stats[-1].duplicates == 0


def test_an_error_in_the_function_propagates() -> None:
    with ex.RayExecutor("local") as rx, pytest.raises(ValueError, match="bad seed 3"):
        list(rx.map(functools.partial(_raise_on, 3), range(6)))


def _raise_on(bad: int, x: int) -> int:
    if x == bad:
        raise ValueError(f"bad seed {x}")
    return x


def test_a_node_with_other_code_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The driver believes in other code than the workers run: every task refuses.
    monkeypatch.setattr(ex, "code_digest", lambda: "0" * 16)
    with ex.RayExecutor("local") as rx, pytest.raises(ex.ExecutorError, match="runs other kvferry code"):
        list(rx.map(_raise_on_never, range(3)))


def _raise_on_never(x: int) -> int:
    return x


def test_failing_seeds_come_back_as_they_do_locally(tmp_path: Path) -> None:
    runner = CliRunner()
    outs = {}
    # --jobs 1: forking worker processes from a process that holds a Ray session is asking for trouble.
    for name, extra in (("local", ["--jobs", "1"]), ("ray", ["--ray", "local"])):
        d = tmp_path / name
        args = ["fuzz", "--seeds", "0-5", "--plant", "keep_room_tables", "--save-dir", str(d), "--json"]
        r = runner.invoke(app, [*args, *extra])
        assert r.exit_code == 1, r.stderr  # violations found
        out = json.loads(r.stdout)
        assert out["executor"] == name
        for k in ("wall_s", "seeds_per_minute", "executor"):
            out.pop(k)
        files = {p.name: p.read_text() for p in d.iterdir()}
        outs[name] = (json.dumps(out).replace(str(d), "DIR"), files)
    local, on_ray = outs["local"], outs["ray"]
    assert local == on_ray
    assert json.loads(local[0])["failing_seeds"], "the planted bug went unnoticed"
    assert "kvferry replay DIR/seed-0.toml" in local[0]


def test_an_address_nobody_answers_is_one_error_line() -> None:
    r = CliRunner().invoke(app, ["fuzz", "--seeds", "0-1", "--ray", "127.0.0.1:1"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --ray 127.0.0.1:1: no Ray cluster answers")
    assert len(r.stderr.strip().splitlines()) == 1
