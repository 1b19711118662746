"""Interpreter work per room: Python function calls, waits and sleeps, and the endpoint threads'
CPU, counted with cProfile over every endpoint thread while one process's prefill and decode
endpoints (``backends/runtime/interference.Endpoints``: TP 1 -> 1, real NIXL on DRAM) move rooms
one after another. Both counts grow with a room's wall time (idle waits end on timeouts): compare
executors alternately on a quiet host.

    python bench/room_calls.py --engine native --rooms 100 [--top 25] [--ahead]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from kvferry.backends.runtime import loops
from kvferry.backends.runtime.interference import Endpoints, InterferenceConfig, _thread_cpu_s

WAITS = ("wait", "sleep", "<built-in method time.sleep>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="native", choices=("python", "native"))
    ap.add_argument("--rooms", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=0, help="also list the most called functions")
    ap.add_argument("--ahead", action="store_true", help="name each room's pages before its send")
    a = ap.parse_args()
    profiles: list[cProfile.Profile] = []
    run = loops.Loop._run

    def profiled(self: loops.Loop) -> None:
        p = cProfile.Profile()
        profiles.append(p)
        p.runcall(run, self)

    loops.Loop._run = profiled  # every endpoint thread is a Loop
    eps = Endpoints(InterferenceConfig(engine=a.engine, tokens=a.tokens, ahead=a.ahead))
    eps.move_room()  # connect the pair first
    threads = eps.python_threads()
    cpu0, t0 = _thread_cpu_s(threads), time.perf_counter()
    host = cProfile.Profile()
    host.enable()
    for _ in range(a.rooms):
        eps.move_room()
    host.disable()
    wall, cpu = time.perf_counter() - t0, _thread_cpu_s(threads) - cpu0
    eps.close()
    st = pstats.Stats(host)
    for p in profiles:
        st.add(p)
    stats = st.stats  # type: ignore[attr-defined]
    calls = sum(v[1] for v in stats.values())
    waits = sum(v[1] for k, v in stats.items() if k[2] in WAITS)
    n = a.rooms
    print(
        f"{a.engine} ({', '.join(eps.executor)}): {n} rooms, {wall / n * 1e3:.1f} ms a room (profiled), "
        f"{calls / n:.0f} Python calls and {waits / n:.1f} waits+sleeps per room, endpoint threads' "
        f"CPU {cpu / n * 1e3:.1f} ms per room, {eps.failed} failed"
    )
    for (path, line, name), v in sorted(stats.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{v[1] / n:9.1f} per room  {path.rsplit('/', 1)[-1]}:{line} {name}")


if __name__ == "__main__":
    main()
