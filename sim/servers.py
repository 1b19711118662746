"""The servers of one simulated world: their names, the rank nodes of each, which endpoint and side
each node is, each server's allocators (KV pages, aux rows; shared by its ranks) and the admission
order to them, and who talks to whom for a room between two of them.

One server a side keeps the plain names (prefill0, decode0); instance i of several is server
``prefill{i}.`` (nodes prefill{i}.0, prefill{i}.1, ...: Topology.servers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import simpy
from kvferry.core.geometry import ModelGeometry
from kvferry.core.messages import Endpoint
from kvferry.core.topology import receiver_endpoints, sender_specs
from kvferry.sim.admission import Admission
from kvferry.sim.pages import LowestFirst, PageAllocator
from kvferry.sim.rooms import Request
from kvferry.sim.scenario_schema import Scenario, pools

__all__ = ["Servers"]

Links = tuple[tuple[Any, ...], tuple[Any, ...]]


class Servers:
    __slots__ = ("D", "P", "_links", "_links_by_decode_only", "admission", "allocs", "dec_pools", "endpoint",
                 "model", "names", "nodes", "pre_pools", "side_of")  # fmt: skip

    def __init__(
        self,
        s: Scenario,
        env: simpy.Environment,
        page_allocator: Callable[[str, int], PageAllocator],
        links_by_decode_only: bool = False,
    ) -> None:
        """``page_allocator(side, pages)``: one server's KV page allocator (sim/deploy picks the
        policy); ``links_by_decode_only``: the planted bug ``links_cache_by_decode``."""
        self.pre_pools, self.dec_pools = pools(s)  # per rank, the same on every server of a side
        self.model: ModelGeometry = s.model.geometry()
        t = s.topology
        self.P, self.D = t.prefill_tp, t.decode_tp
        self.names: dict[str, tuple[str, ...]] = {}
        self.nodes: dict[str, tuple[tuple[str, ...], ...]] = {}
        self.endpoint: dict[str, Endpoint] = {}
        self.side_of: dict[str, str] = {}
        # node -> (pages, aux rows) of its server: a room's units come from its own servers.
        self.allocs: dict[str, tuple[PageAllocator, PageAllocator]] = {}
        # Who gets that memory next: first come, first served per (prefill, decode) server pair.
        self.admission = Admission(env)
        for side, n, pages in (
            ("prefill", t.prefill_instances, t.prefill_pages),
            ("decode", t.decode_instances, t.decode_pages),
        ):
            if n < 1:
                raise ValueError(f"{side} instances must be >= 1, got {n}")
            self.names[side] = t.servers(side)
            groups = t.server_nodes(side)
            for server, nodes in zip(self.names[side], groups, strict=True):
                units = (page_allocator(side, pages), LowestFirst(t.aux_rows))
                for r, node in enumerate(nodes):
                    self.endpoint[node] = Endpoint(server, r)
                    self.side_of[node] = side
                    self.allocs[node] = units
            self.nodes[side] = groups
        self._links: dict[tuple[int, int], Links] = {}
        self._links_by_decode_only = links_by_decode_only

    def links(self, req: Request) -> Links:
        """Per decode rank its senders, per prefill rank its receivers, for the room's two servers."""
        pair = (req.pre_inst, req.dec_inst)
        # Planted bug: the cache keyed by the decode server alone (isolation must catch it).
        key = (-1, pair[1]) if self._links_by_decode_only else pair
        got = self._links.get(key)
        if got is None:
            pre, dec = self.names["prefill"][pair[0]], self.names["decode"][pair[1]]
            got = self._links[key] = (
                tuple(sender_specs(self.model, self.P, self.D, d, pre) for d in range(self.D)),
                tuple(receiver_endpoints(self.model, self.P, self.D, p, dec) for p in range(self.P)),
            )
        return got
