"""The seam between the room machines and the flows: two small protocols and one registry.

A flow is its prefill half (``FlowSender``: runs a chunk the worker handed over) and its decode
half (``FlowReceiver``: takes a data note that landed). The room machines call a half only
through a narrow context (``SenderContext``, ``ReceiverContext``): what a flow may read of the
room and the rank, and the few things it may do (post, send, record). Each flow module registers
its halves here under its ``Flow``; the room machines look the half up by the room's flow.

A flow that is not one of ``Flow``'s members (a test's flow, an experiment) registers under an
``ExtraFlow`` name; ``Flow.parse`` finds it here, so a room can be opened with it by name like any
other, without a core file naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvferry.core import messages as m
    from kvferry.core.events import ChunkReady, LayersReady

__all__ = [
    "ExtraFlow",
    "FlowHalves",
    "FlowReceiver",
    "FlowSender",
    "LayerSender",
    "ReceiverContext",
    "SenderContext",
    "extra_flow",
    "extra_names",
    "halves",
    "register",
    "unregister",
]


class ExtraFlow(str):
    """The name of a flow outside ``Flow`` (what a room's ``flow`` holds for it): it reads
    like a ``Flow`` member where the room machines and the simulator read one."""

    __slots__ = ()
    staged = False

    @property
    def value(self) -> str:
        return str(self)


class SenderContext(Protocol):
    """What a flow's prefill half may use of the rank and the room it runs a chunk of."""

    endpoint: m.Endpoint
    pool: Any
    planner: Callable[..., Any]
    registration: m.Register | None

    def now(self) -> int: ...

    def chunk_bounds(self, room: Any, chunk: ChunkReady) -> tuple[int, int]:
        """Check the chunk against decode's allocation; its token range (prefix hit clipped)."""
        ...

    def advance(self, room: Any, chunk: ChunkReady, end: int) -> None:
        """The worker's chunk is the room's: the next one may run."""
        ...

    def destinations(self, room: Any) -> list[Any]:
        """``core.worker.Destination`` of every decode rank of the room, in peer order."""
        ...

    def infos_sorted(self, room: Any) -> list[tuple[m.Endpoint, m.TransferInfo]]: ...

    def chunk_note(self, room: Any, chunk: Any, start: int, end: int, **kind: Any) -> bytes: ...

    def new_write(self, room: Any) -> int:
        """A write id the room waits for (its completion comes back as WriteDone/WriteFailed)."""
        ...

    def emit(self, command: Any) -> None: ...

    def send(self, peer: m.Endpoint, msg: Any) -> None: ...

    def room_table(self, name: str) -> dict[Any, Any]:
        """The flow's own per-room table ``name`` (room key -> its record of the room), kept by the
        engine: registered with its quiescence checks, and emptied of a room when it is removed.
        A flow keeps its per-room state there, never on the room."""
        ...

    def finish_run(
        self, room: Any, chunk: ChunkReady, start: int, end: int, posted: list[int], lease: Any = None
    ) -> str:
        """What every run chunk ends with (last chunk's dummy and aux notes); the outcome.
        ``lease``: a flow that posts under registration leases (push) passes them, so the room's
        aux write goes under them too."""
        ...


class FlowSender(Protocol):
    """A flow's prefill half: run the room's next chunk; return the room's table outcome
    ("running", or "done" when nothing is left in flight).

    Optional, looked up by the room machine: ``prepare(ctx, room)``, called whenever the room
    learns of chunks or decode ranks (the staged flows ask for staging space ahead of the worker),
    ``check_peers(flow, registrations)``, called once the flow is chosen, raising to refuse
    decode ranks that cannot receive it (a staged flow needs their staging region), and
    ``plans_ahead`` (true: a chunk the engine names ahead, ``ChunkAhead``, may be planned and
    prepared before it runs; core/flows/ahead.py); a half that does not plan ahead may still
    work ahead on a named chunk: ``named_ahead(ctx, room)`` when one is named (the staged flows
    ask for its space), ``ready_ahead(ctx, room, chunk)`` when it is handed over (true: its run
    starts at once, ``EnqueueChunk.prepared``)."""

    def run_chunk(self, ctx: SenderContext, room: Any, chunk: ChunkReady) -> str: ...


class LayerSender(Protocol):
    """Optional on a prefill half that streams layers (core/flows/layerwise.py): record the
    engine's ``LayersReady`` and post what it can; the room's table outcome ("stay", "running"
    or "done"). A half without it ignores layer reports (its ChunkReady means computed)."""

    def on_layers(self, ctx: SenderContext, room: Any, layers: LayersReady) -> str: ...


class ReceiverContext(Protocol):
    """What a flow's decode half may use of the room a note landed in."""

    def now(self) -> int: ...

    def count(self, what: str) -> None: ...

    def room_table(self, name: str) -> dict[Any, Any]:
        """As ``SenderContext.room_table``, on the decode rank."""
        ...


class FlowReceiver(Protocol):
    """A flow's decode half for the data notes it delivers: record one in the room's ledger
    (raise ``RoomError`` for a note that breaks it); True if it was news, False for a duplicate
    (which it counts as ``duplicate_notification``): only news renews the room's deadline."""

    def on_note(self, ctx: ReceiverContext, room: Any, progress: Any, note: m.ChunkNote) -> bool: ...


@dataclass(frozen=True, slots=True)
class FlowHalves:
    sender: FlowSender
    receiver: FlowReceiver


_HALVES: dict[str, FlowHalves] = {}

# A flow's key: a ``Flow`` member (a StrEnum, so a str: policy.py imports this module, and this
# one names no type of policy.py's, so the two make no cycle), an ``ExtraFlow``, or a plain name.
FlowName = str


def register(flow: FlowName, sender: FlowSender, receiver: FlowReceiver) -> None:
    """Register ``flow``'s halves; a plain name (outside ``Flow``) becomes an ``ExtraFlow``.
    Keys stay as given: a ``Flow`` member hashes by its enum name, not by its value."""
    _HALVES[_key(flow)] = FlowHalves(sender, receiver)


def unregister(flow: FlowName) -> None:
    _HALVES.pop(_key(flow), None)


def _key(flow: FlowName) -> Any:
    return ExtraFlow(flow) if type(flow) is str else flow


def halves(flow: FlowName) -> FlowHalves:
    return _HALVES[flow]


def extra_names() -> tuple[str, ...]:
    """The registered flows outside ``Flow``, in registration order (scenario checks read it)."""
    return tuple(str(k) for k in _HALVES if type(k) is ExtraFlow)


def extra_flow(name: str) -> ExtraFlow | None:
    """The registered flow outside ``Flow`` called ``name``, if any."""
    key = ExtraFlow(name)
    return key if key in _HALVES else None
