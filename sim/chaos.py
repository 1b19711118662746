"""Fault schedule of a world: crashes and restarts, link down/up and slow links, and the heal.

A part the world composes (``World.chaos``): it drives the world's ranks and bookkeeping through
a ``WorldView`` (sim/world_view.py), so the scheduler logic and the fault logic each read on their
own. Random per-message faults live in ``sim/faults.py``; this is the timed, per-node part.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy
from kvferry.core.kvpoll import KVPoll
from kvferry.sim.scenario_schema import US
from kvferry.sim.world_view import WorldView

__all__ = ["Chaos"]


class Chaos:
    """The timed faults of one run, and the heal at the end of its fault window."""

    def __init__(self, world: WorldView) -> None:
        self.w = world

    def schedule(self) -> Generator[simpy.Event, Any, None]:
        """The world's process that injects each timed fault, then heals the network."""
        w = self.w
        s = w.scenario
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
            if at > w.env.now:
                yield w.env.timeout(at - int(w.env.now))
            if what == "heal":
                self.heal()
            elif at >= heal:
                continue  # the network is healed; later faults are not injected
            elif what == "crash":
                self.crash(arg)
            elif what == "restart":
                self.restart(arg)
            elif what == "down":
                w.injector.counts["link_down"] += 1
                w.fabric.set_link(arg[0], arg[1], up=False)
            elif what == "up":
                w.fabric.set_link(arg[0], arg[1], up=True)
            elif what == "slow":
                w.injector.counts["slow_link"] += 1
                num = max(1, int(arg[2] * 1000))
                w.fabric.set_link_speed(arg[0], arg[1], num, 1000)
            elif what == "fast":
                w.fabric.set_link_speed(arg[0], arg[1], 1, 1)

    def crash(self, node: str) -> None:
        w = self.w
        rank = w.ranks[node]
        if rank.dead:
            return
        w.injector.counts["crash"] += 1
        # What this process alone knew about a room still settling dies with it (the agreement
        # check exempts such rooms; sim/checker.py).
        for req in w.requests:
            held = req.inc.get(node, rank.incarnation) == rank.incarnation
            if req.opened and held and w.could_settle(req):
                req.lost_with.add(node)
        rank.crash()
        # After the status reports this incarnation made before dying (deferred, same instant).
        w.later(self._crashed, node, rank.incarnation)

    def _crashed(self, node: str, incarnation: int) -> None:
        """Every room this incarnation held is gone with it: Failed on that rank. On decode that
        includes rooms already Success there whose server-wide outcome is still open: the bytes
        they landed are gone with the memory."""
        decode = node.startswith("decode")
        for req in self.w.requests:
            if req.inc.get(node) != incarnation:
                continue
            st = req.status.get(node)
            if not _is_terminal(st) or (decode and st is KVPoll.Success and not req.outcome):
                self.w.mark(req, node, KVPoll.Failed, "node crashed", incarnation)
            else:
                side = "prefill" if node.startswith("prefill") else "decode"
                self.w.check_side(req, side)

    def restart(self, node: str) -> None:
        w = self.w
        if not w.ranks[node].dead:
            return
        w.fabric.restart(node)
        w.start_rank(node)
        for req in w.requests:
            if node in req.inc:
                w.check_side(req, "prefill" if node.startswith("prefill") else "decode")

    def heal(self) -> None:
        w = self.w
        w.progress.phase = "heal"
        w.trace.record("heal", "scheduler")
        for (a, b), link in sorted(w.fabric.links.items()):
            if not link.up:
                w.fabric.set_link(a, b, up=True)
            if (link.slow_num, link.slow_den) != (1, 1):
                w.fabric.set_link_speed(a, b, 1, 1)
        for node in sorted(w.ranks):
            if w.ranks[node].dead:
                self.restart(node)


def _is_terminal(st: KVPoll | None) -> bool:
    return st is KVPoll.Failed or st is KVPoll.Success
