"""Typed errors of the NIXL data plane.

NIXL raises its own exception classes (nixlBackendError, nixlRemoteDisconnectError, ...) and
reports failed transfers as the state "ERR". Both are wrapped into NixlError so a worker can fail
the room through the core with a precise reason, and the original exception stays attached as
``__cause__`` for the poller.
"""

from __future__ import annotations

from kvferry.core.errors import KvferryError, PlanError


class NixlError(KvferryError):
    """A NIXL call raised, or a transfer ended in the ERR state."""


class NixlXferError(NixlError):
    """A posted transfer ended in ERR (remote gone, backend failure)."""


class NixlPeerError(NixlError):
    """An operation named a peer that is not (or no longer) registered."""


class DescriptorError(PlanError):
    """A descriptor that would read or write outside a registered region, or is misaligned."""
