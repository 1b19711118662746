"""The soak's prefill process: every prefill rank over real NIXL, rooms from ``plan``, commands
from the parent (``common.serve``). Each room's outcome is printed as soon as it is terminal, so a
kill loses nothing the parent needs."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import numpy as np
from kvferry.backends import pattern
from kvferry.backends.loopback import common
from kvferry.backends.loopback import plan as sp
from kvferry.backends.loopback.wire import say
from kvferry.backends.runtime import PrefillEndpoint, RuntimeConfig
from kvferry.core import topology
from kvferry.core.kvpoll import KVPoll

TERMINAL = (KVPoll.Success, KVPoll.Failed)


class PrefillSide(common.SideLoop):
    HANDLES = "senders"

    def __init__(self, args: Any) -> None:
        self.args = args
        cfg = RuntimeConfig(
            num_queues=2,
            timeouts=sp.timeouts(args.deadline_scale),
            aux_rows=sp.AUX_ROWS,
            staging=sp.staging(),
            host=args.host,
            nixl_engine=args.engine,
            lost_peer_drain_s=args.drain_s or None,
        )
        ports = [int(p) for p in args.ports.split(",")] if args.ports else [0] * args.prefill_tp
        pools = sp.prefill_pools(args.prefill_tp)
        # A restarted prefill binds its predecessor's ports: decode knows prefill by address.
        self.eps = [
            PrefillEndpoint("prefill", pool, config=msgspec.structs.replace(cfg, port=port))
            for pool, port in zip(pools, ports, strict=True)
        ]
        for ep in self.eps:
            ep.start()
        self.free_pages = list(range(sp.PREFILL_PAGES))
        self.free_aux = list(range(sp.AUX_ROWS))

    def _open(self, pending: list[sp.SoakRoom], live: dict[int, dict[str, Any]]) -> bool:
        busy = False
        while pending and len(live) < sp.WINDOW:
            plan = pending[-1]
            need = -(-plan.tokens // sp.PREFILL_PAGE)
            if need > len(self.free_pages) or not self.free_aux:
                break
            pending.pop()
            pages = np.array([self.free_pages.pop() for _ in range(need)], dtype=np.int64)
            aux = self.free_aux.pop()
            senders = []
            for ep in self.eps:
                pattern.fill(ep.pool, ep.transport.region, plan.room, pages, 0, plan.tokens)
                s = ep.sender(plan.room, plan.tid)
                s.write_aux(aux, plan.room.to_bytes(8, "little", signed=True))
                recv = topology.receiver_endpoints(
                    sp.MODEL, self.args.prefill_tp, self.args.decode_tp, ep.pool.tp_rank
                )
                s.init(aux, flow=plan.flow, receivers=recv)
                senders.append(s)
            live[plan.index] = {"plan": plan, "pages": pages, "aux": aux, "senders": senders, "next": 0}
            live[plan.index].update(aborted=False, forward=[], layers_sent=0)
            busy = True
        return busy

    def _step(self, live: dict[int, dict[str, Any]], idx: int) -> bool:
        """One room's next move (abort, next layers, next chunk, or its end); True if something
        happened."""
        st = live[idx]
        plan, senders = st["plan"], st["senders"]
        statuses = [s.poll() for s in senders]
        busy = False
        if plan.abort == "prefill_early" and not st["aborted"] and min(statuses) >= KVPoll.WaitingForInput:
            for s in senders:
                s.abort("soak: prefill_early")
            st["aborted"] = busy = True
        limit = len(plan.cuts)
        if plan.hold or plan.abort in ("decode_mid", "prefill_mid"):
            limit = 1
        if plan.abort == "prefill_early":
            limit = 0
        if plan.abort == "prefill_mid" and min(statuses) < KVPoll.WaitingForInput:
            # Abort only once decode's TransferInfo is in: a sender released before it arrives
            # cannot tell decode, which would then fail only by its own timeout.
            limit = 0
        if st["forward"] and not st["aborted"]:
            busy = self._next_layers(st)  # the chunk's forward goes on: no next chunk before it ends
        elif st["next"] < limit and not st["aborted"]:
            i = st["next"]
            for s in senders:
                s.send(st["pages"], plan.cuts[i], is_last=i == len(plan.cuts) - 1)
            if plan.flow == "layerwise":  # handed over as its forward starts; layers follow
                st["forward"] = list(plan.layer_ends)
            st["next"] += 1
            busy = True
            if plan.abort == "prefill_mid" and not st["forward"]:
                self._abort_mid(st)
        if not all(x in TERMINAL for x in statuses):
            return busy
        failed = all(x is KVPoll.Failed for x in statuses)
        if plan.abort is not None and not failed and self._late_failure_owed(st, statuses):
            return busy  # an aborted room ends Failed everywhere: keep polling (bounded)
        reasons, errors = common.outcome(senders, statuses)
        for s in self._release(idx, senders, statuses):
            s.clear()
        say(event="room", i=idx, status=[int(x) for x in statuses], reason=reasons, error=errors)
        self.free_pages.extend(st["pages"].tolist())
        self.free_aux.append(st["aux"])
        del live[idx]
        return True

    def _late_failure_owed(self, st: dict[str, Any], statuses: list[KVPoll]) -> bool:
        """Whether an aborted room that is not Failed everywhere must still turn Failed. A room
        decode aborted right after opening it (``plan.LATE_ABORTS``) may have ended before the
        abort reached it: then it stays Success on both sides. Prefill cannot tell that from a
        Success whose late failure is still on its way (a working abort sends decode's Abort right
        behind its TransferInfo), so it waits for that failure a heartbeat timeout, then reports."""
        if st["plan"].abort not in sp.LATE_ABORTS or any(x is not KVPoll.Success for x in statuses):
            return True
        since = st.setdefault("all_success_at", time.monotonic())
        return time.monotonic() - since < sp.timeouts(self.args.deadline_scale).heartbeat_timeout_ns / 1e9

    def _next_layers(self, st: dict[str, Any]) -> bool:
        """A layerwise chunk's next layers computed: one report per step, layers in order, as a
        forward pass finishes them. A held room keeps its chunk's last report back (a kill finds
        it mid-stream); ``prefill_mid`` aborts after the first report (layers left unsent)."""
        plan, ends = st["plan"], st["forward"]
        if plan.hold and len(ends) == 1 and st["layers_sent"]:
            return False
        first = st["layers_sent"]
        for s in st["senders"]:
            s.layers_ready(first, ends[0])
        st["layers_sent"] = ends.pop(0) % sp.MODEL.num_layers  # back to 0 once the chunk is done
        if plan.abort == "prefill_mid":
            self._abort_mid(st)
        return True

    def _abort_mid(self, st: dict[str, Any]) -> None:
        for s in st["senders"]:
            s.abort("soak: prefill_mid")
        st["aborted"] = True

    def finish(self) -> dict[str, Any]:
        # A dead decode's pull pages and unconfirmed notes are let go at the fence deadline.
        wait_s = sp.timeouts(self.args.deadline_scale).fence_ns / 1e9 + 10.0
        common.wait_until(lambda: common.empty([common.tables(ep) for ep in self.eps]), wait_s)
        return {
            "leaks": [common.tables(ep) for ep in self.eps],
            "errors": [repr(e) for ep in self.eps for e in ep.errors],
            "driver_errors": [dict(ep.driver.errors) for ep in self.eps],
            "copies": [_copy_tables(ep) for ep in self.eps],
            "counters": [_counters(ep) for ep in self.eps],
        }

    def close(self) -> list[str]:
        return [name for ep in self.eps for name in ep.close()]


def _counters(ep: PrefillEndpoint) -> dict[str, int]:
    with ep.lock:  # the engine only under its endpoint's lock
        out = dict(ep.engine.counters)
        out.update({f"lease_{k}": v for k, v in ep.engine.leases.counters.items()})
        return out


def _copy_tables(ep: PrefillEndpoint) -> int:
    """Gathers the engine still waits for, plus the driver's copy handles and the executor's queue
    (the e2e tests' check): all zero once every room is gone."""
    with ep.lock:  # the engine and the driver's tables only under the endpoint's lock
        n = len(ep.engine.staged.ops) + len(ep.driver.copies)
    return n + (ep.transport.copies.pending() if ep.transport.copies else 0)


def main() -> None:
    args = common.arguments("prefill")
    side = PrefillSide(args)
    executors = sorted({ep.transport.executor for ep in side.eps})
    say(event="ready", addresses=[ep.address for ep in side.eps], pid=os.getpid(), executors=executors)
    common.serve(side.run_segment, side.finish, side.close, side.settle, side.release, side.counts)


if __name__ == "__main__":
    main()
