"""Prefill helper process: every prefill rank (``--prefill-tp``) over real NIXL, driven by the
shared workload.

Protocol (JSON lines): prints ``ready`` with its control addresses, waits for ``go``; runs the
rooms; prints ``inflight`` in hold mode and waits for ``killed``; prints ``done`` with every room's
outcome and the table sizes once they are empty (or the wait gave up); waits for ``exit``, closes
and prints ``closed`` with the threads that did not stop.
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
from kvferry.backends.runtime import PrefillEndpoint, RuntimeConfig
from kvferry.core import topology
from kvferry.core.kvpoll import KVPoll
from wire import heard, say


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--rooms", type=int, required=True)
    ap.add_argument("--abort-rate", type=float, default=0.0)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--queues", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=90.0)
    ap.add_argument("--mem", default="DRAM", choices=["DRAM", "VRAM"])
    ap.add_argument("--prefill-tp", type=int, default=wl.PREFILL_TP)
    ap.add_argument("--decode-tp", type=int, default=wl.DECODE_TP)
    ap.add_argument("--flow", default="policy", choices=wl.FLOWS)
    args = ap.parse_args()
    wl.stall_copies_if_asked()

    cfg = RuntimeConfig(
        num_queues=args.queues,
        timeouts=wl.timeouts(),
        aux_rows=wl.AUX_ROWS,
        staging=wl.staging(args.flow),
        nixl_engine=wl.engine(),
    )
    pools = wl.prefill_pools(args.prefill_tp)
    mems = [wl.Memory(pool, args.mem) for pool in pools]
    eps = [
        PrefillEndpoint("prefill", pool, config=cfg, buffers=m.device)
        for pool, m in zip(pools, mems, strict=True)
    ]
    for ep in eps:
        ep.start()
    say(event="ready", addresses=[ep.address for ep in eps], pid=os.getpid())
    if heard(60.0) != "go":
        sys.exit(2)

    plans = wl.rooms(args.seed, args.rooms, args.abort_rate, hold=args.hold)
    free_pages = list(range(wl.PREFILL_PAGES))
    free_aux = list(range(wl.AUX_ROWS))
    pending = list(reversed(plans))
    live: dict[int, dict] = {}
    results: dict[int, dict] = {}
    end = time.monotonic() + args.deadline_s
    announced = False

    while (pending or live) and time.monotonic() < end:
        busy = False
        while pending and len(live) < wl.WINDOW:
            plan = pending[-1]
            need = -(-plan.tokens // wl.PREFILL_PAGE)
            if need > len(free_pages) or not free_aux:
                break
            pending.pop()
            pages = np.array([free_pages.pop() for _ in range(need)], dtype=np.int64)
            aux = free_aux.pop()
            senders = []
            for ep, m in zip(eps, mems, strict=True):
                pattern.fill(ep.pool, m.region_fn(ep.transport), plan.room, pages, 0, plan.tokens)
                m.push()
                s = ep.sender(plan.room, plan.tid)
                s.write_aux(aux, plan.room.to_bytes(8, "little", signed=True))
                s.init(
                    aux,
                    receivers=topology.receiver_endpoints(
                        wl.MODEL, args.prefill_tp, args.decode_tp, ep.pool.tp_rank
                    ),
                )
                senders.append(s)
            live[plan.index] = {
                "plan": plan,
                "pages": pages,
                "aux": aux,
                "senders": senders,
                "next": 0,
                "aborted": False,
            }
            busy = True
        for idx in list(live):
            st = live[idx]
            plan, senders = st["plan"], st["senders"]
            statuses = [s.poll() for s in senders]
            if (
                plan.abort == "prefill_early"
                and not st["aborted"]
                and min(statuses) >= KVPoll.WaitingForInput
            ):
                for s in senders:
                    s.abort("test: prefill_early")
                st["aborted"] = True
                busy = True
            limit = len(plan.cuts)
            if plan.hold or plan.abort in ("decode_mid", "prefill_mid"):
                limit = 1
            if plan.abort == "prefill_early":
                limit = 0
            if plan.abort == "prefill_mid" and min(statuses) < KVPoll.WaitingForInput:
                # Abort only once decode's TransferInfo is in: a sender that fails and is released
                # before it arrives cannot tell decode (the core drops the late TransferInfo at the
                # tombstone), and decode would only fail by its own timeout.
                limit = 0
            if st["next"] < limit and not st["aborted"]:
                i = st["next"]
                for s in senders:
                    s.send(st["pages"], plan.cuts[i], is_last=i == len(plan.cuts) - 1)
                if args.flow == "layerwise":
                    # The chunk's forward "starts" at its send; each layer is reported as it
                    # finishes (a held room reports only its first: the rest is never computed).
                    # 10 ms a layer: a worker that streams gets to post a layer before the next
                    # is reported even on a loaded box (at 2 ms, a suite run at load 8 once saw none).
                    for layer in range(1 if plan.hold else wl.MODEL.num_layers):
                        time.sleep(0.01)
                        for s in senders:
                            s.layers_ready(layer, layer + 1)
                st["next"] += 1
                busy = True
                if plan.abort == "prefill_mid":
                    for s in senders:
                        s.abort("test: prefill_mid")
                    st["aborted"] = True
            if all(x in (KVPoll.Success, KVPoll.Failed) for x in statuses):
                if plan.abort is not None and not all(x is KVPoll.Failed for x in statuses):
                    # A decode rank can finish before its scheduler's abort reaches it (a pull
                    # READ of a small room takes well under a millisecond); the abort is then a
                    # no-op there and its prefill ranks stay Success while the room is Failed as
                    # a whole. Wait a little for aborts still in flight, then record what is.
                    first = st.setdefault("terminal_at", time.monotonic())
                    if time.monotonic() - first < ABORT_GRACE_S:
                        continue
                reasons, errors = [], []
                for s in senders:
                    try:
                        s.failure_exception()
                        reasons.append("")
                        errors.append("")
                    except Exception as exc:
                        reasons.append(str(exc))
                        errors.append(type(exc).__name__)
                    s.clear()
                results[idx] = {"status": [int(x) for x in statuses], "reason": reasons, "error": errors}
                free_pages.extend(st["pages"].tolist())
                free_aux.append(st["aux"])
                del live[idx]
                busy = True
        if (
            args.hold
            and not announced
            and not pending
            and live
            and all(s.poll() is KVPoll.Transferring for st in live.values() for s in st["senders"])
        ):
            say(event="inflight", rooms=len(live))
            announced = True
            if heard(60.0) != "killed":
                break
            end = time.monotonic() + args.deadline_s
            t_killed = time.monotonic()
        if not busy:
            time.sleep(0.001)

    for idx, st in live.items():
        results[idx] = {
            "status": [int(s.poll()) for s in st["senders"]],
            "reason": ["still live"],
            "error": [""],
        }
    elapsed = time.monotonic() - t_killed if announced else None
    # Under pull a dead decode's pages stay until the fence deadline (20 s), past this wait: it
    # would only give up after 15 s, and the test reads no tables there (test_nixl_e2e.py).
    leaks = wait_empty(eps, 0.0 if args.hold and args.flow == "pull" else 15.0)
    say(
        event="done",
        rooms=results,
        leaks=leaks,
        after_kill_s=elapsed,
        errors=[repr(e) for ep in eps for e in ep.errors],
        driver_errors=[dict(ep.driver.errors) for ep in eps],
        telemetry=[ep.transport.agent.telemetry.totals().transfers for ep in eps],
        # Gathers the engine waits for, and what the driver and the copy executor say of them.
        copies=[copy_tables(ep) for ep in eps],
        counters=[engine_counters(ep) for ep in eps],
        executor=[ep.transport.executor for ep in eps],
        fences=[wl.fence_events(ep) for ep in eps],
    )
    heard(120.0)
    stuck = [name for ep in eps for name in ep.close()]
    say(event="closed", stuck=stuck)


ABORT_GRACE_S = 3.0


def engine_counters(ep) -> dict:
    with ep.lock:  # the engine only under its endpoint's lock
        out = dict(ep.engine.counters)
        out.update({f"lease_{k}": v for k, v in ep.engine.leases.counters.items()})
        return out


def copy_tables(ep) -> dict:
    """Gathers the engine waits for, and what the driver and the copy executor say of them."""
    with ep.lock:  # the engine and the driver's tables only under the endpoint's lock
        ops, handles = sorted(ep.engine.staged.ops), dict(ep.driver.copies)
    return {
        "engine_ops": ops,
        "driver": {str(op): ep.transport.check_copy(h).value for op, h in handles.items()},
        "executor_pending": ep.transport.copies.pending() if ep.transport.copies else 0,
    }


def wait_empty(eps, timeout_s: float) -> list[dict[str, int]]:
    end = time.monotonic() + timeout_s
    while True:
        leaks = [ep.leaks() for ep in eps]
        if all(v == 0 for d in leaks for v in d.values()) or time.monotonic() > end:
            return leaks
        time.sleep(0.01)


if __name__ == "__main__":
    main()
