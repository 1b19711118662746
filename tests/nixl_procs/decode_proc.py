"""Decode helper process: every decode rank (``--decode-tp``) over real NIXL, driven by the shared
workload. A room's ranks share its page ids (as TP ranks of one scheduler do); its result lists
one status per rank, and ``bad_bytes`` sums the mismatches of every rank.

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import workload as wl
from kvferry.backends import pattern
from kvferry.backends.runtime import DecodeEndpoint, RuntimeConfig
from kvferry.core.kvpoll import KVPoll
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
    ap.add_argument("--prefill-tp", type=int, default=wl.PREFILL_TP)
    ap.add_argument("--decode-tp", type=int, default=wl.DECODE_TP)
    ap.add_argument("--flow", default="policy", choices=wl.FLOWS)
    args = ap.parse_args()
    wl.stall_copies_if_asked()

    cfg = RuntimeConfig(
        timeouts=wl.timeouts(), aux_rows=wl.AUX_ROWS, staging=wl.staging(args.flow), nixl_engine=wl.engine()
    )
    pools = wl.decode_pools(args.decode_tp)
    mems = [wl.Memory(pool, args.mem) for pool in pools]
    eps = [
        DecodeEndpoint(
            "decode",
            pool,
            prefill_server="prefill",
            prefill_addresses=args.prefill,
            config=cfg,
            buffers=m.device,
        )
        for pool, m in zip(pools, mems, strict=True)
    ]
    for ep in eps:
        ep.start()
    say(event="ready", address=eps[0].address, pid=os.getpid())
    if heard(60.0) != "go":
        sys.exit(2)

    plans = wl.rooms(args.seed, args.rooms, args.abort_rate, hold=args.hold)
    rng = np.random.default_rng(args.seed)  # scattered pages, reproducible
    free_pages = list(range(wl.DECODE_PAGES))
    free_aux = list(range(wl.AUX_ROWS))
    # A failed room's pages (and its receivers, uncleared) until every failed rank is fenced.
    waiting_fence: dict[tuple[int, str], tuple[np.ndarray, int, list]] = {}
    pending = list(reversed(plans))
    live: dict[int, dict] = {}
    results: dict[int, dict] = {}
    end = time.monotonic() + args.deadline_s
    announced = False
    t_killed = 0.0
    late_due: dict[int, float] = {}  # late rooms: when decode opens them

    while (pending or live) and time.monotonic() < end:
        busy = False
        reclaim(waiting_fence, free_pages, free_aux)
        while pending and len(live) < wl.WINDOW and not announced:
            plan = pending[-1]
            if plan.late_open and not args.hold:
                due = late_due.setdefault(plan.index, time.monotonic() + wl.LATE_OPEN_S)
                if time.monotonic() < due:
                    break
            need = -(-plan.tokens // wl.DECODE_PAGE)
            if need > len(free_pages) or not free_aux:
                break
            pending.pop()
            pages = np.array([free_pages.pop(int(rng.integers(len(free_pages)))) for _ in range(need)])
            aux = free_aux.pop()
            rvs = [ep.receiver(plan.room, plan.tid) for ep in eps]
            for rv in rvs:
                rv.init(pages, plan.tokens, aux)
            aborted = False
            if plan.abort == "decode_early":
                for rv in rvs:
                    rv.abort("test: decode_early")
                aborted = True
            live[plan.index] = {"plan": plan, "pages": pages, "aux": aux, "rvs": rvs, "aborted": aborted}
            busy = True
        for idx in list(live):
            st = live[idx]
            plan, rvs = st["plan"], st["rvs"]
            statuses = [rv.poll() for rv in rvs]
            if plan.abort == "decode_mid" and not st["aborted"] and min(statuses) >= KVPoll.Transferring:
                for rv in rvs:
                    rv.abort("test: decode_mid")
                st["aborted"] = True
                busy = True
                continue
            if not all(x in (KVPoll.Success, KVPoll.Failed) for x in statuses):
                continue
            res: dict = {"status": [int(x) for x in statuses], "reason": [], "error": [], "bad_bytes": 0}
            res["first_bad"], res["aux_room_ok"] = None, True
            unfenced = []
            for ep, mem, rv, status in zip(eps, mems, rvs, statuses, strict=True):
                if status is KVPoll.Success:
                    mem.pull()
                    region = mem.region_fn(ep.transport)
                    bad, first = pattern.mismatches(ep.pool, region, plan.room, st["pages"], plan.tokens)
                    res["bad_bytes"] += bad
                    res["first_bad"] = res["first_bad"] or first
                    res["aux_room_ok"] &= ep.transport.read_aux_room(st["aux"]) == plan.room
                    res["reason"].append("")
                    res["error"].append("")
                else:
                    try:
                        rv.failure_exception()
                        res["reason"].append("")
                        res["error"].append("")
                    except Exception as exc:
                        res["reason"].append(str(exc))
                        res["error"].append(type(exc).__name__)
                    if not rv.pages_freed():
                        unfenced.append(rv)
                        continue
                rv.clear()
            waiting_fence[(plan.room, plan.tid)] = (st["pages"], st["aux"], unfenced)
            reclaim(waiting_fence, free_pages, free_aux)
            results[idx] = res
            del live[idx]
            busy = True
        if (
            args.hold
            and not announced
            and not pending
            and live
            and all(rv.poll() is KVPoll.Transferring for st in live.values() for rv in st["rvs"])
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
        results[idx] = {
            "status": [int(rv.poll()) for rv in st["rvs"]],
            "reason": ["still live"] * len(eps),
            "error": [""] * len(eps),
        }
    elapsed = time.monotonic() - t_killed if announced else None
    leaks: list[dict[str, int]] = [{} for _ in eps]
    if not args.hold:  # with a dead peer the fence waits for its deadline; nothing to wait for
        stop = time.monotonic() + 15.0
        while time.monotonic() < stop:
            leaks = [ep.leaks() for ep in eps]
            if all(v == 0 for d in leaks for v in d.values()) and not waiting_fence:
                break
            reclaim(waiting_fence, [], [])
            time.sleep(0.01)
    counters = []
    for ep in eps:
        with ep.lock:  # the engine only under its lock
            counters.append(dict(ep.engine.counters))
    say(
        event="done",
        rooms=results,
        leaks=leaks,
        waiting_fence=len(waiting_fence),
        after_kill_s=elapsed,
        errors=[repr(e) for ep in eps for e in ep.errors],
        driver_errors=[dict(ep.driver.errors) for ep in eps],
        counters=counters,
        executor=[ep.transport.executor for ep in eps],
        fences=[wl.fence_events(ep) for ep in eps],
    )
    heard(120.0)
    say(event="closed", stuck=[name for ep in eps for name in ep.close()])


def reclaim(waiting: dict, free_pages: list, free_aux: list) -> None:
    """Pages of rooms whose every failed rank is now fenced go back to the allocator."""
    for key in list(waiting):
        pages, aux, unfenced = waiting[key]
        if all(rv.pages_freed() for rv in unfenced):
            for rv in unfenced:
                rv.clear()
            del waiting[key]
            free_pages.extend(pages.tolist())
            free_aux.append(aux)


if __name__ == "__main__":
    main()
