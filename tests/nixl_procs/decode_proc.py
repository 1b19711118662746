"""Decode helper process: one decode rank (TP 1) over real NIXL, driven by the shared workload.

Same protocol as prefill_proc.py (``ready``/``go``, ``inflight``/``killed``, ``done``/``exit``,
``closed``). Every Success room's bytes are checked against the pattern prefill computed; pages
go back to the allocator on Success (after the check) or, for a failed room, only once the core
says they are fenced (FreePages), so a late write would corrupt a later room and be caught.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import workload as wl
from kvferry.backends.runtime import DecodeEndpoint, RuntimeConfig
from kvferry.core.kvpoll import KVPoll
from kvferry.sim import pattern
from wire import heard, say


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--rooms", type=int, required=True)
    ap.add_argument("--abort-rate", type=float, default=0.0)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--prefill", nargs="+", required=True)
    ap.add_argument("--deadline-s", type=float, default=90.0)
    ap.add_argument("--mem", default="DRAM", choices=["DRAM", "VRAM"])
    args = ap.parse_args()

    cfg = RuntimeConfig(timeouts=wl.timeouts(), aux_rows=wl.AUX_ROWS)
    mem = wl.Memory(wl.decode_pool(), args.mem)
    ep = DecodeEndpoint(
        "decode",
        wl.decode_pool(),
        prefill_server="prefill",
        prefill_addresses=args.prefill,
        config=cfg,
        buffers=mem.device,
    )
    fenced: deque[tuple[int, str]] = deque()
    ep.on_free_pages = lambda room, tid: fenced.append((room, tid))
    ep.start()
    say(event="ready", address=ep.address, pid=os.getpid())
    if heard(60.0) != "go":
        sys.exit(2)

    plans = wl.rooms(args.seed, args.rooms, args.abort_rate, hold=args.hold)
    rng = np.random.default_rng(args.seed)  # scattered pages, reproducible
    free_pages = list(range(wl.DECODE_PAGES))
    free_aux = list(range(wl.AUX_ROWS))
    waiting_fence: dict[tuple[int, str], tuple[np.ndarray, int]] = {}
    pending = list(reversed(plans))
    live: dict[int, dict] = {}
    results: dict[int, dict] = {}
    end = time.monotonic() + args.deadline_s
    announced = False
    t_killed = 0.0

    while (pending or live) and time.monotonic() < end:
        busy = False
        while fenced:
            key = fenced.popleft()
            got = waiting_fence.pop(key, None)
            if got is not None:
                free_pages.extend(got[0].tolist())
                free_aux.append(got[1])
        while pending and len(live) < wl.WINDOW and not announced:
            plan = pending[-1]
            need = -(-plan.tokens // wl.DECODE_PAGE)
            if need > len(free_pages) or not free_aux:
                break
            pending.pop()
            pages = np.array([free_pages.pop(int(rng.integers(len(free_pages)))) for _ in range(need)])
            aux = free_aux.pop()
            rv = ep.receiver(plan.room, plan.tid)
            rv.init(pages, plan.tokens, aux)
            aborted = False
            if plan.abort == "decode_early":
                rv.abort("test: decode_early")
                aborted = True
            live[plan.index] = {"plan": plan, "pages": pages, "aux": aux, "rv": rv, "aborted": aborted}
            busy = True
        for idx in list(live):
            st = live[idx]
            plan, rv = st["plan"], st["rv"]
            status = rv.poll()
            if plan.abort == "decode_mid" and not st["aborted"] and status is KVPoll.Transferring:
                rv.abort("test: decode_mid")
                st["aborted"] = True
                busy = True
                continue
            if status not in (KVPoll.Success, KVPoll.Failed):
                continue
            res: dict = {"status": int(status), "reason": "", "error": ""}
            if status is KVPoll.Success:
                mem.pull()
                region = mem.region_fn(ep.transport)
                bad, first = pattern.mismatches(ep.pool, region, plan.room, st["pages"], plan.tokens)
                res["bad_bytes"], res["first_bad"] = bad, first
                res["aux_room_ok"] = ep.transport.read_aux_room(st["aux"]) == plan.room
                rv.clear()
                free_pages.extend(st["pages"].tolist())
                free_aux.append(st["aux"])
            else:
                try:
                    rv.failure_exception()
                except Exception as exc:
                    res["reason"], res["error"] = str(exc), type(exc).__name__
                if rv.pages_freed():
                    free_pages.extend(st["pages"].tolist())
                    free_aux.append(st["aux"])
                else:
                    waiting_fence[(plan.room, plan.tid)] = (st["pages"], st["aux"])
                rv.clear()
            results[idx] = res
            del live[idx]
            busy = True
        if (
            args.hold
            and not announced
            and not pending
            and live
            and all(st["rv"].poll() is KVPoll.Transferring for st in live.values())
        ):
            say(event="inflight", rooms=len(live))
            announced = True
            if heard(60.0) != "killed":
                break
            t_killed = time.monotonic()
            end = t_killed + args.deadline_s
        if not busy:
            time.sleep(0.001)

    for idx, st in live.items():
        results[idx] = {"status": int(st["rv"].poll()), "reason": "still live", "error": ""}
    elapsed = time.monotonic() - t_killed if announced else None
    leaks: dict[str, int] = {}
    if not args.hold:  # with a dead peer the fence waits for its deadline; nothing to wait for
        stop = time.monotonic() + 15.0
        while time.monotonic() < stop:
            leaks = ep.leaks()
            if all(v == 0 for v in leaks.values()) and not waiting_fence:
                break
            while fenced:
                waiting_fence.pop(fenced.popleft(), None)
            time.sleep(0.01)
    with ep.lock:  # the engine only under its lock
        counters = dict(ep.engine.counters)
    say(
        event="done",
        rooms=results,
        leaks=[leaks],
        waiting_fence=len(waiting_fence),
        after_kill_s=elapsed,
        errors=[repr(e) for e in ep.errors],
        driver_errors=[dict(ep.driver.errors)],
        counters=counters,
    )
    heard(120.0)
    say(event="closed", stuck=ep.close())


if __name__ == "__main__":
    main()
