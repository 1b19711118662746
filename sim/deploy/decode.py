"""Decode's batch loops in a deployment run, each instance its own: a request joins its instance's
batch once its room is Success on every decode rank (``deliver``); each step's time is the
roofline over the batch and its context; decode keeps the request's pages until its last token.
With SGLang's allocator a step first resumes retracted requests and takes a page for each token
that fills one, retracting requests when there is none (sim/deploy/decode_memory.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import simpy
from kvferry.sim.deploy.decode_memory import DecodeMemory
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.deploy.tracks import RequestLog, Track

if TYPE_CHECKING:
    from kvferry.sim.world import World

__all__ = ["DecodeSteps"]


class DecodeSteps:
    """Each decode instance's waiting requests and batch loop. ``busy_ns``: simulated ns each
    spent in steps; ``step_end``: when its running step ends (idle: a time already past);
    ``step_log``: set to a list to log every step as (instance, start ns, end ns); ``decoded``:
    keys past their last token (decode may free their pages). ``finish(key, failed)`` is called
    as each request's last token is out."""

    def __init__(
        self,
        world: World,
        spec: DeploySpec,
        log: RequestLog,
        memory: DecodeMemory,
        finish: Callable[[int, bool], None],
    ) -> None:
        n = len(memory.running)
        self.world, self.log, self.memory, self.finish = world, log, memory, finish
        self.roof = spec.roofline("decode")
        self.max_batch = spec.max_batch
        # Per instance: keys whose KV is in, not yet in the batch, and the loop's wake-up.
        self.waiting: list[deque[int]] = [deque() for _ in range(n)]
        self.wake = [world.env.event() for _ in range(n)]
        self.busy_ns = [0] * n
        self.step_end = [0] * n
        self.step_log: list[tuple[int, int, int]] | None = None
        self.decoded: set[int] = set()

    def deliver(self, j: int, key: int) -> None:
        """The request's KV is in at instance ``j``: it waits for the batch."""
        self.waiting[j].append(key)
        self.wake_up(j)

    def wake_up(self, j: int) -> None:
        if not self.wake[j].triggered:
            self.wake[j].succeed()

    def take(self, j: int) -> int | None:
        """The next request whose KV is in at instance ``j`` (None: none waiting)."""
        waiting = self.waiting[j]
        return waiting.popleft() if waiting else None

    def loop(self, j: int) -> Generator[simpy.Event, Any, None]:
        """Instance ``j``'s batch loop: only requests routed to ``j`` may join its batch
        (another instance's would be decoded where its KV is not: a violation)."""
        env, memory = self.world.env, self.memory
        batch: list[Track] = memory.running[j]  # changed in place: admission reads it
        keys: list[int] = []
        ctx = 0  # tokens the batch attends to: kept as a running sum (a step is the hot loop)
        waiting, retracted = self.waiting[j], memory.retracted[j]
        while True:
            if retracted or waiting:
                swap, added = self._fill(j, batch, keys)  # the step first waits for its swaps
                ctx += added
            else:
                swap = 0  # nothing to resume or take: ``_fill`` would add nothing
            if not batch:
                self.wake[j] = env.event()
                yield self.wake[j]
                continue
            if memory.grows:
                ns, removed = memory.grow(j, batch, keys)
                swap += ns
                ctx -= removed
            memory.swap_ns += swap
            step = self.roof.decode_ns(len(batch), ctx) + swap
            self.busy_ns[j] += step
            self.step_end[j] = int(env._now) + step
            if self.step_log is not None:
                self.step_log.append((j, int(env._now), self.step_end[j]))
            yield env.timeout(step)
            ctx += len(batch)  # every sequence gained a token
            if self._token(batch, int(env._now)):
                ctx -= self._retire(batch, keys)

    def _fill(self, j: int, batch: list[Track], keys: list[int]) -> tuple[int, int]:
        """Retracted requests back first, then waiting ones, up to the largest batch. Returns the
        swaps' ns and the tokens the batch's context gained."""
        swap = added = 0
        if self.memory.retracted[j]:
            swap, added = self.memory.resume(j, batch, keys)
        requests, tracks = self.world.requests, self.log.tracks
        while len(batch) < self.max_batch:
            k = self.take(j)
            if k is None:
                break
            if requests[k].dec_inst != j:
                self.world.violate(
                    "routing",
                    f"decode instance {j} batched request {k}, routed to decode instance "
                    f"{requests[k].dec_inst}",
                    requests[k],
                )
            t = tracks[k]
            batch.append(t)
            keys.append(k)
            added += t.req.input_tokens + t.tokens
        if added:
            self.memory.joined(j)
        return swap, added

    def _token(self, batch: list[Track], now: int) -> bool:
        """Every sequence of the step gained a token; whether one of them is done."""
        done = False
        for t in batch:
            t.tokens += 1
            if t.first_token_ns < 0:
                t.first_token_ns = now
                self.log.first_n += 1
            done = done or t.tokens >= t.req.output_tokens
        return done

    def _retire(self, batch: list[Track], keys: list[int]) -> int:
        """Take the requests past their last token out of the batch and finish them; returns the
        tokens they take out of the batch's context."""
        still, still_keys = [], []
        removed = 0
        for t, k in zip(batch, keys, strict=True):
            if t.tokens < t.req.output_tokens:
                still.append(t)
                still_keys.append(k)
                continue
            removed += t.req.input_tokens + t.tokens
            self.decoded.add(k)
            req = self.world.requests[k]
            self.memory.free_grown(req)
            if req.dec_released:
                self.world.check_side(req, "decode")  # frees the pages now
            self.finish(k, False)
        batch[:], keys[:] = still, still_keys
        return removed
