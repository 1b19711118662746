"""Invariant checks over a finished (or deadline-reached) world, per docs/design.md section 5.

Checked while the run goes (in sim/world.py, as events happen):
- ``status_monotone`` / ``failed_absorbing``: every status change of every (rank, room).
- ``ownership``: every write that lands in decode memory lands in pages (or the aux row) the
  writing room owns at that moment; a write into free or reused pages is corruption.
- ``bytes``: when a room is Success on every decode rank, each rank's pages hold exactly the
  source bytes and the aux row holds the room id.
Checked here:
- ``liveness``: at the deadline (heal + liveness window after the last arrival) every room is
  terminal on every rank that opened it.
- ``conservation``: rooms submitted = succeeded + failed (none left in flight); transfers posted =
  DONE + ERR; every decode outcome agrees with the per-rank statuses.
- ``agreement``: every room ends with the same outcome on both sides (all Success, or Failed on
  both), in every run. Exempt, per room, only what the core cannot guarantee: a node holding the
  room crashed while the room could still settle (a rank not yet terminal, or the sides apart
  and no failure notice delivered yet: the dead process's knowledge is lost),
  or a failure notice (RoomFailed / Abort) of the room was resent for the whole resend window
  (``fence_ns``) and the fabric delivered no copy (its peer was unreachable throughout).
- ``quiescence`` / ``tables_empty``: after quiescence every room's memory is back in the allocators,
  and every per-room table, pending write, transfer handle and queued chunk is gone, and so is
  every staging allocation (ring, pinned pools, worker buffers), held request and copy.
- ``failure_notice``: a prefill rank whose write failed (a post refused, or a transfer in error)
  sent RoomFailed to every decode rank it serves, at the instant it failed (vLLM's missing
  PUSH_FAIL, tracker gap C2: otherwise decode waits for chunks that never come until its own
  deadline). Not judged for a rank that crashed with the room unsettled.
- ``fault_free``: in a run whose scenario injects nothing (no fault rate, event, abort or crash:
  the shipped fault-free scenarios, and the calm seeds of campaigns), every room ends
  Success on both sides and no ring StagingReq had to be resent (decode answers those at once,
  so a resend there means a request was lost inside the core, e.g. one that arrived before its
  room and was dropped; a pinned request waits for space by design and may be repeated).
  A room whose decode allocation differs from prefill's length is expected to fail there.
- ``length``: a room whose decode allocation is shorter or longer than what prefill sends is
  never Success on any rank, at any time (a Success would be a silently truncated or padded cache).
- ``success_stable`` (checked as statuses change, sim/world.py): once a room is Success on every
  rank of both sides and released on a side, no rank of that side reports anything else for it
  (nobody holds a failure to report, so a later change is a late message reviving the room).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.core.kvpoll import KVPoll

if TYPE_CHECKING:
    from kvferry.sim.pages import PageAllocator
    from kvferry.sim.rooms import Request
    from kvferry.sim.world_view import WorldView


def check_liveness(w: WorldView) -> None:
    if not w.scenario.checks.liveness:
        return
    for req in w.requests:
        if not req.opened:
            w.violate("liveness", f"room {req.key} never got memory by the deadline", req)
            continue
        for node in sorted(req.inc):
            st = req.status.get(node)
            if st is not KVPoll.Failed and st is not KVPoll.Success:
                rank = w.ranks[node]
                state = rank.engine.state(req.room) if rank.incarnation == req.inc[node] else None
                w.violate(
                    "liveness",
                    f"room {req.key} still {st.name if st else 'unopened'} on {node} at the deadline "
                    f"(engine state {state.value if state else None})",
                    req,
                )


def check_final(w: WorldView) -> None:
    c = w.scenario.checks
    if c.conservation:
        _conservation(w)
    if c.tables_empty:
        _tables(w)
    if c.agreement:
        _agreement(w)
    if c.fault_free:
        _fault_free(w)
    if c.length:
        _length(w)
    if c.failure_notice:
        _failure_notice(w)
    if c.lease:
        _lease_pairing(w)


def _lease_pairing(w: WorldView) -> None:
    # A push registration matched by request id pairs only with its own request's finish: the
    # engine refuses to write under a wrong pair (push_wrong_pair). Every request id of a run is
    # distinct, so a wrong pair, or two requests found ambiguous, is the registry's bug (suffix
    # stripping that lets different requests meet), never a peer's fault.
    for node, rank in sorted(w.ranks.items()):
        if not node.startswith("prefill"):
            continue
        wrong = rank.engine.counters.get("push_wrong_pair", 0)
        if wrong:
            w.violate("lease", f"{node}: {wrong} push registration(s) paired with another request's finish")
        ambiguous = rank.engine.leases.counters.get("ambiguous", 0)
        if ambiguous:
            w.violate("lease", f"{node}: {ambiguous} push match(es) met distinct requests sharing a base id")


def _length(w: WorldView) -> None:
    log = w.findings.status_log
    ever_success = {key[2] for key, st in log.items() if st is KVPoll.Success}
    for r in w.requests:
        if r.opened and r.mismatched and r.key in ever_success:
            nodes = sorted(
                k[0] for k, st in w.findings.status_log.items() if k[2] == r.key and st is KVPoll.Success
            )
            w.violate(
                "length",
                f"room {r.key}: decode allocated {r.dec_tokens} tokens, prefill sent {r.spec.tokens}, "
                f"yet Success on {', '.join(nodes)}",
                r,
            )


def _failure_notice(w: WorldView) -> None:
    for r in w.requests:
        for node, reason in sorted(r.reason.items()):
            if not node.startswith("prefill") or not reason.startswith("write failed") or node in r.lost_with:
                continue
            failed_at = r.terminal_ns.get(node, -1)
            for ep in w.receivers_of(node, r):
                rec = r.notices.get((node, ep, "RoomFailed"))
                if rec is None or rec[0] > failed_at:
                    w.violate(
                        "failure_notice",
                        f"room {r.key}: {node} failed ({reason}) without telling {ep} at once",
                        r,
                    )


def _fault_free(w: WorldView) -> None:
    # Calm by construction, not by luck: a run that drew fault rates but happened to inject
    # nothing keeps deadlines sized for faults, and may time out under its own load.
    if not w.scenario.faults.injects_nothing() or sum(w.injector.counts.values()):
        return
    for r in w.requests:
        if r.opened and r.outcome != "success" and not r.mismatched:
            why = next((f"{n}: {x}" for n, x in sorted(r.reason.items())), "")
            w.violate(
                "fault_free",
                f"room {r.key} {r.outcome or 'unfinished'} though nothing was injected ({why})",
                r,
            )
    resent = sum(
        rk.engine.counters["staging_req_resent_ring"] for n, rk in w.ranks.items() if n.startswith("prefill")
    )
    if resent:
        # A ring answers every request at once, so only a lost request (or answer) needs one.
        w.violate("fault_free", f"{resent} ring StagingReq resent though no message was lost")


def agreement_exemption(w: WorldView, r: Request) -> str:
    """Why room ``r`` may legitimately end with different outcomes on the two sides ("" if not).

    Judged from what the world recorded for this room alone: the core resends RoomFailed until
    FailedAck and Abort until Stopped, each for ``fence_ns`` after the failure, so a notice can
    only be lost for good if every copy of a stream that long was dropped, or with a process.
    """
    if r.lost_with:
        return f"crash of {', '.join(sorted(r.lost_with))} while the room was unsettled"
    # The resend stream spans the window up to one heartbeat interval of tick granularity at
    # each end (node clocks only shift it, skew is constant per node).
    window = w.timeouts.fence_ns - 2 * w.timeouts.heartbeat_interval_ns
    for (src, dst, kind), (first, last, delivered, _at) in sorted(r.notices.items()):
        if not delivered and last - first >= window:
            return f"every {kind} {src}->{dst} dropped for {(last - first) // 1_000_000} ms"
    return ""


def _agreement(w: WorldView) -> None:
    """Both sides end with the same outcome for every room (Failed on one side reached the other)."""
    for r in w.requests:
        if not r.opened:
            continue
        pre = [r.status.get(n) for n in w.room_nodes(r, "prefill")]
        dec = [r.status.get(n) for n in w.room_nodes(r, "decode")]
        pre_ok = all(st is KVPoll.Success for st in pre)
        dec_ok = all(st is KVPoll.Success for st in dec)
        if pre_ok != dec_ok:
            exempt = agreement_exemption(w, r)
            if exempt:
                w.agreement_exempt.append((r.key, exempt))
                continue
            side = "decode" if pre_ok else "prefill"
            why = next((f"{n}: {x}" for n, x in sorted(r.reason.items())), "")
            w.violate("agreement", f"room {r.key} Success on one side, Failed on {side} ({why})", r)


def _server_allocs(w: WorldView) -> list[tuple[str, tuple[PageAllocator, PageAllocator]]]:
    """Each server's (pages, aux rows) allocators once, named by its server (``prefill``, or
    ``prefill1.`` of several)."""
    return [
        (w.servers[side][i], w.allocs[nodes[0]])
        for side in ("prefill", "decode")
        for i, nodes in enumerate(w.instance_nodes[side])
    ]


def _conservation(w: WorldView) -> None:
    ok = sum(1 for r in w.requests if r.outcome == "success")
    failed = sum(1 for r in w.requests if r.outcome == "failed")
    open_ = len(w.requests) - ok - failed
    if open_:
        w.violate(
            "conservation",
            f"{len(w.requests)} rooms submitted, {ok} succeeded, {failed} failed, "
            f"{open_} never reached an outcome",
        )
    # A room's outcome is decided when every decode rank is terminal; a later Failed (a peer's
    # RoomFailed after release, allowed since Failed overrides) does not un-deliver its bytes.
    st = w.fabric.stats
    inflight = w.fabric.in_flight()
    if st.posts != st.transfers_done + st.transfers_err + inflight or inflight:
        w.violate(
            "conservation",
            f"transfers: {st.posts} posted, {st.transfers_done} done, "
            f"{st.transfers_err} err, {inflight} still in flight after quiescence",
        )


def _tables(w: WorldView) -> None:
    for r in w.requests:
        if not r.done:
            missing = []
            if not r.dec_pages_freed:
                missing.append(f"decode pages (FreePages from {sorted(r.freed)})")
            if not r.pre_pages_freed:
                missing.append("prefill pages")
            w.violate(
                "quiescence",
                f"room {r.key} ({r.outcome or 'no outcome'}) still holds "
                f"{' and '.join(missing)} after quiescence",
                r,
            )
    for server, (pages, aux) in _server_allocs(w):
        for name, alloc in (("pages", pages), ("aux rows", aux)):
            if alloc.used:
                w.violate("tables_empty", f"{alloc.used} {server} {name} still allocated after quiescence")
    for node in sorted(w.ranks):
        rank = w.ranks[node]
        if rank.dead:
            continue
        eng = rank.engine
        # Every per-room table the engine and its flows registered (RoomEngine.track): rooms,
        # peers' rooms, writes, READs, staging allocations, worker slots, held requests, leases...
        leftovers = [f"{n} in {name}" for name, n in sorted(eng.table_sizes().items()) if n]
        # Failure notices outlive the room (like its tombstone), so they are no per-room table;
        # at quiescence every one was answered or given up.
        if getattr(eng, "notices", None):
            leftovers.append(f"{len(eng.notices)} failure notices still resent")
        refs = sorted(eng.referencing(r.room for r in w.requests if r.inc.get(node) == rank.incarnation))
        if refs:
            leftovers.append(f"room entries in {', '.join(refs)}")
        if rank.pending:
            leftovers.append(f"{len(rank.pending)} pending writes in the driver")
        if rank.transport.handles:
            leftovers.append(f"{len(rank.transport.handles)} transfer handles")
        if rank.transport.copies or rank.driver.copies:
            leftovers.append(f"{len(rank.transport.copies)} gathers/scatters")
        queued = rank.queued
        if queued:
            leftovers.append(f"{queued} queued chunks")
        if leftovers:
            w.violate("tables_empty", f"{node}: {', '.join(leftovers)} after quiescence")
    handles = w.fabric.open_handles()
    if handles:
        w.violate("tables_empty", f"fabric handles still open: {handles}")
