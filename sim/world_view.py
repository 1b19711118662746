"""What the parts a world composes read of it: the invariant checker (sim/checker.py), the live
checks (sim/live_checks.py), the fault schedule (sim/chaos.py) and the servers (sim/serving.py)
each take a ``WorldView``, never ``sim.world.World`` itself, so none of them imports the world and
the world imports them with no cycle, not even a type-only one. ``World`` is one; a test may hand
them any other.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol

import simpy
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.runtime import SimRank
from kvferry.core.deadlines import Timeouts
from kvferry.core.geometry import PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.sim.faults import Injector
from kvferry.sim.instances import Routing
from kvferry.sim.pages import PageAllocator
from kvferry.sim.rooms import Findings, Progress, Request
from kvferry.sim.scenario_schema import Scenario
from kvferry.sim.servers import Servers
from kvferry.sim.trace import Trace

__all__ = ["WorldView"]


class WorldView(Protocol):
    """A run's world as its checkers and its fault schedule see it."""

    @property
    def scenario(self) -> Scenario: ...
    @property
    def env(self) -> simpy.Environment: ...
    @property
    def fabric(self) -> Fabric: ...
    @property
    def injector(self) -> Injector: ...
    @property
    def trace(self) -> Trace: ...
    @property
    def progress(self) -> Progress: ...
    @property
    def findings(self) -> Findings: ...
    @property
    def timeouts(self) -> Timeouts: ...
    @property
    def ranks(self) -> dict[str, SimRank]: ...
    @property
    def fleet(self) -> Servers: ...
    @property
    def routing(self) -> Routing: ...
    @property
    def requests(self) -> list[Request]: ...
    @property
    def by_room(self) -> dict[int, Request]: ...
    @property
    def agreement_exempt(self) -> list[tuple[int, str]]: ...
    @property
    def pre_pools(self) -> tuple[PoolGeometry, ...]: ...
    @property
    def dec_pools(self) -> tuple[PoolGeometry, ...]: ...
    @property
    def servers(self) -> dict[str, tuple[str, ...]]: ...
    @property
    def instance_nodes(self) -> dict[str, tuple[tuple[str, ...], ...]]: ...
    @property
    def allocs(self) -> dict[str, tuple[PageAllocator, PageAllocator]]: ...

    def room_nodes(self, req: Request, side: str) -> tuple[str, ...]: ...

    def receivers_of(self, node: str, req: Request) -> list[str]: ...

    def violate(self, invariant: str, detail: str, req: Request | None = None) -> None: ...

    def could_settle(self, req: Request) -> bool: ...

    def later(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at this simulated instant, after the current callback."""
        ...

    def mark(self, req: Request, node: str, status: KVPoll, reason: str, inc: int | None = None) -> None:
        """A rank reported ``status`` for the room."""
        ...

    def check_side(self, req: Request, side: str) -> None:
        """React to the room's state on one side (free its memory, settle its outcome)."""
        ...

    def start_rank(self, node: str) -> None:
        """Start (or restart) the engine and transport of ``node``."""
        ...

    def open_decode(self, req: Request) -> None:
        """Open the room on every decode rank of its server."""
        ...

    def layers(self, total_ns: int, on_layer: Callable[[int], None]) -> Generator[simpy.Event, Any, None]:
        """A forward pass of ``total_ns`` layer by layer, ``on_layer`` after each."""
        ...

    def release_dec_pages(self, req: Request) -> None:
        """Decode's pages and aux row of the room back to its server."""
        ...
