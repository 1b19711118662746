"""Simulator throughput: a 10,000-room replay, simulated transfers per wall second, fuzz seeds/minute,
and a 10,000-request deployment replay (sim/deploy: compute, arrivals, KV through the real flows).

Run: ``uv run python bench/sim_bench.py [--rooms 10000] [--seeds 60] [--deploy-requests 10000]``
(one core, no GPU; ``--only deploy``, ``--only replay`` or ``--only select`` runs one part;
``select`` times ``kvferry select``'s example question, fixed, as a capacity search with its rate
and without (``--capacity``), with each command's peak RSS; ``--only counts`` counts what each
replay does per room or request: SimPy steps, engine calls, rank wake-ups, posts and control
messages, the figures its CPU time scales with).

Baseline measured in the same run: a bare SimPy process doing timeouts, i.e. the fastest a SimPy
world can advance. The simulator's cost is shown as trace events per second and as the ratio of
its per-event wall time to that bare timeout (how many bare timeouts one simulated event costs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import simpy
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import campaign, run_one
from msgspec.structs import replace


def interpreter() -> str:
    """Which CPython ran the bench: its build moves every figure (pyenv's, without PGO or LTO, runs
    a room in ~10% more instructions than Debian's: docs/benchmarks.md), so a reading names it."""
    return f"{platform.python_version()} {os.path.realpath(sys.executable)}"


def bare_simpy_rate(n: int = 300_000) -> float:
    env = simpy.Environment()

    def proc():  # type: ignore[no-untyped-def]
        for _ in range(n):
            yield env.timeout(1)

    env.process(proc())
    t0 = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t0)


LOAD_FILE = Path(__file__).with_name("load-10k.toml")


def big_scenario(rooms: int) -> sc.Scenario:
    """bench/load-10k.toml (prefill TP2 -> decode TP2, chunked, no faults), resized to ``rooms``.

    Its heartbeats run every 10 ms (production: 1 s); the scenario default of 2 ms exists to make
    fault campaigns notice dead peers quickly and would be a fifth of this run's messages.
    """
    s = sc.load(LOAD_FILE)
    return replace(s, name=f"bench-{rooms}", workload=replace(s.workload, rooms=rooms))


def deploy_replay(n: int, every_rank: bool = False) -> dict[str, float]:
    """``n`` requests of the issue's deployment (qwen3-8b, prefill TP 4 -> decode TP 2, H100 with a
    400 Gb/s NIC, the ring flow ``kvferry select`` recommends there), Poisson at 20 requests/s,
    1000 +- 50% input and 100 +- 50% output tokens: a fixed, realistic load (not saturated).
    ``every_rank``: every TP rank simulated, not one of the two identical TP groups (the default)."""
    from kvferry.sim.deploy import workload as wl
    from kvferry.sim.deploy.run import simulate
    from kvferry.sim.deploy.spec import DeploySpec

    spec = DeploySpec(model="qwen3-8b", prefill_tp=4, decode_tp=2, flow="ring", every_rank=every_rank)
    reqs = wl.poisson(20.0, n, 1000, 100, seed=1, spread=0.5)
    t0, c0 = time.perf_counter(), time.process_time()
    r = simulate(spec, wl.Arrivals(requests=reqs))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert not r.violations and r.completed == n, (r.completed, r.violations[:3])
    return {
        "deploy_requests": n,
        "deploy_every_rank": every_rank,
        "deploy_wall_s": round(wall, 2),
        "deploy_cpu_s": round(cpu, 2),
        "deploy_load_average_1min": round(os.getloadavg()[0], 2),
        "deploy_simulated_s": round(r.sim_s, 1),
        "deploy_requests_per_wall_s": round(n / wall),
        "deploy_ttft_p50_ms": round(r.ttft_ms.p50, 1),
        "deploy_ttft_p99_ms": round(r.ttft_ms.p99, 1),
        "deploy_tpot_p50_ms": round(r.tpot_ms.p50, 2),
    }


def _counted(env: simpy.Environment) -> list[int]:
    """Count ``env``'s steps (every scheduled call, delivery, timer and process resume)."""
    steps = [0]
    step = env.step

    def counting() -> None:
        steps[0] += 1
        step()

    env.step = counting  # type: ignore[method-assign]
    return steps


def _per(n: int, steps: list[int], ranks: Any, stats: Any) -> dict[str, float]:
    ranks = list(ranks)
    return {
        "simpy_steps": round(steps[0] / n, 1),
        "engine_calls": round(sum(r.driver.engine_calls for r in ranks) / n, 1),
        "rank_wakeups": round(sum(r.wakeups for r in ranks) / n, 1),
        "fabric_posts": round(stats.posts / n, 1),
        "control_messages": round(stats.control_sent / n, 1),
    }


def event_counts(rooms: int, requests: int) -> dict[str, dict[str, float]]:
    """Per room of the transfer replay and per request of the deployment replay: the work each
    one is made of (deterministic: the same on any machine)."""
    from kvferry.sim.deploy import workload as wl
    from kvferry.sim.deploy.run import deploy_world, run_world
    from kvferry.sim.deploy.spec import DeploySpec

    box: list[list[int]] = []
    _res, w = run_one(big_scenario(rooms), before_run=lambda w: box.append(_counted(w.env)))
    replay = _per(rooms, box[0], w.ranks.values(), w.fabric.stats)
    spec = DeploySpec(model="qwen3-8b", prefill_tp=4, decode_tp=2, flow="ring")
    arrivals = wl.Arrivals(requests=wl.poisson(20.0, requests, 1000, 100, seed=1, spread=0.5))
    dw = deploy_world(spec, arrivals)
    steps = _counted(dw.env)
    run_world(dw, arrivals)
    deploy = _per(requests, steps, dw.ranks.values(), dw.fabric.stats)
    return {f"replay_per_room ({rooms} rooms)": replay, f"deploy_per_request ({requests} requests)": deploy}


EXAMPLE = [
    *("select", "--model", "llama-3.1-70b", "--prefill-tp", "8", "--decode-tp", "4"),
    *("--gpu", "h100", "--nic", "nic-400g", "--isl", "8192", "--osl", "500", "--rate", "20"),
]


def cli_run(args: list[str]) -> dict[str, Any]:
    """One ``kvferry`` command in a child process: its wall and CPU seconds and peak RSS (the
    child's own, from getrusage: what a laptop must hold)."""
    import resource
    import subprocess
    import sys

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run(
        [str(Path(sys.executable).with_name("kvferry")), *args, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"kvferry {' '.join(args)} failed: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
        # ru_maxrss is the largest child so far (KiB on Linux): one child per call here.
        "peak_rss_mb": round(after.ru_maxrss / 1024, 1),
        # Wall time depends on what else runs: the 1-minute load average before and after.
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "answer": out.get("reason", ""),
    }


def select_question() -> dict[str, object]:
    """The question users ask (README, docs/select.md): llama-3.1-70b, prefill TP 8 -> decode TP 4,
    H100s with 400 Gb/s NICs, 8k-token prompts, 500-token outputs, 20 requests/s. First as asked of
    one prefill and one decode instance (every flow, steady state), then the capacity search
    (instance counts 1..8 a side, every flow), then that search without a rate: the most each
    balanced configuration sustains (the 60 s target's search)."""
    fixed = cli_run([*EXAMPLE, "--instances", "1"])
    search = cli_run([*EXAMPLE, "--no-cache"])  # every run simulated: runs kept earlier are not timed
    no_rate = [a for i, a in enumerate(EXAMPLE) if "--rate" not in EXAMPLE[max(0, i - 1) : i + 1]]
    most = cli_run([*no_rate, "--capacity", "--no-cache"])
    return {"select_1p1d": fixed, "select_capacity": search, "select_max_rates": most}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rooms", type=int, default=10_000)
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--deploy-requests", type=int, default=10_000)
    ap.add_argument("--only", choices=("all", "replay", "deploy", "select", "counts"), default="all")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--every-rank",
        action="store_true",
        help="deploy: simulate every TP rank (the old model) instead of one identical TP group",
    )
    args = ap.parse_args()
    if args.only == "select":
        # The box's speed beside the times: the targets were set where bare SimPy ran 1.41 M/s.
        q = {"bare_simpy_timeouts_per_s": round(bare_simpy_rate()), **select_question()}
        print(json.dumps(q) if args.json else "\n".join(f"{k}: {v}" for k, v in q.items()))
        return
    if args.only == "counts":
        c = event_counts(min(args.rooms, 2000), min(args.deploy_requests, 1000))
        print(json.dumps(c) if args.json else "\n".join(f"{k}: {v}" for k, v in c.items()))
        return
    if args.only == "deploy":
        d: dict[str, Any] = {"python": interpreter(), "bare_simpy_timeouts_per_s": round(bare_simpy_rate())}
        d |= deploy_replay(args.deploy_requests, args.every_rank)
        if not args.json:
            print(f"Python {d['python']}, bare SimPy baseline: {d['bare_simpy_timeouts_per_s']:,} timeouts/s")
        print(json.dumps(d) if args.json else _deploy_line(d))
        return

    base = bare_simpy_rate()
    s = big_scenario(args.rooms)
    t0, c0 = time.perf_counter(), time.process_time()
    res, _w = run_one(s)
    big_wall = time.perf_counter() - t0
    big_cpu = time.process_time() - c0
    assert not res.violations, res.violations[:3]
    ev_rate = res.events / big_wall

    # Same deployment with swarm faults on, as the campaign runs it.
    faulty = replace(
        big_scenario(min(args.rooms, 2000)),
        faults=sc.Faults(swarm=True),
        phases=sc.Phases(fault_window_us=200_000),
    )
    t0 = time.perf_counter()
    fres, _ = run_one(faulty)
    faulty_wall = time.perf_counter() - t0

    t0 = time.perf_counter()
    n_rooms = sum(r.rooms for r in campaign(range(args.seeds)))
    fuzz_wall = time.perf_counter() - t0

    deploy = deploy_replay(args.deploy_requests, args.every_rank) if args.only == "all" else {}
    out = {
        **deploy,
        "python": interpreter(),
        "bare_simpy_timeouts_per_s": round(base),
        "replay_rooms": res.rooms,
        "replay_succeeded": res.succeeded,
        "replay_wall_s": round(big_wall, 2),
        "replay_cpu_s": round(big_cpu, 2),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "replay_simulated_s": res.sim_ns / 1e9,
        "replay_transfers": res.transfers,
        "transfers_per_wall_s": round(res.transfers / big_wall),
        "rooms_per_wall_s": round(res.rooms / big_wall),
        "trace_events_per_wall_s": round(ev_rate),
        "cost_per_event_in_bare_timeouts": round(base / ev_rate, 2),
        "faulty_rooms": fres.rooms,
        "faulty_wall_s": round(faulty_wall, 2),
        "faulty_transfers_per_wall_s": round(fres.transfers / faulty_wall),
        "fuzz_seeds": args.seeds,
        "fuzz_rooms": n_rooms,
        "fuzz_seeds_per_minute_one_core": round(args.seeds / fuzz_wall * 60, 1),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"Python {out['python']}, bare SimPy baseline: {out['bare_simpy_timeouts_per_s']:,} timeouts/s")
    print(
        f"{res.rooms}-room replay (no faults): {big_wall:.2f} s wall for {res.sim_ns / 1e9:.3f} s simulated, "
        f"{res.succeeded} succeeded, target <= 6 s on the 1.41 M timeouts/s box"
    )
    print(f"  process CPU time {big_cpu:.2f} s (load average {out['load_average_1min']} on this machine)")
    print(
        f"  {out['transfers_per_wall_s']:,} simulated transfers per wall second, "
        f"{out['rooms_per_wall_s']:,} rooms/s, {out['trace_events_per_wall_s']:,} trace events/s "
        f"= one event costs {out['cost_per_event_in_bare_timeouts']} bare SimPy timeouts"
    )
    print(
        f"{fres.rooms}-room replay with swarm faults: {faulty_wall:.2f} s wall, "
        f"{out['faulty_transfers_per_wall_s']:,} transfers/s"
    )
    print(
        f"kvferry fuzz (drawn deployments, swarm faults): {args.seeds} seeds, {n_rooms} rooms "
        f"in {fuzz_wall:.1f} s "
        f"= {out['fuzz_seeds_per_minute_one_core']} seeds/minute on one core"
    )
    if deploy:
        print(_deploy_line(deploy))


def _deploy_line(d: dict[str, Any]) -> str:
    return (
        f"{d['deploy_requests']:,}-request deployment replay (qwen3-8b TP4 -> TP2, ring, 20 req/s, "
        f"{'every rank' if d['deploy_every_rank'] else 'one TP group'}): "
        f"{d['deploy_wall_s']:.2f} s wall ({d['deploy_cpu_s']:.2f} s CPU) for {d['deploy_simulated_s']} s "
        f"simulated, TTFT p50 {d['deploy_ttft_p50_ms']} ms / p99 {d['deploy_ttft_p99_ms']} ms, "
        "target <= 10 s on the 1.41 M timeouts/s box"
    )


if __name__ == "__main__":
    main()
