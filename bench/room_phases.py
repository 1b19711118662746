"""Interpreter work per room, split by phase: Python calls and thread CPU per direct room for each
step of its path through one process's prefill and decode endpoints (TP 1 -> 1, real NIXL on
DRAM, ``backends/runtime/interference.Endpoints``), rooms moved one after another.

Each phase is a runtime entry point wrapped on the thread that runs it; a call that did no work
(an idle control or data step) is counted apart, as ``idle``. CPU is the thread's own
(``time.thread_time``), so waits cost nothing and other processes' load does not count; with
``--calls`` a cProfile per call also counts Python calls (and inflates the CPU: compare the
CPU of runs without ``--calls``).

    python bench/room_phases.py --engine native --rooms 200 [--ahead] [--calls] [--top 10]

Phases: open (decode KVReceiver.init: ReceiverOpen, TransferInfo encoded, signed, sent),
zmq-in (the control plane's IO thread: ZMQ recv, frame checks, HMAC), ti (prefill's control
step that handled a control message: msgspec decode, core dispatch, bounds checks, planning
and, with --ahead, the NIXL prep), sopen (KVSender.init), ahead (KVSender.plan_ahead),
send (KVSender.send: ChunkReady, and with the native engine's post-on-send the post itself),
step (a worker's chunk step: plan and post, when the worker runs it), await (a worker seeing its
chunk's writes through), p-data/d-data (the data threads' steps that fed something: write
completions, notifications -> Success), d-ctl (decode's control steps that did work), wait
(the host's KVSender/KVReceiver.wait), clear (both handles' clear).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from kvferry.backends.runtime.interference import Endpoints, InterferenceConfig


class Phases:
    """Per phase: how many calls did work, their CPU, their Python calls and top functions."""

    def __init__(self, calls: bool, cum: str = "") -> None:
        self.calls = calls or bool(cum)
        self.cum = cum
        self.cum_stats: pstats.Stats | None = None
        self.lock = threading.Lock()
        self.n: Counter[str] = Counter()
        self.cpu: Counter[str] = Counter()
        self.py: Counter[str] = Counter()
        self.funcs: dict[str, Counter[str]] = defaultdict(Counter)
        self._active = threading.local()

    def wrap(self, name: str, fn: Callable[..., Any], busy: Callable[[Any], bool] | None = None) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            if getattr(self._active, "on", False):  # nested: counted by the outer phase
                return fn(*args, **kw)
            self._active.on = True
            prof = cProfile.Profile(time.thread_time) if self.calls else None
            t0 = time.thread_time()
            try:
                out = fn(*args, **kw) if prof is None else prof.runcall(fn, *args, **kw)
            finally:
                self._active.on = False
            dt = time.thread_time() - t0
            key = name if busy is None or busy(out) else f"{name} idle"
            self._record(key, dt, prof)
            return out

        return run

    def _record(self, key: str, dt: float, prof: cProfile.Profile | None) -> None:
        stats = prof.getstats() if prof is not None else []
        with self.lock:
            self.n[key] += 1
            self.cpu[key] += dt
            if prof is not None and key == self.cum:
                if self.cum_stats is None:
                    self.cum_stats = pstats.Stats(prof)
                else:
                    self.cum_stats.add(prof)
            for e in stats:
                label = e.code if isinstance(e.code, str) else f"{e.code.co_name}:{e.code.co_firstlineno}"
                self.py[key] += e.callcount
                self.funcs[key][label] += e.callcount


def install(eps: Endpoints, ph: Phases) -> None:
    pre, dec = eps.pre, eps.dec
    from kvferry.backends.runtime import decode, prefill

    rv_cls, s_cls = decode.KVReceiver, prefill.KVSender
    rv_cls.init = ph.wrap("open", rv_cls.init)
    rv_cls.wait = ph.wrap("wait", rv_cls.wait)
    rv_cls.clear = ph.wrap("clear", rv_cls.clear)
    s_cls.init = ph.wrap("sopen", s_cls.init)
    s_cls.plan_ahead = ph.wrap("ahead", s_cls.plan_ahead)
    s_cls.send = ph.wrap("send", s_cls.send)
    s_cls.wait = ph.wrap("wait", s_cls.wait)
    s_cls.clear = ph.wrap("clear", s_cls.clear)
    pre._step = ph.wrap("step", pre._step)
    pre._await = ph.wrap("await", pre._await)
    for ep, side in ((pre, "p"), (dec, "d")):
        control, _data = ep._loops[0], ep._loops[1]
        control._step = ph.wrap("ti" if side == "p" else "d-ctl", control._step, bool)
        ep.driver.pump_data = ph.wrap(f"{side}-data", ep.driver.pump_data, bool)
        plane = ep.transport.control
        plane._drain_inbound = ph.wrap("zmq-in", plane._drain_inbound)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="native", choices=("python", "native"))
    ap.add_argument("--rooms", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ahead", action="store_true", help="name each room's pages before its send")
    ap.add_argument("--calls", action="store_true", help="count Python calls (cProfile per phase call)")
    ap.add_argument("--top", type=int, default=0, help="with --calls: each phase's most called functions")
    ap.add_argument("--cum", default="", help="print this phase's cumulative profile")
    a = ap.parse_args()
    eps = Endpoints(InterferenceConfig(engine=a.engine, tokens=a.tokens, ahead=a.ahead))
    eps.move_room()  # connect the pair first
    ph = Phases(a.calls, a.cum)
    install(eps, ph)
    for _ in range(a.rooms):
        eps.move_room()
    eps.close()
    n = a.rooms
    mode = "calls+CPU (profiled)" if a.calls else "CPU"
    print(f"{a.engine} ({', '.join(eps.executor)}), ahead={a.ahead}: {n} rooms, {eps.failed} failed, {mode}")
    print(f"{'phase':14} {'events/room':>11} {'calls/room':>10} {'CPU us/room':>11}")
    busy = [k for k in ph.n if not k.endswith(" idle")]
    for k in sorted(ph.n, key=lambda k: (k.endswith(" idle"), -ph.cpu[k])):
        print(f"{k:14} {ph.n[k] / n:11.2f} {ph.py[k] / n:10.0f} {ph.cpu[k] / n * 1e6:11.1f}")
    tot_py, tot_cpu = sum(ph.py[k] for k in busy), sum(ph.cpu[k] for k in busy)
    print(f"{'busy total':14} {'':11} {tot_py / n:10.0f} {tot_cpu / n * 1e6:11.1f}")
    for k in busy if a.top else ():
        top = ", ".join(f"{f} {c / n:.1f}" for f, c in ph.funcs[k].most_common(a.top))
        print(f"  {k}: {top}")
    if ph.cum_stats is not None:
        ph.cum_stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
