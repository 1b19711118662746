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

``Loads`` keeps what the router weighs, as requests are routed, computed and finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvferry.sim.deploy.workload import DeployRequest
    from kvferry.sim.rooms import Request

__all__ = ["ROUTERS", "Loads", "Router"]

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


class Loads:
    """What each instance holds, as the router weighs it: requests in flight per decode instance
    (``load``); prompt tokens routed and not yet computed per prefill instance (``pre_tokens``);
    prompt plus output tokens routed and not finished per decode instance (``dec_tokens``); and
    how many requests each instance was sent (``routed``)."""

    def __init__(self, router: Router, n_pre: int, n_dec: int) -> None:
        self.router = router
        self.load = [0] * n_dec
        self.pre_tokens = [0] * n_pre
        self.dec_tokens = [0] * n_dec
        self._weighed: set[int] = set()  # keys counted in the token loads
        self.routed = {"prefill": [0] * n_pre, "decode": [0] * n_dec}
        router.watch(self.pre_tokens, self.dec_tokens)

    def route(self, req: Request, r: DeployRequest) -> tuple[int, int]:
        """Choose the request's instances (``req.pre_inst``, ``req.dec_inst``) and count it on
        them. Returns the router's pick; one out of range (``valid``) is counted nowhere."""
        if len(self.load) == 1 and len(self.pre_tokens) == 1:
            self.routed["prefill"][0] += 1
            self.routed["decode"][0] += 1
            self.load[0] += 1
            return 0, 0
        p, d = self.router.route(tuple(self.load))
        if not self.valid(p, d):
            return p, d
        req.pre_inst, req.dec_inst = p, d
        self.routed["prefill"][p] += 1
        self.routed["decode"][d] += 1
        self.load[d] += 1
        self.pre_tokens[p] += r.input_tokens - r.prefix_hit_tokens
        self.dec_tokens[d] += r.input_tokens + r.output_tokens
        self._weighed.add(req.key)
        return p, d

    def valid(self, p: int, d: int) -> bool:
        return 0 <= p < len(self.pre_tokens) and 0 <= d < len(self.load)

    def prefilled(self, req: Request, r: DeployRequest) -> None:
        """The request's last chunk is computed: its prompt leaves its prefill instance's load."""
        if req.key in self._weighed:
            self.pre_tokens[req.pre_inst] -= r.input_tokens - r.prefix_hit_tokens

    def finished(self, req: Request, r: DeployRequest, chunks_ready: int) -> None:
        """The request finished (or failed) with ``chunks_ready`` of its chunks computed: it
        leaves its instances' loads."""
        if req.opened:
            self.load[req.dec_inst] -= 1
        if req.key in self._weighed:
            self._weighed.discard(req.key)
            self.dec_tokens[req.dec_inst] -= r.input_tokens + r.output_tokens
            if chunks_ready < len(req.chunks):  # failed before its prompt was computed
                self.pre_tokens[req.pre_inst] -= r.input_tokens - r.prefix_hit_tokens


def _least(weights: Sequence[int], cursor: int) -> int:
    """The instance with the least weight, the first at or after ``cursor`` among equals."""
    least = min(weights)
    n = len(weights)
    return next(j % n for j in range(cursor, cursor + n) if weights[j % n] == least)
