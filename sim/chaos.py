"""Fault schedule of a world: crashes and restarts, link down/up and slow links, and the heal.

A mixin of ``sim.world.World`` (it drives the world's ranks and bookkeeping); kept apart so the
scheduler logic and the fault logic each read on their own. Random per-message faults live in
``sim/faults.py``; this is the timed, per-node part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.core.kvpoll import KVPoll
from kvferry.sim.scenario_schema import US

if TYPE_CHECKING:
    from kvferry.sim.world import World

    _Base = World
else:
    _Base = object


class Chaos(_Base):
    def _fault_schedule(self):  # type: ignore[no-untyped-def]
        s = self.scenario
        actions: list[tuple[int, int, str, Any]] = []
        for i, ev in enumerate(s.faults.events):
            at = ev.at_us * US
            if ev.kind == "crash":
                actions.append((at, i, "crash", ev.node))
                if ev.duration_us:
                    actions.append((at + ev.duration_us * US, i, "restart", ev.node))
            elif ev.kind == "link_down":
                actions.append((at, i, "down", (ev.node, ev.peer)))
                if ev.duration_us:
                    actions.append((at + ev.duration_us * US, i, "up", (ev.node, ev.peer)))
            elif ev.kind == "slow_link":
                actions.append((at, i, "slow", (ev.node, ev.peer, ev.factor)))
                if ev.duration_us:
                    actions.append((at + ev.duration_us * US, i, "fast", (ev.node, ev.peer)))
        heal = s.phases.fault_window_us * US
        actions.append((heal, 1 << 30, "heal", None))
        actions.sort(key=lambda a: (a[0], a[1], a[2]))
        for at, _i, what, arg in actions:
            if at > self.env.now:
                yield self.env.timeout(at - int(self.env.now))
            if what == "heal":
                self._heal()
            elif at >= heal:
                continue  # the network is healed; later faults are not injected
            elif what == "crash":
                self._crash(arg)
            elif what == "restart":
                self._restart(arg)
            elif what == "down":
                self.injector.counts["link_down"] += 1
                self.fabric.set_link(arg[0], arg[1], up=False)
            elif what == "up":
                self.fabric.set_link(arg[0], arg[1], up=True)
            elif what == "slow":
                self.injector.counts["slow_link"] += 1
                num = max(1, int(arg[2] * 1000))
                self.fabric.set_link_speed(arg[0], arg[1], num, 1000)
            elif what == "fast":
                self.fabric.set_link_speed(arg[0], arg[1], 1, 1)

    def _crash(self, node: str) -> None:
        rank = self.ranks[node]
        if rank.dead:
            return
        self.injector.counts["crash"] += 1
        # What this process alone knew about a room still settling dies with it (the agreement
        # check exempts such rooms; sim/checker.py).
        for req in self.requests:
            held = req.inc.get(node, rank.incarnation) == rank.incarnation
            if req.opened and held and self.could_settle(req):
                req.lost_with.add(node)
        rank.crash()
        # After the status reports this incarnation made before dying (deferred, same instant).
        self._later(self._crashed, node, rank.incarnation)

    def _crashed(self, node: str, incarnation: int) -> None:
        """Every room this incarnation held is gone with it: Failed on that rank. On decode that
        includes rooms already Success there whose server-wide outcome is still open: the bytes
        they landed are gone with the memory."""
        decode = node.startswith("decode")
        for req in self.requests:
            if req.inc.get(node) != incarnation:
                continue
            st = req.status.get(node)
            if not _is_terminal(st) or (decode and st is KVPoll.Success and not req.outcome):
                self._mark(req, node, KVPoll.Failed, "node crashed", incarnation)
            else:
                side = "prefill" if node.startswith("prefill") else "decode"
                self._check_side(req, side)

    def _restart(self, node: str) -> None:
        if not self.ranks[node].dead:
            return
        self.fabric.restart(node)
        self._start_rank(node)
        for req in self.requests:
            if node in req.inc:
                self._check_side(req, "prefill" if node.startswith("prefill") else "decode")

    def _heal(self) -> None:
        self.progress.phase = "heal"
        self.trace.record("heal", "scheduler")
        for (a, b), link in sorted(self.fabric.links.items()):
            if not link.up:
                self.fabric.set_link(a, b, up=True)
            if (link.slow_num, link.slow_den) != (1, 1):
                self.fabric.set_link_speed(a, b, 1, 1)
        for node in sorted(self.ranks):
            if self.ranks[node].dead:
                self._restart(node)


def _is_terminal(st: KVPoll | None) -> bool:
    return st is KVPoll.Failed or st is KVPoll.Success
