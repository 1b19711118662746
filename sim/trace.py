"""The event trace of one run: a running hash for determinism checks, listeners for the invariant
checker, and optional retention for the Chrome/Perfetto trace writer.

Events are (time ns, node, kind, attrs). The hash covers a canonical form of every event, so
two runs with the same seed must produce the same digest, event for event: the msgpack encoding of
(t, node, kind, attrs as (key, value) pairs) when every value is an int, str, bool or None, else
of (t, node, kind, canonical text of the attrs). msgpack is self-delimiting (the concatenation
names each event unambiguously) and the same on every platform and in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

Listener = Callable[["Event"], None]


@dataclass(frozen=True, slots=True)
class Event:
    t: int
    node: str
    kind: str
    attrs: tuple[tuple[str, Any], ...]

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default


_PLAIN = frozenset((int, str, bool, type(None)))


def _canon(v: Any) -> str:
    # repr of ints, strings, tuples and enums is stable; anything else would make the hash
    # depend on object identity, so refuse it loudly.
    if isinstance(v, bool | int | str | float | bytes) or v is None:
        return repr(v)
    if isinstance(v, tuple | list):
        return "(" + ",".join(_canon(x) for x in v) + ")"
    if hasattr(v, "name") and hasattr(v, "value"):  # enums
        return f"{type(v).__name__}.{v.name}"
    raise TypeError(f"trace attribute of type {type(v).__name__} has no canonical form")


_encode = msgspec.msgpack.Encoder().encode


class Trace:
    def __init__(self, clock: Callable[[], int], keep: bool = False) -> None:
        self._clock = clock
        self._hash = hashlib.blake2b(digest_size=16)
        # Events not hashed yet: encoded and hashed in batches (the digest of the concatenation is
        # the digest of the pieces fed one by one), one update per batch instead of per event.
        self._pending: list[tuple[int, str, str, Any]] = []
        self.keep = keep
        self.events: list[Event] = []
        self.count = 0
        self.listeners: list[Listener] = []

    def record(self, kind: str, node: str, **attrs: Any) -> None:
        t = int(self._clock())
        # Keyword order is fixed per call site, so it is already deterministic: no sort needed.
        items = tuple(attrs.items())
        # Ints, strings, bools and None encode the same everywhere; other types (enums, sets, ...)
        # go through the canonical text, which refuses what has no stable form.
        if _PLAIN.issuperset(map(type, attrs.values())):
            row: tuple[int, str, str, Any] = (t, node, kind, items)
        else:
            row = (t, node, kind, ";".join(f"{k}={_canon(v)}" for k, v in items))
        pending = self._pending
        pending.append(row)
        if len(pending) >= 512:
            self._flush()
        self.count += 1
        if self.keep or self.listeners:
            ev = Event(t, node, kind, items)
            if self.keep:
                self.events.append(ev)
            for fn in self.listeners:
                fn(ev)

    def _flush(self) -> None:
        # One C-level call: the batch encoded as a msgpack array is its array header followed by
        # each event's own encoding, so the header cut off leaves exactly the concatenation of
        # the events' encodings (what is hashed), without one encoder call per event.
        pending = self._pending
        n = len(pending)
        if n:
            self._hash.update(_encode(pending)[1 if n < 16 else 3 if n < 1 << 16 else 5 :])
        pending.clear()

    def digest(self) -> str:
        self._flush()
        return self._hash.hexdigest()
