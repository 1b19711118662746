"""Several prefill and decode servers in one world: routing rooms to them, and the ``isolation``
check that every room's traffic stays between its own two servers.

A part the world composes (``World.routing``): the world names the servers and gives each its
own allocators (``World._instances``); this module decides where each room runs and watches for a
room crossing into a server it was not routed to. It sees the world only through what it is given
(the servers, the room table, the trace and the violation sink), so it imports no world. A world
of one server a side routes nothing and checks nothing here (every node is then every room's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvferry.backends.simfabric.fabric import Xfer
from kvferry.core.errors import WireError
from kvferry.core.messages import decode_note
from kvferry.sim.deploy.router import Router
from kvferry.sim.rooms import Request

__all__ = ["Routing"]


class Routing:
    def __init__(
        self,
        servers: dict[str, tuple[str, ...]],
        instance_nodes: dict[str, tuple[tuple[str, ...], ...]],
        by_room: dict[int, Request],
        record: Callable[..., Any],
        violate: Callable[[str, str, Request | None], None],
    ) -> None:
        """A router when either side has several servers (None: one server a side).

        The decode load is the rooms routed there whose decode memory is not back yet (waiting
        for memory, transferring, or fenced after a failure): what a real router would see.
        """
        self.by_room = by_room
        self.record = record
        self.violate = violate
        pre, dec = (len(servers[side]) for side in ("prefill", "decode"))
        self.multi = (pre, dec) != (1, 1)
        self.router: Router | None = Router(pre, dec) if self.multi else None
        self.dec_load = [0] * dec
        self._loaded: set[int] = set()  # keys counted in dec_load until their decode pages are freed
        # node -> (side, server index): which server a node belongs to, for the isolation check.
        self.server_of = {
            n: (side, i)
            for side, groups in instance_nodes.items()
            for i, nodes in enumerate(groups)
            for n in nodes
        }

    def route(self, req: Request) -> None:
        """Pick the room's servers (the same arrivals always give the same routes: no randomness)."""
        if self.router is None:
            return
        req.pre_inst, req.dec_inst = self.router.route(self.dec_load)
        self.dec_load[req.dec_inst] += 1
        self._loaded.add(req.key)
        self.record("route", "scheduler", room=req.room, prefill=req.pre_inst, decode=req.dec_inst)

    def unload(self, req: Request) -> None:
        """The room's decode memory is back: its decode server has one room less in flight."""
        if req.key in self._loaded:
            self._loaded.discard(req.key)
            self.dec_load[req.dec_inst] -= 1

    def _owns(self, req: Request, node: str) -> bool:
        """``node`` is a rank of one of the room's two servers."""
        side, i = self.server_of[node]
        return i == (req.pre_inst if side == "prefill" else req.dec_inst)

    def _isolated(self, req: Request | None, src: str, dst: str, what: str) -> None:
        """Traffic about ``req`` between ``src`` and ``dst`` must stay on the room's servers."""
        if req is None or (self._owns(req, src) and self._owns(req, dst)):
            return
        self.violate("isolation", f"{what} of room {req.key} from {src} to {dst}, {self._route_of(req)}", req)

    def check_land(self, x: Xfer) -> None:
        try:
            room = decode_note(x.notif).room  # type: ignore[arg-type]
        except WireError:
            return
        req = self.by_room.get(room)
        self._isolated(req, x.src, x.dst, "READ" if x.initiator == x.dst else "write")

    def check_message(self, msg: object, src: str, dst: str) -> None:
        room = getattr(msg, "room", None)
        if room is None:
            return  # a message about the peer (Register, Heartbeat, Watermark), not a room
        req = self.by_room.get(room)
        if req is not None and req.tid == getattr(msg, "transfer_id", None):
            self._isolated(req, src, dst, type(msg).__name__)

    def check_status(self, req: Request, node: str) -> None:
        """Only the room's own ranks may report a status for it (it was opened nowhere else)."""
        if not self._owns(req, node):
            why = f"{node} reported a status for room {req.key}, {self._route_of(req)}"
            self.violate("isolation", why, req)

    @staticmethod
    def _route_of(req: Request) -> str:
        return f"though the room runs on prefill instance {req.pre_inst} and decode instance {req.dec_inst}"
