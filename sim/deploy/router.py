"""Which prefill and which decode instance serve a request. Pure (no SimPy): the world asks it at
each arrival, with what each instance holds then, and checks its answer.

Policies (``ROUTERS``):

- ``least-requests`` (the default): prefill round-robin in arrival order, decode the instance with
  the fewest requests in flight (routed and not finished: waiting for memory, transferring or in
  the batch).
- ``round-robin``: both sides in turn.
- ``least-tokens``: prefill the instance with the fewest prompt tokens routed and not yet computed,
  decode the one with the fewest tokens outstanding (prompt plus output of its requests in flight):
  what a router that knows request sizes balances (Dynamo's KV-aware routing weighs the same).

Ties go to the first instance at or after a cursor that moves past each pick, so an idle
deployment spreads its requests instead of stacking them on instance 0; the same arrivals always
give the same routes.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ROUTERS", "Router"]

ROUTERS = ("least-requests", "round-robin", "least-tokens")


class Router:
    """``route(loads)`` -> (prefill instance, decode instance). The least-tokens policy reads the
    token loads the world hands it once (``watch``: its live lists)."""

    def __init__(self, prefill: int, decode: int, policy: str = "least-requests") -> None:
        if prefill < 1 or decode < 1:
            raise ValueError(f"a router needs instances on both sides, got {prefill}P{decode}D")
        if policy not in ROUTERS:
            raise ValueError(f"router: expected one of {', '.join(ROUTERS)}, got {policy!r}")
        self.prefill = prefill
        self.decode = decode
        self.policy = policy
        self._next_prefill = 0
        self._next_decode = 0
        self._cursor = 0
        self._pcursor = 0
        self._tokens: tuple[Sequence[int], Sequence[int]] = ((), ())

    def watch(self, prefill_tokens: Sequence[int], decode_tokens: Sequence[int]) -> None:
        """The token loads (prompt tokens not computed per prefill instance, tokens outstanding per
        decode instance) as the world keeps them, read at each route."""
        self._tokens = (prefill_tokens, decode_tokens)

    def route(self, loads: Sequence[int]) -> tuple[int, int]:
        """``loads``: requests in flight per decode instance."""
        prefill_tokens, decode_tokens = self._tokens
        if self.policy == "least-tokens" and prefill_tokens:
            p = self._pcursor = _least(prefill_tokens, self._pcursor)
            self._pcursor = (p + 1) % len(prefill_tokens)
        else:
            p = self._next_prefill
            self._next_prefill = (p + 1) % self.prefill
        if self.policy == "round-robin":
            d = self._next_decode
            self._next_decode = (d + 1) % self.decode
            return p, d
        weights = decode_tokens if self.policy == "least-tokens" and decode_tokens else loads
        d = _least(weights, self._cursor)
        self._cursor = (d + 1) % len(weights)
        return p, d


def _least(weights: Sequence[int], cursor: int) -> int:
    """The instance with the least weight, the first at or after ``cursor`` among equals."""
    least = min(weights)
    n = len(weights)
    return next(j % n for j in range(cursor, cursor + n) if weights[j % n] == least)
