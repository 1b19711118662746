"""Prefill's forward steps in a deployment run: chunked prefill, each instance on its own.

Chunks wait first come first served (a request's next chunk queues behind chunks that arrived
meanwhile); each forward step takes queued chunks, of any requests, up to the chunk size in
tokens (SGLang's chunked_prefill_size is both), and costs the roofline of the batch (weights
read once)."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from typing import Any

import simpy
from kvferry.sim.deploy.spec import DeploySpec

__all__ = ["PrefillSteps"]


class PrefillSteps:
    """Each prefill instance's chunk queue and step loop; ``busy_ns``: simulated ns each spent in
    forward steps (its utilisation over the run)."""

    def __init__(self, env: simpy.Environment, spec: DeploySpec, n: int) -> None:
        self.env = env
        self.roof = spec.roofline("prefill")
        self.budget = spec.chunk_tokens
        # Per instance: queued chunks (tokens, context start, done, layer-wise; a layer-wise
        # job's done fires as its step starts, with the step's length) and the loop's wake-up.
        self.jobs: list[deque[tuple[int, int, simpy.Event, bool]]] = [deque() for _ in range(n)]
        self.wake = [env.event() for _ in range(n)]
        self.busy_ns = [0] * n

    def queue(self, i: int, tokens: int, start: int, layered: bool) -> simpy.Event:
        """Queue ``tokens`` new tokens from context position ``start`` on instance ``i``; the
        event fires when their step ends (a layer-wise chunk's: as it starts)."""
        done = self.env.event()
        self.jobs[i].append((tokens, start, done, layered))
        if not self.wake[i].triggered:
            self.wake[i].succeed()
        return done

    def loop(self, i: int) -> Generator[simpy.Event, Any, None]:
        """Instance ``i``'s forward steps over its own queued chunks."""
        budget = self.budget
        jobs, busy = self.jobs[i], self.busy_ns
        while True:
            if not jobs:
                self.wake[i] = self.env.event()
                yield self.wake[i]
                continue
            batch = [jobs.popleft()]
            used = batch[0][0]
            while jobs and used + jobs[0][0] <= budget:
                used += jobs[0][0]
                batch.append(jobs.popleft())
            step = self.roof.prefill_batch_ns([(t, ctx) for t, ctx, _, _ in batch])
            busy[i] += step
            for _, _, done, layered in batch:
                if layered:
                    done.succeed(step)  # its room reports the step's layers as they finish
            yield self.env.timeout(step)
            for _, _, done, layered in batch:
                if not layered:
                    done.succeed()
