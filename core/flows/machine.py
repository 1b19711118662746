"""A transition table of callables, in the style of h11's ``_state.py``.

A handler never assigns a state: it returns an *outcome* (a short string naming what happened),
and the table maps ``(state, input, outcome)`` to the next state. An input the table does not
list for the current state, or an outcome the step does not list, raises ``IllegalStep``: the
caller (a room machine) turns that into a failed room with the reason, never into a wrong state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from kvferry.core.errors import ProtocolError

__all__ = ["IllegalStep", "Step", "fire"]


class IllegalStep(ProtocolError):
    """An input or outcome the table does not allow in the current state."""


@dataclass(frozen=True, slots=True)
class Step:
    handler: Callable[..., str]
    next: Mapping[str, Enum]


class _HasState(Protocol):
    state: Any


def fire(table: Mapping[Enum, Mapping[Enum, Step]], obj: _HasState, inp: Enum, *args: Any) -> str:
    """Run the step for ``(obj.state, inp)``; move ``obj`` to the state its outcome names."""
    step = table[obj.state].get(inp)
    if step is None:
        raise IllegalStep(f"{inp.value} not allowed while {obj.state.value}")
    outcome = step.handler(obj, *args)
    nxt = step.next.get(outcome)
    if nxt is None:
        raise IllegalStep(f"{inp.value} while {obj.state.value}: unexpected outcome {outcome!r}")
    obj.state = nxt
    return outcome
