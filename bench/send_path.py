"""Interpreter work between "chunk ready" and the post: Python calls and time of a prefill rank's
``send()`` and of the worker step that runs the chunk, per room, with and without the chunk's
pages named ahead (``KVSender.plan_ahead``: planned and made ready at TransferInfo).

One process, a prefill and a decode endpoint (``backends/runtime/interference.Endpoints``: TP
1 -> 1, real NIXL on DRAM, decode's TransferInfo in before each send). Calls are counted with
``sys.setprofile`` (Python and C calls) on the thread that runs each part; the time is the part's
wall time, so it grows with the host's load while the call counts do not.

    python bench/send_path.py --engine native --rooms 50 [--tokens 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

from kvferry.backends.driver import Driver
from kvferry.backends.runtime.interference import Endpoints, InterferenceConfig
from kvferry.backends.runtime.prefill import KVSender


def counted(fn: Any, log: list[tuple[int, float]]) -> Any:
    """``fn`` run under a call counter on the calling thread; (calls, seconds) appended to log."""

    def run(*args: Any, **kw: Any) -> Any:
        calls = [0]

        def prof(frame: Any, event: str, arg: Any) -> None:
            if event in ("call", "c_call"):
                calls[0] += 1

        old = sys.getprofile()
        sys.setprofile(prof)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            dt = time.perf_counter() - t0
            sys.setprofile(old)
            log.append((calls[0], dt))

    return run


def measure(engine: str, ahead: bool, rooms: int, tokens: int) -> dict[str, Any]:
    sends: list[tuple[int, float]] = []
    steps: list[tuple[int, float]] = []
    on_caller: list[bool] = []
    send, step = KVSender.send, Driver.worker_step
    main = threading.main_thread()

    def worker_step(self: Driver, shard: int, now: int) -> Any:
        on_caller.append(threading.current_thread() is main)
        return counted(step, steps)(self, shard, now)

    KVSender.send = counted(send, sends)  # type: ignore[method-assign]
    Driver.worker_step = worker_step  # type: ignore[method-assign]
    try:
        eps = Endpoints(InterferenceConfig(engine=engine, tokens=tokens, ahead=ahead))
        try:
            eps.move_room()  # connect the pair first
            sends.clear(), steps.clear(), on_caller.clear()
            for _ in range(rooms):
                eps.move_room()
        finally:
            eps.close()
    finally:
        KVSender.send, Driver.worker_step = send, step  # type: ignore[method-assign]
    # A send that ran the step itself: the step's calls are counted as the step's (the counter of
    # the inner part replaces the outer one), its time in both.
    inline = sum(on_caller)
    return {
        "engine": engine,
        "executor": eps.executor,
        "ahead": ahead,
        "rooms": rooms,
        "failed": eps.failed,
        "steps_on_send": inline,
        "send_calls": statistics.median(c for c, _ in sends),
        "send_us": statistics.median(t for _, t in sends) * 1e6,
        "step_calls": statistics.median(c for c, _ in steps),
        "step_us": statistics.median(t for _, t in steps) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="native", choices=("python", "native"))
    ap.add_argument("--rooms", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    for ahead in (False, True):
        r = measure(a.engine, ahead, a.rooms, a.tokens)
        print(
            f"{r['engine']} ({', '.join(r['executor'])}) {'ahead   ' if ahead else 'no ahead'}: "
            f"send() {r['send_calls']:.0f} calls {r['send_us']:.0f} us, worker step "
            f"{r['step_calls']:.0f} calls {r['step_us']:.0f} us (median of {r['rooms']} rooms; "
            f"{r['steps_on_send']} steps run by send itself; {r['failed']} failed)"
        )


if __name__ == "__main__":
    main()
