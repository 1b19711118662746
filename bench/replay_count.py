"""Instruction counts of the two simulator replays, around the run only, and their digests.

``python bench/replay_count.py replay|deploy N [--digest]``: builds sim_bench's ``big_scenario(N)``
(seed 0) or its deployment replay (qwen3-8b TP 4 -> 2, ring, N Poisson requests at 20/s), then runs
it. Under ``valgrind --tool=callgrind --instr-atstart=no`` it switches instrumentation on for the
run alone (``callgrind_control -i on/off`` of its own pid), so imports and the build are left out.
It prints the run's digest: the replay's trace hash; for the deployment (whose trace is silenced by
design), with ``--digest``, a hash of every record the silenced trace would have taken plus the
result's figures (without ``--digest`` only the figures, so the count holds no hashing).
Run with ``PYTHONHASHSEED=0`` (set iteration order moves counts by up to 3%).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _instr(on: bool) -> None:
    if os.environ.get("VALGRIND_LAUNCHER") or "valgrind" in os.environ.get("LD_PRELOAD", ""):
        subprocess.run(
            ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
            check=True,
            stdout=subprocess.DEVNULL,
        )


def replay(n: int) -> str:
    from kvferry.sim.campaign import run_one
    from sim_bench import big_scenario

    s = big_scenario(n)
    _instr(True)
    res, _ = run_one(s, 0)
    _instr(False)
    return f"events {res.events} digest {res.digest}"


def deploy(n: int, digest: bool) -> str:
    import kvferry.sim.deploy.world as dw
    from kvferry.sim.deploy import workload as wl
    from kvferry.sim.deploy.run import collect, deploy_world, run_world
    from kvferry.sim.deploy.spec import DeploySpec
    from kvferry.sim.trace import Trace

    held: dict[str, Any] = {}
    if digest:
        # The deployment silences its trace with this function: hash what it is given instead.
        t = Trace(lambda: held["w"].env.now)
        dw._no_record = t.record  # type: ignore[assignment]
    spec = DeploySpec(model="qwen3-8b", prefill_tp=4, decode_tp=2, flow="ring")
    arrivals = wl.Arrivals(requests=wl.poisson(20.0, n, 1000, 100, seed=1, spread=0.5))
    w = held["w"] = deploy_world(spec, arrivals)
    _instr(True)
    wall = run_world(w, arrivals)
    _instr(False)
    r = collect(w, arrivals, wall)
    figures = repr((r.completed, r.violations, r.sim_s, r.ttft_ms, r.tpot_ms))
    out = f"completed {r.completed} figures {hashlib.sha256(figures.encode()).hexdigest()[:16]}"
    if digest:
        out += f" records {t.count} digest {t.digest()}"
    return out


def main() -> None:
    what, n = sys.argv[1], int(sys.argv[2])
    print(replay(n) if what == "replay" else deploy(n, "--digest" in sys.argv))


if __name__ == "__main__":
    main()
