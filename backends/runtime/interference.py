"""``kvferry bench interference``: what the transfer layer takes from a scheduler in its process.

Serving engines run their scheduler in the same interpreter as the KV transfer layer, so every
millisecond our threads hold the interpreter is one the scheduler waits. This bench puts a
scheduler-like thread (fixed pure-Python steps, back to back) in one process with a prefill and a
decode endpoint (TP 1 -> 1, real NIXL on DRAM, the executor chosen by ``engine``) and measures its
step rate in three phases, repeated ``reps`` times in turn so a noisy host hits every phase alike:

- absent: no endpoint exists (the baseline of that repetition),
- idle: both endpoints started, no room,
- busy: a host thread moves ``rate`` rooms a second of ``tokens`` tokens (open, TransferInfo,
  one chunk, Success on both sides, clear), as a serving engine's scheduler would ask.

Reported per phase: the step rate as a ratio of the same repetition's absent phase (median and
spread over repetitions), the median step time, and per room moved: the scheduler time lost
(``(1 - busy ratio) / rooms per second``) and the CPU time of the endpoints' Python threads
(from /proc, so it includes time they spent inside NIXL calls; the native engine's own C thread is
not a Python thread and is not counted there).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PHASES = ("absent", "idle", "busy")


@dataclass(frozen=True)
class InterferenceConfig:
    engine: str = "python"
    reps: int = 5
    phase_s: float = 2.0
    rate: float = 20.0  # rooms per second in the busy phase
    tokens: int = 256
    model: str = "qwen3-8b"
    step_items: int = 3000  # size of one scheduler step's pure-Python work
    engine_poll_us: float = 0.0  # RuntimeConfig.nixl_engine_poll_us (native engine's in-flight pace)
    # Each room's pages named ahead (KVSender.plan_ahead) and decode's TransferInfo awaited before
    # the send: the hand-off order of serving, the chunk's writes prepared before it is ready.
    ahead: bool = False


def scheduler_step(items: int) -> int:
    """One scheduler-like step: pure Python (dicts, sorting, attribute-free arithmetic), no I/O."""
    batch = {i: (i * 7919) % 1009 for i in range(items)}
    order = sorted(batch, key=batch.__getitem__)
    return sum(order[::97])


class Scheduler:
    """Runs steps back to back on its own thread; ``window()`` returns (steps, seconds, step times)."""

    def __init__(self, items: int) -> None:
        self.items = items
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._times: list[float] = []
        self.thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            scheduler_step(self.items)
            dt = time.perf_counter() - t0
            with self._lock:
                self._times.append(dt)

    def window(self, seconds: float) -> tuple[int, float, list[float]]:
        with self._lock:
            self._times.clear()
        t0 = time.perf_counter()
        time.sleep(seconds)
        with self._lock:
            times, self._times = self._times, []
        return len(times), time.perf_counter() - t0, times

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


def _thread_cpu_s(native_ids: set[int]) -> float:
    """utime + stime of these threads of this process, from /proc (seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


class Endpoints:
    """A prefill and a decode endpoint of one process, and a host thread that moves rooms."""

    def __init__(self, cfg: InterferenceConfig) -> None:
        from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
        from kvferry.backends.runtime.security import ephemeral_key
        from kvferry.core.geometry import ModelGeometry, PoolGeometry

        self.cfg = cfg
        model = ModelGeometry.preset(cfg.model)
        self.pages = -(-cfg.tokens // 16)
        self.slots = 8
        rc = RuntimeConfig(
            num_queues=2,
            aux_rows=self.slots,
            control_keys=(ephemeral_key(),),
            nixl_engine=cfg.engine,
            nixl_engine_poll_us=cfg.engine_poll_us,
        )
        pool = PoolGeometry(model, 1, 0, 16, self.pages * self.slots)
        self.pre = PrefillEndpoint("prefill", pool, config=rc)
        self.dec = DecodeEndpoint(
            "decode", pool, prefill_server="prefill", prefill_addresses=[self.pre.address], config=rc
        )
        self.pre.start()
        self.dec.start()
        self.executor = sorted({self.pre.transport.executor, self.dec.transport.executor})
        self._room = 0
        self.moved = 0
        self.failed = 0

    def move_room(self) -> None:
        from kvferry.core.kvpoll import KVPoll

        room, slot = self._room, self._room % self.slots
        self._room += 1
        pages = np.arange(self.pages, dtype=np.int64) + slot * self.pages
        tid = f"r{room}"
        rv = self.dec.receiver(room, tid)
        s = self.pre.sender(room, tid)
        s.write_aux(slot, room.to_bytes(8, "little"))
        s.init(slot)
        if self.cfg.ahead:
            s.plan_ahead(pages, self.cfg.tokens, is_last=True)
        rv.init(pages, self.cfg.tokens, slot)
        if self.cfg.ahead:
            self.pre.board.wait_for(room, tid, {KVPoll.WaitingForInput, KVPoll.Failed}, 30)
        s.send(pages, self.cfg.tokens, is_last=True)
        ok = rv.wait(30) is KVPoll.Success and s.wait(30) is KVPoll.Success
        self.moved += ok
        self.failed += not ok
        rv.clear()
        s.clear()

    def python_threads(self) -> set[int]:
        mine = {threading.get_ident()}
        return {
            t.native_id
            for t in threading.enumerate()
            if t.native_id is not None and t.ident not in mine and t.name != "scheduler"
        }

    def close(self) -> None:
        self.dec.close()
        self.pre.close()


def _busy_window(sched: Scheduler, eps: Endpoints, seconds: float, rate: float) -> tuple[Any, int, float]:
    """Move rooms at ``rate`` per second from a host thread while the scheduler's window runs."""
    stop = threading.Event()
    before = eps.moved

    def host() -> None:
        period = 1.0 / rate
        nxt = time.perf_counter()
        while not stop.is_set():
            eps.move_room()
            nxt += period
            delay = nxt - time.perf_counter()
            if delay > 0:
                stop.wait(delay)

    ids = eps.python_threads()
    cpu0 = _thread_cpu_s(ids)
    t = threading.Thread(target=host, name="host", daemon=True)
    t.start()
    try:
        window = sched.window(seconds)
    finally:
        stop.set()
        t.join(30)
    cpu = _thread_cpu_s(ids | {t.native_id or 0}) - cpu0
    return window, eps.moved - before, cpu


def run(cfg: InterferenceConfig) -> dict[str, Any]:
    sched = Scheduler(cfg.step_items)
    sched.start()
    rates: dict[str, list[float]] = {p: [] for p in PHASES}
    steps: dict[str, list[float]] = {p: [] for p in PHASES}
    moved, cpu, failed, executor = 0, 0.0, 0, ["?"]
    busy_s = 0.0
    try:
        sched.window(0.5)  # warm-up
        for _ in range(cfg.reps):
            n, dt, times = sched.window(cfg.phase_s)
            rates["absent"].append(n / dt)
            steps["absent"] += times
            eps = Endpoints(cfg)
            executor = eps.executor
            try:
                eps.move_room()  # connect the pair outside the timed windows
                n, dt, times = sched.window(cfg.phase_s)
                rates["idle"].append(n / dt)
                steps["idle"] += times
                (n, dt, times), m, c = _busy_window(sched, eps, cfg.phase_s, cfg.rate)
                rates["busy"].append(n / dt)
                steps["busy"] += times
                moved, cpu, busy_s = moved + m, cpu + c, busy_s + dt
                failed += eps.failed
            finally:
                eps.close()
    finally:
        sched.stop()
    ratio = {p: [r / a for r, a in zip(rates[p], rates["absent"], strict=True)] for p in ("idle", "busy")}
    rooms_per_s = moved / busy_s if busy_s else 0.0
    busy_med = statistics.median(ratio["busy"])
    return {
        **asdict(cfg),
        "executor": executor,
        "rooms_moved": moved,
        "rooms_failed": failed,
        "rooms_per_s": rooms_per_s,
        "absent_steps_per_s": statistics.median(rates["absent"]),
        **{f"{p}_ratio_median": statistics.median(ratio[p]) for p in ("idle", "busy")},
        **{f"{p}_ratio_min": min(ratio[p]) for p in ("idle", "busy")},
        **{f"{p}_ratio_max": max(ratio[p]) for p in ("idle", "busy")},
        **{f"{p}_step_us_median": statistics.median(steps[p]) * 1e6 for p in PHASES if steps[p]},
        # Scheduler time lost per room moved, and the endpoints' Python threads' CPU per room.
        "lost_us_per_room": (1 - busy_med) / rooms_per_s * 1e6 if rooms_per_s else None,
        "python_cpu_us_per_room": cpu / moved * 1e6 if moved else None,
        "busy_ratios": ratio["busy"],
        "idle_ratios": ratio["idle"],
    }
