"""The invariants checked while a simulated run goes (sim/checker.py holds those checked at its
end): as each write lands, that it lands only in memory its own room holds (pages, aux rows,
staging allocations; a pull READ's source pages too), and under a live push lease; a stalled ring
producer that must be writable; and, when a room ends Success on decode, every byte of it.

``World`` builds one ``LiveChecks`` (it reads the world as a ``WorldView``, sim/world_view.py) and
hands ``on_land`` to the fabric; each finding goes through ``violate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from kvferry.backends import pattern
from kvferry.backends.simfabric.descriptors import SMALL, gather_index
from kvferry.backends.simfabric.fabric import Xfer
from kvferry.backends.simfabric.runtime import SimRank
from kvferry.backends.simfabric.transport import AUX_REGION, node_name
from kvferry.core.errors import WireError
from kvferry.core.flows import Flow
from kvferry.core.flows.regions import is_staging_region
from kvferry.core.flows.staged_tx import TxState
from kvferry.core.messages import decode_note
from kvferry.core.resources import writable
from kvferry.sim.pages import FREE, PageAllocator
from kvferry.sim.rooms import AUX_ROW_BYTES, Request

if TYPE_CHECKING:
    from kvferry.sim.world_view import WorldView

__all__ = ["LiveChecks"]

_PUSH = Flow.PUSH.value  # read per landing write (an enum's .value is a property call)


class LiveChecks:
    """The checks of one world's run, reading its rooms, ranks and allocators."""

    def __init__(self, world: WorldView) -> None:
        self.w = world

    def verify(self, req: Request) -> None:
        bad_total = 0
        for node in self.w.room_nodes(req, "decode"):
            rank = self.w.ranks[node]
            bad, first = pattern.mismatches(
                rank.transport.pool, rank.transport.memory.region, req.key, req.dec_pages, req.dec_tokens
            )
            aux = rank.transport.read_aux_room(int(req.dec_aux[0]))
            if aux != req.room:
                bad += 1
                first = first or f"aux row holds room {aux}, expected {req.room}"
            if bad:
                bad_total += bad
                self.w.violate("bytes", f"{node} room {req.key} Success with {bad} wrong bytes: {first}", req)
        req.verified_bad = bad_total
        self.w.trace.record("verify", "scheduler", room=req.room, bad=bad_total)

    def on_land(self, x: Xfer) -> None:
        if not x.dst.startswith("decode") or x.notif is None:
            return
        if self.w.routing.multi and self.w.scenario.checks.isolation:
            self.w.routing.check_land(x)
        if not self.w.scenario.checks.ownership:
            return
        try:
            room = decode_note(x.notif).room
        except WireError:
            room = -1
        req = self.w.by_room.get(room)
        key = req.key if req is not None else -2
        d = x.descs
        n = d.count
        pool = self.w.dec_pools[self.w.fleet.endpoint[x.dst].rank]
        pages, aux_rows = self.w.fleet.allocs[x.dst]
        if n and is_staging_region(int(d.dst_region[0])):
            self._check_staged_land(x, req)
            return
        if x.initiator == x.dst and n:
            self._check_read_source(x, req, key)
        elif req is not None and req.flow == _PUSH and self.w.scenario.checks.lease:
            self._check_lease(x, req)
        if n <= 16:
            other = self._foreign_owner_small(d, pool.page_bytes, key, pages, aux_rows)
            if other is not None:
                self._ownership_violation(x, req, key, other)
            return
        aux = d.dst_region == AUX_REGION
        owners = []
        if (~aux).any():
            first = d.dst_offset[~aux] // pool.page_bytes
            last = (d.dst_offset[~aux] + d.length[~aux] - 1) // pool.page_bytes
            # Every page a descriptor touches, not only its ends.
            owners.append(pages.owner[gather_index(first, last - first + 1)])
        if aux.any():
            owners.append(aux_rows.owner[d.dst_offset[aux] // AUX_ROW_BYTES])
        own = np.concatenate(owners)
        if (own != key).any():
            self._ownership_violation(x, req, key, int(own[own != key][0]))

    def _foreign_owner_small(
        self, d: Any, page_bytes: int, key: int, pages: PageAllocator, aux_rows: PageAllocator
    ) -> int | None:
        """``_on_land``'s check for a few descriptors, in Python (numpy's per-call cost exceeds
        the work): the first owner other than ``key`` of a page (every page a descriptor touches,
        in descriptor order) or, after those, of an aux row; None if the room owns them all."""
        rows = d.rows()
        owner = pages.owner
        seen: set[tuple[int, int]] = set()
        for _, _, r, off, n in rows:
            # Every region of a plan repeats the same (offset, length) runs: pages already found
            # owned by the room need no second look (the first foreign owner stays the same).
            if r != AUX_REGION and (off, n) not in seen:
                seen.add((off, n))
                for o in owner[off // page_bytes : (off + n - 1) // page_bytes + 1].tolist():
                    if o != key:
                        return o
        aux_owner = aux_rows.owner
        for _, _, r, off, _ in rows:
            if r == AUX_REGION:
                o = int(aux_owner[off // AUX_ROW_BYTES])
                if o != key:
                    return o
        return None

    def _ownership_violation(self, x: Xfer, req: Request | None, key: int, other: int) -> None:
        who = "free pages" if other == FREE else f"pages of room {other}"
        why = ""
        opened_on = req.inc.get(x.dst) if req is not None else None
        now_inc = self.w.fabric.nodes[x.dst].incarnation
        if opened_on is not None and opened_on != now_inc:
            why = f" (room opened on {x.dst} incarnation {opened_on}, written into incarnation {now_inc})"
        self.w.violate("ownership", f"write of room {key} from {x.src} landed in {who} on {x.dst}{why}", req)

    def _check_read_source(self, x: Xfer, req: Request | None, key: int) -> None:
        """A pull READ copies prefill pages its room still owns: pages freed (or handed to another
        room) before decode's READ of them finished would give decode someone else's bytes."""
        if not x.src.startswith("prefill"):
            return
        d = x.descs
        pool = self.w.pre_pools[self.w.fleet.endpoint[x.src].rank]
        first = d.src_offset // pool.page_bytes
        last = (d.src_offset + d.length - 1) // pool.page_bytes
        own = self.w.fleet.allocs[x.src][0].owner[gather_index(first, last - first + 1)]
        if (own != key).any():
            other = int(own[own != key][0])
            who = "free pages" if other == FREE else f"pages of room {other}"
            self.w.violate("ownership", f"READ of room {key} by {x.dst} copied {who} of {x.src}", req)

    def _check_lease(self, x: Xfer, req: Request) -> None:
        """Nothing is written under an expired push lease: a write posted at or after the instant
        its registration's lease ran out (or that it could have, unrenewed) is a violation."""
        eng = self.w.ranks[x.src].engine
        leases = getattr(eng, "leases", None)
        if leases is None or self.w.ranks[x.src].incarnation != req.inc.get(x.src):
            return
        key = eng.lease_key(req.tid, x.dst)
        live = leases.leases.get(key)
        ended = leases.expired_at.get(key)
        if live is not None and live.state.value == "matched" and live.deadline <= x.posted_ns:
            ended = live.deadline
        if ended is not None and x.posted_ns >= ended:
            self.w.violate(
                "lease",
                f"write of room {req.key} from {x.src} to {x.dst} posted at {x.posted_ns} ns, "
                f"after its lease ended at {ended} ns",
                req,
            )

    def ring_progress(self, rank: SimRank) -> None:
        """A producer waiting on a watermark resumes once the consumer drains: a lane whose slot
        is the oldest live one of its decode ring, and that has heard that ring's current
        watermark, must be writable. A lane blocked there is a wedge (the upstream stale tail)."""
        eng = rank.engine
        for room in sorted(eng.staged.stalled):
            r = eng.rooms.get(room)
            if r is None:
                continue
            for lane in eng.staged.lanes(r.key):
                if not lane.accepted or lane.state is not TxState.GRANTED or lane.flow is not Flow.RING:
                    continue
                dec = self.w.ranks.get(node_name(lane.target))
                if dec is None or dec.dead or dec.engine.staged.ring is None:
                    continue
                ring = dec.engine.staged.ring
                oldest = next(iter(ring.live.values()), None)
                g = lane.grant
                heard = eng.staged.peer_wm.get((lane.target, "ring"))
                if oldest is None or g is None or oldest.alloc_id != g.alloc_id or heard != ring.watermark():
                    continue
                if not writable(oldest, heard):
                    req = self.w.by_room.get(room)
                    self.w.violate(
                        "ring_progress",
                        f"{rank.node} room {req.key if req else room} chunk {lane.index}: the oldest slot "
                        f"of {lane.target}'s ring (round {oldest.round}, [{oldest.offset}, {oldest.end})) is "
                        f"not writable under the ring's own watermark {tuple(heard)}",
                        req,
                    )

    def _check_staged_land(self, x: Xfer, req: Request | None) -> None:
        """A staged write lands only inside a live allocation its own room holds there."""
        d = x.descs
        key = (req.room, req.tid) if req is not None else None
        if d.count <= SMALL:  # one descriptor a staged write: Python's min and max, not numpy's
            offsets = d.dst_offset.tolist()
            lo, hi = min(offsets), max(o + n for o, n in zip(offsets, d.length.tolist(), strict=True))
        else:
            lo, hi = int(d.dst_offset.min()), int((d.dst_offset + d.length).max())
        if self.w.ranks[x.dst].engine.staging_holds(key, int(d.dst_region[0]), lo, hi):
            return
        who = req.key if req is not None else "unknown"
        where = f"[{lo}, {hi}) of region {int(d.dst_region[0])} on {x.dst}"
        self.w.violate(
            "ownership",
            f"staged write of room {who} from {x.src} into {where}, outside its live allocations",
            req,
        )
