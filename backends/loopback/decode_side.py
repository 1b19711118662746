"""The soak's decode process: every decode rank over real NIXL. Every Success room's bytes are
checked against the pattern prefill computed; a failed room's pages go back to the allocator only
once the core says they are fenced (``pages_freed``), so a late write would corrupt a later room
and be caught by that room's check. Free pages and aux rows hold a canary, checked when they are
handed out again and at the end: a write that lands while they are free is caught there."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from kvferry.backends import pattern
from kvferry.backends.loopback import common
from kvferry.backends.loopback import plan as sp
from kvferry.backends.loopback.wire import say
from kvferry.backends.runtime import DecodeEndpoint, RuntimeConfig
from kvferry.core.kvpoll import KVPoll

TERMINAL = (KVPoll.Success, KVPoll.Failed)
# The checkers' self-tests: "corrupt" flips decode's bytes under some Success rooms before they are
# checked (tests/test_soak.py); "reuse_unfenced" hands a failed room's pages and aux row out again
# without waiting for its fence, so a late write of a stalled or cut-off prefill lands in free or
# reused pages (``kvferry chaos --plant reuse_unfenced``). The soak must report both.
PLANT = os.environ.get("KVFERRY_SOAK_PLANT", "")
# A race forced, not a bug: "abort_after_success" issues a ``decode_early`` room's abort only once
# the room is Success on every rank, as a loaded host does now and then when decode is descheduled
# between opening the room and aborting it (tests/test_soak_late_abort.py). The abort is a no-op.
RACE = os.environ.get("KVFERRY_SOAK_RACE", "")
CANARY_ROOM = 0x6B76_6665_7272_7921  # the pattern key of a free page ("kvferry!")
CANARY_AUX = CANARY_ROOM.to_bytes(8, "little", signed=True)


class DecodeSide(common.SideLoop):
    HANDLES = "rvs"

    def __init__(self, args: Any) -> None:
        self.args = args
        cfg = RuntimeConfig(
            timeouts=sp.timeouts(args.deadline_scale),
            aux_rows=sp.AUX_ROWS,
            staging=sp.staging(),
            host=args.host,
            nixl_engine=args.engine,
            write_quarantine_s=args.quarantine_s,
            lost_peer_drain_s=args.drain_s or None,
        )
        self.eps = [
            DecodeEndpoint(
                "decode", pool, prefill_server="prefill", prefill_addresses=args.prefill, config=cfg
            )
            for pool in sp.decode_pools(args.decode_tp)
        ]
        for ep in self.eps:
            ep.start()
        self.rng = np.random.default_rng([args.seed, args.incarnation])  # scattered pages
        self.last_owner: dict[tuple[str, int], tuple[str, float]] = {}  # and when it was freed
        self.free_pages: list[int] = []
        self.free_aux: list[int] = []
        self._give_back(np.arange(sp.DECODE_PAGES), range(sp.AUX_ROWS))
        # A failed room's pages and aux row (and its unfenced receivers) until every rank is fenced.
        self.waiting_fence: dict[int, tuple[np.ndarray, int, list[Any], str]] = {}
        self.unfenced: list[Any] = []  # the planted bug's receivers, cleared once fenced

    def _give_back(self, pages: Any, aux_rows: Any, owner: str = "") -> None:
        """Free pages and aux rows, each stamped with the canary first; ``owner`` (the room that
        held them) names the suspect if a canary breaks."""
        now = time.monotonic()
        for page in pages:
            self.last_owner[("page", int(page))] = (owner, now)
        for row in aux_rows:
            self.last_owner[("aux row", row)] = (owner, now)
        for ep in self.eps:
            for page in pages:
                pattern.fill(ep.pool, ep.transport.region, CANARY_ROOM, np.array([page]), 0, sp.DECODE_PAGE)
            for row in aux_rows:
                ep.transport.write_aux_row(row, CANARY_AUX)
        self.free_pages.extend(int(p) for p in pages)
        self.free_aux.extend(aux_rows)

    def _was(self, what: tuple[str, int]) -> str:
        owner, at = self.last_owner.get(what, ("nobody", time.monotonic()))
        return f"freed {time.monotonic() - at:.1f} s before, last held by {owner}"

    def _canary_bad(self, pages: Any, aux_rows: Any) -> list[str]:
        """The free pages and aux rows among these whose canary changed: a write landed there."""
        bad = []
        for ep in self.eps:
            for page in pages:
                n, _ = pattern.mismatches(
                    ep.pool, ep.transport.region, CANARY_ROOM, np.array([page]), sp.DECODE_PAGE
                )
                if n:
                    was = self._was(("page", int(page)))
                    bad.append(f"rank {ep.pool.tp_rank} page {int(page)}: {n} bytes ({was})")
            for row in aux_rows:
                if ep.transport.read_aux_room(row) != CANARY_ROOM:
                    bad.append(f"rank {ep.pool.tp_rank} aux row {row} ({self._was(('aux row', row))})")
        return bad

    def _open(self, pending: list[sp.SoakRoom], live: dict[int, dict[str, Any]]) -> bool:
        busy = False
        while pending and len(live) < sp.WINDOW:
            plan = pending[-1]
            need = -(-plan.tokens // sp.DECODE_PAGE)
            if need > len(self.free_pages) or not self.free_aux:
                break
            pending.pop()
            pages = np.array(
                [self.free_pages.pop(int(self.rng.integers(len(self.free_pages)))) for _ in range(need)]
            )
            aux = self.free_aux.pop()
            canary_bad = self._canary_bad(pages, [aux])
            rvs = [ep.receiver(plan.room, plan.tid) for ep in self.eps]
            for rv in rvs:
                rv.init(pages, plan.tokens, aux)
            aborted = plan.abort == "decode_early" and RACE != "abort_after_success"
            if aborted:
                for rv in rvs:
                    rv.abort("soak: decode_early")
            live[plan.index] = {"plan": plan, "pages": pages, "aux": aux, "rvs": rvs, "aborted": aborted}
            live[plan.index]["canary_bad"] = canary_bad
            busy = True
        return busy

    def _step(self, live: dict[int, dict[str, Any]], idx: int) -> bool:
        st = live[idx]
        plan, rvs = st["plan"], st["rvs"]
        statuses = [rv.poll() for rv in rvs]
        if plan.abort == "decode_mid" and not st["aborted"] and min(statuses) >= KVPoll.Transferring:
            for rv in rvs:
                rv.abort("soak: decode_mid")
            st["aborted"] = True
            return True
        if not all(x in TERMINAL for x in statuses):
            return False
        if plan.abort == "decode_early" and not st["aborted"]:  # the forced race: the room ended
            for rv in rvs:
                rv.abort("soak: decode_early, after the room ended")
            st["aborted"] = True
        if plan.abort is not None and KVPoll.Success in statuses and KVPoll.Failed in statuses:
            # A rank the abort reached after its room ended, while another's abort worked: the
            # failure notice that rank's prefill peer sends turns it Failed. Wait for it.
            return False
        bad, first_bad, aux_ok = self._check_bytes(idx, st, statuses)
        reasons, errors = common.outcome(rvs, statuses)
        unfenced = []
        for rv, status in zip(rvs, statuses, strict=True):
            if status is KVPoll.Failed and not rv.pages_freed():
                unfenced.append(rv)  # cleared once fenced (_reclaim)
        # Kept or cleared by the statuses this report names, not a second poll: a rank that turned
        # Failed since (a failure notice landing right behind its last READ, after a thaw) would
        # be cleared while reported Success, and settling would never report the change.
        done = [(rv, s) for rv, s in zip(rvs, statuses, strict=True) if rv not in unfenced]
        for rv in self._release(idx, [rv for rv, _ in done], [s for _, s in done]):
            rv.clear()
        say(
            event="room",
            i=idx,
            status=[int(x) for x in statuses],
            reason=reasons,
            error=errors,
            bad_bytes=bad,
            first_bad=repr(first_bad) if first_bad else None,
            aux_ok=aux_ok,
            canary_bad=st["canary_bad"][:4],
        )
        owner = f"room {idx}, {plan.flow}, status {[int(x) for x in statuses]} {reasons}"[:300]
        self._hand_back(idx, st, unfenced, owner)
        del live[idx]
        return True

    def _check_bytes(self, idx: int, st: dict[str, Any], statuses: list[KVPoll]) -> tuple[int, Any, bool]:
        """(wrong bytes, the first wrong one, aux row right) over the ranks where the room is
        Success; the "corrupt" plant flips bytes first."""
        plan = st["plan"]
        if PLANT == "corrupt" and idx % 50 == 7 and KVPoll.Success in statuses:
            self.eps[0].transport.region(self.eps[0].pool.regions[0].region_id)[:] ^= 0xFF
        bad, first_bad, aux_ok = 0, None, True
        for ep, status in zip(self.eps, statuses, strict=True):
            if status is KVPoll.Success:
                n, first = pattern.mismatches(
                    ep.pool, ep.transport.region, plan.room, st["pages"], plan.tokens
                )
                bad += n
                first_bad = first_bad or first
                aux_ok &= ep.transport.read_aux_room(st["aux"]) == plan.room
        return bad, first_bad, aux_ok

    def _hand_back(self, idx: int, st: dict[str, Any], unfenced: list[Any], owner: str) -> None:
        """The room's pages and aux row wait for every unfenced rank's fence (or, planted, go
        back at once), then whatever is fenced by now returns to the allocator."""
        if PLANT == "reuse_unfenced" and unfenced:
            self.unfenced += unfenced  # the bug: the pages are handed out before the fence
            self._give_back(st["pages"], [st["aux"]], owner)
        else:
            self.waiting_fence[idx] = (st["pages"], st["aux"], unfenced, owner)
        self._reclaim()

    def _reclaim(self) -> None:
        """Pages of rooms whose every failed rank is now fenced go back to the allocator."""
        for key in list(self.waiting_fence):
            pages, aux, unfenced, owner = self.waiting_fence[key]
            if all(rv.pages_freed() for rv in unfenced):
                for rv in unfenced:
                    rv.clear()
                del self.waiting_fence[key]
                self._give_back(pages, [aux], owner)
        for rv in [rv for rv in self.unfenced if rv.pages_freed()]:
            rv.clear()
            self.unfenced.remove(rv)

    def finish(self) -> dict[str, Any]:
        def settled() -> bool:
            self._reclaim()
            return (
                not self.waiting_fence
                and not self.unfenced
                and common.empty([common.tables(ep) for ep in self.eps])
            )

        # A failed room of a killed prefill is fenced by its deadline: wait a little longer.
        common.wait_until(settled, sp.timeouts(self.args.deadline_scale).fence_ns / 1e9 + 10.0)
        counters = []
        for ep in self.eps:
            with ep.lock:  # the engine only under its lock
                counters.append(dict(ep.engine.counters))
        return {
            "leaks": [common.tables(ep) for ep in self.eps],
            "waiting_fence": len(self.waiting_fence),
            "pages_free": len(self.free_pages),
            # Writes that landed in free pages after their last hand-out (none may).
            "canary_bad": self._canary_bad(self.free_pages, self.free_aux)[:8],
            "errors": [repr(e) for ep in self.eps for e in ep.errors],
            "driver_errors": [dict(ep.driver.errors) for ep in self.eps],
            "counters": counters,
        }

    def close(self) -> list[str]:
        return [name for ep in self.eps for name in ep.close()]


def main() -> None:
    args = common.arguments("decode")
    side = DecodeSide(args)
    executors = sorted({ep.transport.executor for ep in side.eps})
    say(event="ready", address=side.eps[0].address, pid=os.getpid(), executors=executors)
    common.serve(side.run_segment, side.finish, side.close, side.settle, side.release, side.counts)


if __name__ == "__main__":
    main()
