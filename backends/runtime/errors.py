"""Errors the threaded runtime hands to its caller (the serving engine's scheduler)."""

from __future__ import annotations

from kvferry.core.errors import KvferryError


class KVTransferError(KvferryError):
    """A room failed; ``reason`` says why (the core's words). When the failure came from an
    exception (a bad chunk, a NIXL error, a worker bug), ``failure_exception()`` raises that
    exception itself, with its original type, instead of this one."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason


class EndpointClosedError(KvferryError):
    """An API call on an endpoint that was closed (or never started)."""
