"""Argument checks and rounding shared by the allocators (kept here so both reject misuse alike)."""

from __future__ import annotations

from kvferry.core.errors import ResourceError


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int > 0, else raise ResourceError (bools are not sizes)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ResourceError(f"{name} must be a positive int, got {value!r}")
    return value


def round_up(n: int, align: int) -> int:
    """Smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align
