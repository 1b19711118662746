"""Typed errors shared by every kvferry module.

Each area subclasses KvferryError with its own precise types so callers can tell a bad geometry
from a malformed wire message from a protocol violation without parsing message strings.
"""

from __future__ import annotations


class KvferryError(Exception):
    """Base class of every error kvferry raises on purpose."""


class GeometryError(KvferryError, ValueError):
    """A KV geometry, pool description or TP combination that cannot exist."""


class PlanError(KvferryError, ValueError):
    """A transfer that cannot be planned: page ids out of range, lengths that disagree, ..."""


class WireError(KvferryError, ValueError):
    """A control message or notification that failed decoding or validation."""


class ProtocolError(KvferryError):
    """An input the protocol state machines do not accept in their current state."""


class ResourceError(KvferryError, ValueError):
    """Local misuse of an allocator: a non-positive size or capacity, an unknown or double free.

    A size that is merely too large for the pool comes from a peer and is answered with a typed
    refusal value instead, so one bad request cannot raise through the flow that carries it.
    """


class LocalMisuseError(KvferryError, ValueError):
    """The local caller used the API wrongly (a chunk past decode's allocation, a chunk after the
    last one, a call on a cleared handle). Raised to that caller; no room changes because of it.
    A peer's garbage is never this: it fails the room with a ``RoomError`` and is counted."""
