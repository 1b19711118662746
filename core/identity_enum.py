"""An Enum whose members hash by identity: the base of the state tables' states and inputs."""

from __future__ import annotations

from enum import Enum

__all__ = ["IdentityEnum"]


class IdentityEnum(Enum):
    """Members are singletons, so identity is their equality; Enum's own ``__hash__`` hashes the
    member's name in Python code, which every state-table lookup of the engines would pay."""

    __hash__ = object.__hash__
