"""The one table engine of the core: rooms, flow lanes and push leases all run on it.

A table maps ``(state, input)`` to a ``Transition``: the handler that runs and, for each outcome the
handler may return (a short string naming what happened), the state the machine moves to. A
handler never assigns or compares a state; the table decides. In the style of h11's ``_state.py``.

Two drivers share the tables' shape:

- ``fire`` runs one step of a small object machine (a staged lane, a lease): an input the table
  does not list for the current state, or an outcome the step does not list, raises
  ``IllegalStep`` before the state moves; the owner turns that into a failed room, never into a
  wrong state.
- ``TableEngine.dispatch`` runs one step of a room machine: the table is looked up before the
  handler runs; the commands the handler emits are held back and leave the engine only once the
  table accepted the step's outcome, so the commands of an illegal or failed step never leave.
  Failed is reached only through the table: ``fail`` is the single funnel (like h11's
  ``process_error``), feeding the side's ``FAIL`` input, whose table entry leads to the absorbing
  state. An exception from a peer's data (``RoomError``) and one of our own making
  (``RoomStateError``) fail the room; ``LocalMisuseError`` (our caller's mistake) propagates and
  leaves the room untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import msgspec
from kvferry.core.errors import LocalMisuseError, ProtocolError

if TYPE_CHECKING:
    from collections import Counter

__all__ = [
    "IllegalStep",
    "RoomError",
    "RoomFailure",
    "RoomStateError",
    "TableEngine",
    "Transition",
    "fire",
    "step",
]


class IllegalStep(ProtocolError):
    """An input or outcome the table does not allow in the current state."""


class RoomError(ProtocolError):
    """A room-level protocol violation detected inside a handler (the room fails with it), in
    what a peer sent: counted as ``remote_violation``."""


class RoomStateError(ProtocolError):
    """The room cannot go on for a reason of our own, found inside a handler (a chunk the
    scheduler handed over before decode said how long the room is, that turns out too long; a
    peer gone since its TransferInfo): the room fails with it, but no peer misbehaved."""


class Transition(msgspec.Struct, frozen=True):
    """``handler`` is the machine's handler itself (for a room: unbound, called with engine, room,
    input, payload); it returns an outcome, and ``next`` maps each outcome it may return to the
    state the machine moves to."""

    handler: Callable[..., Any]  # its outcome: a key of ``next`` (a room handler's None: stay)
    next: Mapping[str, Any]

    @property
    def targets(self) -> frozenset:
        return frozenset(self.next.values())


def step(handler: Callable[..., str | None], **next_state: Any) -> Transition:
    """One table entry: ``step(handler, stay=S, ready=W)``."""
    return Transition(handler, next_state)


class _HasState(Protocol):
    state: Any


def fire(table: Mapping[Enum, Mapping[Enum, Transition]], obj: _HasState, inp: Enum, *args: Any) -> str:
    """Run the step for ``(obj.state, inp)``; move ``obj`` to the state its outcome names."""
    tr = table[obj.state].get(inp)
    if tr is None:
        raise IllegalStep(f"{inp.value} not allowed while {obj.state.value}")
    outcome = tr.handler(obj, *args)
    nxt = tr.next.get(outcome)
    if nxt is None:
        raise IllegalStep(f"{inp.value} while {obj.state.value}: unexpected outcome {outcome!r}")
    obj.state = nxt
    return outcome


class RoomFailure(msgspec.Struct, frozen=True):
    """Why a room failed. ``error`` is the original exception when one caused it (type and
    message preserved for whoever polls the room)."""

    reason: str
    error: BaseException | None = None
    at_ns: int = 0

    @property
    def error_type(self) -> str | None:
        return None if self.error is None else type(self.error).__name__


class TableEngine:
    """Dispatch of room inputs through a side's table (the sender and receiver room machines).

    A subclass sets ``TABLE`` (state -> input -> Transition), ``FAILED`` (the absorbing state),
    ``SUCCESS``, ``FAIL`` (the input every live state maps to FAILED) and ``BOOKKEEP``, and
    provides ``counters``, ``_now``, ``_out``, ``_entered`` and ``_maybe_finish``.
    """

    TABLE: ClassVar[Mapping[Any, Mapping[Any, Transition]]]
    # Inputs of the engine's parts that the side's TABLE does not name (a room engine's flow
    # components' own tables, core/proto_common.py ``_route_parts``), by state: looked up only
    # when TABLE has no entry, so the side's own inputs pay nothing for them.
    _part_rows: Mapping[Any, Mapping[Any, Transition]] = {}
    # The inputs ``_bookkeep`` acts on: the others skip the call.
    BOOKKEEP: ClassVar[frozenset[Any]] = frozenset()
    FAILED: ClassVar[Enum]
    SUCCESS: ClassVar[Enum]  # with FAILED, the states ``_maybe_finish`` acts on
    FAIL: ClassVar[Enum]  # the failure input: the funnel's way into FAILED

    counters: Counter[str]  # the subclasses' type: mypyc wants one type for an attribute
    _now: int
    _out: list[Any]

    def _entered(self, r: Any) -> None:
        raise NotImplementedError

    def _maybe_finish(self, r: Any) -> None:
        raise NotImplementedError

    def _bookkeep(self, r: Any, inp: Any, payload: Any) -> None:
        """Per-side bookkeeping every state needs, whatever the table says about the input.
        Called only for the inputs in ``BOOKKEEP``: a side that handles another here lists it."""

    def fail(self, r: Any, failure: RoomFailure, **why: Any) -> None:
        """The one way into FAILED: the ``FAIL`` input, through the table (a room already Failed
        absorbs it). ``why`` goes to the side's failure handler (e.g. which peer not to tell)."""
        tr = self.TABLE[r.state][self.FAIL]
        nxt = tr.next.get(tr.handler(self, r, self.FAIL, (failure, why)))
        if nxt is None:
            raise IllegalStep(f"{self.FAIL.value} while {r.state.value}: no next state")
        r.state = nxt

    def transition(self, state: Any, inp: Any) -> Transition | None:
        """The entry this engine runs for ``inp`` in ``state`` (None: not allowed)."""
        tr = self.TABLE[state].get(inp)
        if tr is None:
            rows = self._part_rows.get(state)
            tr = rows.get(inp) if rows else None
        return tr

    def _h_ignore_fail(self, r: Any, inp: Any, payload: Any) -> str:
        return "stay"  # FAILED absorbs another failure: the first reason stands

    def _dispatch(self, r: Any, inp: Any, payload: Any) -> None:
        # The hottest function of both engines (every room input): locals over attribute lookups.
        if inp in self.BOOKKEEP:
            self._bookkeep(r, inp, payload)
        before = r.state
        failed = self.FAILED
        tr = self.TABLE[before].get(inp)
        if tr is None:
            rows = self._part_rows.get(before)  # a flow component's own input (``transition``)
            tr = rows.get(inp) if rows else None
        if tr is None:
            self.counters["illegal_input"] += 1
            self.fail(r, RoomFailure(f"{inp.value} not allowed while {before.value}", at_ns=self._now))
        else:
            # The handler's commands are held until the table accepted the step.
            out = self._out
            held: list[Any] = []
            self._out = held
            try:
                outcome = tr.handler(self, r, inp, payload) or "stay"
            except LocalMisuseError:
                self._out = out
                out += held
                raise  # our own caller's mistake: theirs to handle, the room is untouched
            except Exception as exc:
                # One room's exception fails that room only, type and message kept for the poller.
                self._out = out
                self.counters["room_exception"] += 1
                if isinstance(exc, RoomError):
                    self.counters["remote_violation"] += 1
                if r.state is failed:
                    out += held  # failed through the funnel first: those are the failure's own
                else:
                    self.fail(r, RoomFailure(f"{type(exc).__name__}: {exc}", error=exc, at_ns=self._now))
                    self._withdraw(r, held)
            else:
                self._out = out
                if r.state is failed:
                    # The step failed the room through the funnel (a lease refused while posting):
                    # a step into Failed the table allows; what it emitted is the failure's own
                    # consequence (status, notices, the fence) and leaves.
                    out += held
                else:
                    nxt = tr.next.get(outcome)
                    if nxt is None:
                        reason = f"internal: {inp.value} while {before.value}: outcome {outcome!r}"
                        self.fail(r, RoomFailure(reason))
                        self._withdraw(r, held)
                    else:
                        out += held
                        r.state = nxt
        state = r.state
        if state is not before and state is not failed:
            self._entered(r)
            state = r.state  # entering a state may fail the room (a push lease refused)
        # ``_maybe_finish`` acts only on a settled room (both sides return at once for a live one):
        # the call is skipped for the live rooms most inputs leave behind.
        if state is failed or state is self.SUCCESS:
            self._maybe_finish(r)

    def _withdraw(self, r: Any, held: list[Any]) -> None:
        """The commands of a failed step (an exception, an outcome the table does not list) never
        leave: counted, and whatever the side recorded for them (a write or copy id it would wait
        for) forgotten once the room is Failed, so it does not wait for completions that will
        never come."""
        if held:
            self.counters["commands_withdrawn"] += len(held)
            for cmd in held:
                self._forget_command(r, cmd)

    def _forget_command(self, r: Any, cmd: Any) -> None:
        """A side's undo of one withdrawn command's bookkeeping (none by default)."""
