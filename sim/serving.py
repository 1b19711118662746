"""The servers around the room process, as the world calls out to them (``World.serving``): which
page allocator each server has, the planner its engines plan with, routing at arrival, decode's
admission, prefill's forward pass, when decode opens the room, what happens once a side settles,
and when decode's pages go back.

``Serving`` is a scenario's servers (the defaults); sim/deploy/world.py's ``DeployWorld`` is a
deployment's (chunked-prefill steps, a decode batch loop, SGLang's page allocator and decode
memory), which composes a ``World`` and serves it. The world hands itself over first thing in
its constructor (``attach``), before it calls any of these.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import simpy
from kvferry.sim.pages import LowestFirst, PageAllocator
from kvferry.sim.rooms import Request
from kvferry.sim.world_view import WorldView

__all__ = ["Serving"]

Process = Generator[simpy.Event, Any, None]


class Serving:
    """A scenario's servers: lowest-first pages, the core's planner, routing by sim/instances.py,
    a forward pass of ``compute_ns_per_token`` per token, decode opening ``decode_lag_us`` late."""

    world: WorldView

    def attach(self, world: WorldView) -> None:
        self.world = world

    def page_allocator(self, side: str, n: int) -> PageAllocator:
        """One server's KV page allocator."""
        return LowestFirst(n)

    def rank_planner(self) -> Any:
        """The planner every rank's engine plans with (None: the core's own)."""
        return None

    def arrived(self, req: Request) -> bool:
        """The request arrived: choose its servers (``req.pre_inst``, ``req.dec_inst``); False
        drops it (a deployment's router refusing it). One server a side: nothing to choose."""
        self.world.routing.route(req)
        return True

    def decode_fits(self, req: Request, pages: PageAllocator, n: int) -> bool:
        """Whether decode can give the request ``n`` pages now."""
        return pages.used + n <= self.world.scenario.topology.decode_pages

    def admitted(self, req: Request) -> None:
        """The request got its pages on both sides."""

    def compute_chunk(
        self, req: Request, start: int, tokens: int, on_layer: Callable[[int], None] | None = None
    ) -> Process:
        """Prefill's forward pass over one chunk; ``on_layer(layer)`` as each layer finishes, for
        a flow that streams layers."""
        w = self.world
        total = max(1, tokens * w.scenario.workload.compute_ns_per_token)
        if on_layer is None:
            yield w.env.timeout(total)
        else:
            yield from w.layers(total, on_layer)

    def decode_opens_late(self, req: Request) -> bool:
        """Whether prefill opens first and decode later (``open_decode_later``)."""
        return bool(req.spec.decode_lag_us)

    def open_decode_later(self, req: Request, lag_ns: int) -> Process:
        w = self.world
        yield w.env.timeout(lag_ns)
        w.open_decode(req)
        w.check_side(req, "decode")

    def side_checked(self, req: Request, side: str, had: str) -> None:
        """After the world reacted to the room's state on ``side``; ``had``: its outcome before."""

    def free_dec_pages(self, req: Request) -> None:
        """Decode's pages of the room may go back: they do, at once."""
        self.world.release_dec_pages(req)
