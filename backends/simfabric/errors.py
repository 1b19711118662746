"""Typed errors of the simulated fabric."""

from __future__ import annotations

from kvferry.core.errors import KvferryError


class FabricError(KvferryError):
    """Something the simulated fabric refuses, as a real NIXL agent would."""


class RegionAccessError(FabricError, ValueError):
    """A descriptor that falls outside every registered region (NIXL refuses such a post)."""


class UnknownPeerError(FabricError, LookupError):
    """A post or message addressed to a node the fabric does not know or whose metadata is not loaded."""


class NodeDownError(FabricError):
    """An operation issued by a node that is crashed."""
