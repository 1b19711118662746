"""The functions tests/test_executors.py runs in worker processes (test_executors_ray.py's Ray
workers get die_once by value). A worker imports the module of the function it runs: this one
imports nothing heavy (the test module imports pytest, hypothesis and the CLI, about 2 s a
worker, and the kill tests start a fresh pool at every loss)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def square(x: int) -> int:
    return x * x


def fail_on(bad: int, x: int) -> int:
    if x == bad:
        raise ValueError(f"bad item {x}")
    return x


def die_once(marks: str, doomed: frozenset[int], x: int, job: Callable[[int], T] | None = None) -> T | int:
    """Kills its own worker process the first time it runs a doomed item (a marker file says so),
    then counts the run and returns ``job(x)`` (``x * x`` without a job)."""
    if x in doomed:
        try:
            Path(marks, f"{x}.died").open("x").close()
        except FileExistsError:
            pass
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    with Path(marks, f"{x}.runs").open("a") as f:
        f.write("run\n")
    return x * x if job is None else job(x)


def always_dies_on_5(x: int) -> int:
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def seed_5_kills_its_worker(seed: int) -> bytes:
    if seed == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    from kvferry.sim import campaign  # the other seeds run for real (imported here: seed 5 needs none)

    return campaign.seed_job()(seed)


def wait_for_release(marks: str, x: int) -> int:
    """Item 0 returns at once; any other says it started (with its worker's pid) and then waits
    for the file ``release``: a worker holding one is busy until then."""
    if x == 0:
        return x
    Path(marks, f"{x}.started").write_text(str(os.getpid()))
    while not Path(marks, "release").exists():
        time.sleep(0.02)
    return x


def fail_once_2_started(marks: str, x: int) -> int:
    """Item 1 fails once item 2 has started; item 2 waits for the file ``release`` (60 s at most)
    and then says it finished: a pool that waits for its runs after an error lets it finish."""
    if x == 1:
        while not Path(marks, "2.started").exists():
            time.sleep(0.02)
        raise ValueError("item 1 failed")
    Path(marks, f"{x}.started").write_text(str(os.getpid()))
    give_up = time.monotonic() + 60
    while not Path(marks, "release").exists() and time.monotonic() < give_up:
        time.sleep(0.02)
    Path(marks, f"{x}.finished").touch()
    return x


@dataclass(frozen=True)
class ThresholdRun:
    """A made-up steady-state run: its flow (a twin's runs are relabelled) and whether it met."""

    flow: str
    met: bool

    def same_run(self, other: ThresholdRun) -> bool:
        return self.met == other.met


def capacity_by_threshold(job: tuple) -> list[ThresholdRun]:  # type: ignore[type-arg]
    """A capacity search's steady-state run replaced by a threshold: the rate is met when at most
    a made-up capacity of the configuration (below its bound, more instances serving more). It
    sleeps up to 30 ms, by the job, so that runs finish in an order unlike the one they began in."""
    spec, rate = job[0], job[1]
    # push as direct: where it takes direct's runs (DeploySpec.runs_as), the two are one simulation
    share = {"direct": 0.55, "push": 0.55, "ring": 0.8, "pinned": 0.75, "pull": 0.4}[spec.flow]
    p, d = spec.prefill_instances, spec.decode_instances
    capacity = share * (1 - 0.3 / p) * min(p, 2 * d)
    time.sleep((hash((spec.flow, p, round(rate, 6))) % 31) / 1000)
    return [ThresholdRun(spec.flow, rate <= capacity)]
