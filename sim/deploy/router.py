"""Which prefill and which decode instance serve a request: round-robin over the prefill
instances, the least-loaded decode instance. Pure (no SimPy): the world asks it at each arrival
and checks its answer."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Router"]


class Router:
    """``route(loads)`` -> (prefill instance, decode instance).

    Prefill: round-robin in arrival order (chunked prefill keeps every instance busy the same
    way). Decode: the fewest requests in flight there (``loads``: routed and not finished,
    whether waiting for memory, transferring or in the batch). Ties go to the first instance at
    or after a cursor that moves past each pick, so an idle deployment spreads its requests
    instead of stacking them on instance 0; the same arrivals always give the same routes.
    """

    def __init__(self, prefill: int, decode: int) -> None:
        if prefill < 1 or decode < 1:
            raise ValueError(f"a router needs instances on both sides, got {prefill}P{decode}D")
        self.prefill = prefill
        self.decode = decode
        self._next_prefill = 0
        self._cursor = 0

    def route(self, loads: Sequence[int]) -> tuple[int, int]:
        p = self._next_prefill
        self._next_prefill = (p + 1) % self.prefill
        least = min(loads)
        n = len(loads)
        d = next(j % n for j in range(self._cursor, self._cursor + n) if loads[j % n] == least)
        self._cursor = (d + 1) % n
        return p, d
