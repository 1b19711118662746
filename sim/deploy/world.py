"""A deployment run: the simulator's World (real core engines, real flows, the simulated fabric,
the invariant checker) with P prefill and D decode instances, each its own ranks and NICs on the
one fabric, and requests that arrive over time.

- Routing: at arrival a router (sim/deploy/router.py) picks the request's prefill and decode
  instance; the room then runs between those two servers only (its pages, its transfers).
- Prefill (each instance on its own): chunked prefill. Chunks wait first come first served (a
  request's next chunk queues behind chunks that arrived meanwhile); each forward step takes
  queued chunks, of any requests, up to the chunk size in tokens (SGLang's chunked_prefill_size
  is both), and costs the roofline of the batch (weights read once). Prefix hits are not
  computed, still transferred. A chunk's KV goes to decode as soon as its step ends.
- Decode (each instance its own batch loop): a request joins its instance's batch once its room
  is Success on every decode rank; each step's time is the roofline over the batch and its
  context; decode keeps the request's pages until its last token.
- KV pages (``DeploySpec.page_allocator``, sim/pages.py): "sglang" (the default) allocates as
  SGLang's disaggregated servers do: grants from the front of a lazily merged, sorted free list,
  and decode takes a page from it each time a request's generated tokens fill one (those pages
  count against decode's memory and are freed with the request's). "lowest-first": the original
  model, the lowest free ids and no pages for generated tokens.
- Serial pull (``DeploySpec.pull_orchestration = "serial"``, flow "pull"): vLLM's order of a
  pull behind its proxy. Prefill opens the room and computes every chunk with no decode side;
  once the last chunk is computed, its response travels back to the proxy and the proxy sends
  the request to decode (``proxy_hop_ms``), and decode's scheduler takes it at the end of the
  step it is running (at once when idle). Only then does decode open the room and the pull flow
  READ, through the same core and flow as an overlapped pull.
- TTFT: arrival to the end of the request's first decode step (the first token the client gets
  from decode); TPOT: the mean gap between its later tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import simpy
from kvferry.sim import scenario as sc
from kvferry.sim.deploy.router import Router
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.deploy.timing import TimingFabric
from kvferry.sim.deploy.workload import Arrivals, DeployRequest
from kvferry.sim.pages import PageAllocator, make_allocator
from kvferry.sim.scenario import US, RoomSpec
from kvferry.sim.world import Request, World, _split

__all__ = ["DeployWorld", "Track"]


def _no_record(kind: str, node: str, **attrs: Any) -> None:
    return None


@dataclass(slots=True)
class Track:
    """One request's timeline (ns; -1 until it happens)."""

    req: DeployRequest
    arrival_ns: int
    chunk_ready_ns: list[int] = field(default_factory=list)
    kv_done_ns: int = -1  # Success on every decode rank
    first_token_ns: int = -1
    done_ns: int = -1
    tokens: int = 0
    failed: bool = False


class DeployWorld(World):
    def __init__(
        self,
        spec: DeploySpec,
        scenario: sc.Scenario,
        arrivals: Arrivals,
        lengths: tuple[DeployRequest, ...],
        router: Router | None = None,
    ) -> None:
        n_pre, n_dec = spec.prefill_instances, spec.decode_instances
        self.spec = spec  # before the World builds its allocators (_page_allocator reads it)
        super().__init__(
            replace(scenario, workload=replace(scenario.workload, rooms=0)),
            seed=spec.seed,
            instances=(n_pre, n_dec),
        )
        assert isinstance(self.fabric, TimingFabric)
        self.fabric.xfer_log = []
        self.built = scenario  # as built from the spec (staging sized for its largest room)
        self.roof_p = spec.roofline("prefill")
        self.roof_d = spec.roofline("decode")
        self.router = router or Router(n_pre, n_dec)
        # Per prefill instance: queued chunks (new tokens, cached, done) and the loop's wake-up.
        self._pjobs: list[deque[tuple[int, int, simpy.Event]]] = [deque() for _ in range(n_pre)]
        self._pwake = [self.env.event() for _ in range(n_pre)]
        self.tracks: dict[int, Track] = {}  # by request key
        self.finished = 0
        self.total = arrivals.count
        self.all_done = self.env.event()
        self._lengths = list(lengths)
        self._next = 0
        # Per decode instance: keys whose KV is in, not yet in the batch, and the loop's wake-up.
        self._waiting: list[deque[int]] = [deque() for _ in range(n_dec)]
        self._wake = [self.env.event() for _ in range(n_dec)]
        self.load = [0] * n_dec  # requests routed to each decode instance and not finished
        self.routed = {"prefill": [0] * n_pre, "decode": [0] * n_dec}
        # Simulated ns each instance spent in forward steps (its utilisation over the run).
        self.busy_ns = {"prefill": [0] * n_pre, "decode": [0] * n_dec}
        self._decoded: set[int] = set()  # keys past their last token: decode may free their pages
        # Pages decode took for generated tokens (sglang allocator), by key; and the steps that
        # found no free page for one (decode would retract a request: not modelled, counted).
        self._grown: dict[int, list[np.ndarray]] = {}
        self.growth_short = 0
        # Serial pull: when each decode instance's running step ends (idle: a time already past),
        # each request's prefill-finished event, and when its decode side opened (key -> ns).
        self._step_end = [0] * n_dec
        self._prefilled: dict[int, simpy.Event] = {}
        self.decode_open_ns: dict[int, int] = {}
        # Set to a list to log every decode step as (instance, start ns, end ns).
        self.step_log: list[tuple[int, int, int]] | None = None
        self._closed = arrivals.concurrency > 0
        if self._closed:
            for _ in range(min(arrivals.concurrency, self.total)):
                self._submit(0)
        else:
            for r in arrivals.requests:
                self._submit(r.arrival_ns, r)
        for j in range(n_dec):
            self.env.process(self._decode_loop(j))
        for i in range(n_pre):
            self.env.process(self._prefill_loop(i))
        # A deployment run is judged on its metrics, not on its trace hash: the ~50 trace records
        # of each request are not hashed (reproducibility is checked on the metrics instead).
        self.trace.record = _no_record  # type: ignore[method-assign]
        self.fabric.record = _no_record
        # When a prefill rank's transfer worker first takes up each chunk: (room, chunk) -> latest
        # over the ranks (the transfer split's queueing ends there).
        self.picked_ns: dict[tuple[int, int], int] = {}
        for name, rank in self.ranks.items():
            rank.record = self._tap(_no_record) if name.startswith("prefill") else _no_record

    def _tap(self, record: Any) -> Any:
        first: set[tuple[int, int]] = set()

        def tapped(kind: str, where: str, **attrs: Any) -> None:
            if kind == "chunk_begin":
                key = (attrs["room"], attrs["chunk"])
                if key not in first:  # a chunk put back (no staging space yet) is taken up again
                    first.add(key)
                    now = int(self.env.now)
                    self.picked_ns[key] = max(self.picked_ns.get(key, now), now)
            record(kind, where, **attrs)

        return tapped

    def _page_allocator(self, side: str, n: int) -> PageAllocator:
        return make_allocator(self.spec.page_allocator, n)

    # ------------------------------------------------------------------ arrivals
    def _submit(self, at_ns: int, r: DeployRequest | None = None) -> None:
        if r is None:
            r = self._lengths[self._next % len(self._lengths)]
        self._next += 1
        key = len(self.requests)
        rooms_rng = self.streams["rooms"]
        room = rooms_rng.getrandbits(63)
        while room in self.by_room:
            room = rooms_rng.getrandbits(63)
        spec = RoomSpec(tokens=r.input_tokens, arrival_us=at_ns // US)
        req = Request(
            key=key,
            room=room,
            tid=f"t{self.seed}-{key}",
            spec=spec,
            chunks=_split(r.input_tokens, self.spec.chunk_tokens),
            arrival_ns=at_ns,
        )
        self.requests.append(req)
        self.by_room[room] = req
        self.tracks[key] = Track(r, at_ns)
        self.env.process(self._request(req))

    def _arrived(self, req: Request) -> bool:
        """Route the request (at its arrival: the decode loads are those of now). A route to an
        instance that does not exist is the router's bug: a violation, and the request fails."""
        if len(self.load) == 1 and len(self._pjobs) == 1:
            self.routed["prefill"][0] += 1
            self.routed["decode"][0] += 1
            self.load[0] += 1
            return True
        p, d = self.router.route(tuple(self.load))
        if not (0 <= p < len(self._pjobs) and 0 <= d < len(self.load)):
            self.violate(
                "routing",
                f"request {req.key} routed to prefill instance {p}, decode instance {d} of "
                f"{len(self._pjobs)}P{len(self.load)}D",
                req,
            )
            self._finish(req.key, failed=True)
            return False
        req.pre_inst, req.dec_inst = p, d
        self.routed["prefill"][p] += 1
        self.routed["decode"][d] += 1
        self.load[d] += 1
        return True

    def _finish(self, key: int, failed: bool) -> None:
        t = self.tracks[key]
        t.failed = failed
        t.done_ns = int(self.env.now)
        self.finished += 1
        req = self.requests[key]
        if req.opened:
            self.load[req.dec_inst] -= 1
        if self._closed and self._next < self.total:
            self._submit(int(self.env.now))
        if self.finished >= self.total and not self.all_done.triggered:
            self.all_done.succeed()

    # ------------------------------------------------------------------ prefill
    def _compute_chunk(self, req: Request, start: int, tokens: int):  # type: ignore[no-untyped-def]
        hit = self.tracks[req.key].req.prefix_hit_tokens
        new_start = max(start, hit)
        new = max(0, start + tokens - new_start)
        if new:
            done = self.env.event()
            i = req.pre_inst
            self._pjobs[i].append((new, new_start, done))
            if not self._pwake[i].triggered:
                self._pwake[i].succeed()
            yield done
        else:
            yield self.env.timeout(1)  # a cached chunk: nothing to compute
        ready = self.tracks[req.key].chunk_ready_ns
        ready.append(int(self.env.now))
        if len(ready) == len(req.chunks) and req.key in self._prefilled:
            self._prefilled.pop(req.key).succeed()

    def _prefill_loop(self, i: int):  # type: ignore[no-untyped-def]
        """Prefill instance ``i``'s forward steps over its own queued chunks."""
        budget = self.spec.chunk_tokens
        jobs, busy = self._pjobs[i], self.busy_ns["prefill"]
        while True:
            if not jobs:
                self._pwake[i] = self.env.event()
                yield self._pwake[i]
                continue
            batch = [jobs.popleft()]
            used = batch[0][0]
            while jobs and used + jobs[0][0] <= budget:
                used += jobs[0][0]
                batch.append(jobs.popleft())
            step = self.roof_p.prefill_batch_ns([(t, ctx) for t, ctx, _ in batch])
            busy[i] += step
            yield self.env.timeout(step)
            for _, _, done in batch:
                done.succeed()

    # ------------------------------------------------------------------ serial pull
    def _decode_opens_late(self, req: Request) -> bool:
        if self.spec.serial_pull:
            self._prefilled[req.key] = self.env.event()
            return True
        return super()._decode_opens_late(req)

    def _open_decode_later(self, req: Request, lag_ns: int):  # type: ignore[no-untyped-def]
        if not self.spec.serial_pull:
            yield from super()._open_decode_later(req, lag_ns)
            return
        yield self._prefilled[req.key]
        yield self.env.timeout(round(self.spec.proxy_hop_ms * 1_000_000))
        # The request reached decode's engine; its scheduler admits it between two steps.
        wait = self._step_end[req.dec_inst] - int(self.env.now)
        if wait > 0:
            yield self.env.timeout(wait)
        self.decode_open_ns[req.key] = int(self.env.now)
        self._open_decode(req)
        self._check_side(req, "decode")

    # ------------------------------------------------------------------ decode
    def _check_side(self, req: Request, side: str) -> None:
        had = req.outcome
        super()._check_side(req, side)
        if side != "decode" or had or not req.outcome:
            return
        t = self.tracks[req.key]
        if req.outcome == "success":
            t.kv_done_ns = int(self.env.now)
            j = req.dec_inst
            self._waiting[j].append(req.key)
            if not self._wake[j].triggered:
                self._wake[j].succeed()
        else:
            self._finish(req.key, failed=True)

    def _free_dec_pages(self, req: Request) -> None:
        # Decode still needs a delivered request's pages: freed after its last token. (Keyed on
        # the outcome, set before the World frees, not on a set filled after: the engines may have
        # dropped the room already, and the pages then went back at KV arrival.)
        if req.outcome == "success" and req.key not in self._decoded:
            return
        super()._free_dec_pages(req)

    @property
    def _grows(self) -> bool:
        return self.spec.page_allocator == "sglang"

    def _grow(self, j: int, batch: list[Track], keys: list[int]) -> None:
        """Give every sequence of the step a page for the token it writes when its pages are
        full, in batch order from one free list (SGLang's alloc_decode: the new pages of a step
        are consecutive free-list entries, interleaving the requests)."""
        ps = self.spec.decode_page_size
        pages = self.allocs[self.instance_nodes["decode"][j][0]][0]
        for t, k in zip(batch, keys, strict=True):
            pos = t.req.input_tokens + t.tokens  # the token this step writes
            if pos % ps:
                continue  # room left in its last page
            got = pages.alloc(1, k)
            if got is None:
                self.growth_short += 1
                continue
            self._grown.setdefault(k, []).append(got)

    def _free_grown(self, req: Request) -> None:
        grown = self._grown.pop(req.key, None)
        if grown:
            pages = self.allocs[self.room_nodes(req, "decode")[0]][0]
            pages.free(np.concatenate(grown), req.key)
            self._memory_event()

    def _take(self, j: int) -> int | None:
        """The next request whose KV is in at decode instance ``j`` (None: none waiting)."""
        waiting = self._waiting[j]
        return waiting.popleft() if waiting else None

    def _decode_loop(self, j: int):  # type: ignore[no-untyped-def]
        """Decode instance ``j``'s batch loop: only requests routed to ``j`` may join its batch
        (another instance's would be decoded where its KV is not: a violation)."""
        env, tracks, requests = self.env, self.tracks, self.requests
        busy = self.busy_ns["decode"]
        batch: list[Track] = []
        keys: list[int] = []
        ctx = 0  # tokens the batch attends to: kept as a running sum (a step is the hot loop)
        while True:
            while len(batch) < self.spec.max_batch:
                k = self._take(j)
                if k is None:
                    break
                if requests[k].dec_inst != j:
                    self.violate(
                        "routing",
                        f"decode instance {j} batched request {k}, routed to decode instance "
                        f"{requests[k].dec_inst}",
                        requests[k],
                    )
                t = tracks[k]
                batch.append(t)
                keys.append(k)
                ctx += t.req.input_tokens + t.tokens
            if not batch:
                self._wake[j] = env.event()
                yield self._wake[j]
                continue
            if self._grows:
                self._grow(j, batch, keys)
            step = self.roof_d.decode_ns(len(batch), ctx)
            busy[j] += step
            self._step_end[j] = int(env.now) + step
            if self.step_log is not None:
                self.step_log.append((j, int(env.now), self._step_end[j]))
            yield env.timeout(step)
            now = int(env.now)
            ctx += len(batch)  # every sequence gained a token
            done = False
            for t in batch:
                t.tokens += 1
                if t.first_token_ns < 0:
                    t.first_token_ns = now
                done = done or t.tokens >= t.req.output_tokens
            if not done:
                continue
            still, still_keys = [], []
            for t, k in zip(batch, keys, strict=True):
                if t.tokens < t.req.output_tokens:
                    still.append(t)
                    still_keys.append(k)
                    continue
                ctx -= t.req.input_tokens + t.tokens
                self._decoded.add(k)
                req = self.requests[k]
                self._free_grown(req)
                if req.dec_released:
                    self._check_side(req, "decode")  # frees the pages now
                self._finish(k, failed=False)
            batch, keys = still, still_keys

    # ------------------------------------------------------------------ running
    def run_deploy(self, limit_ns: int) -> float:
        """Run until every request finished (or ``limit_ns`` of simulated time), then check the
        invariants as a scenario run does. Returns the wall time."""
        t0 = time.perf_counter()
        stop = self.env.any_of([self.all_done, self.env.timeout(limit_ns)])
        self.env.run(until=stop)
        self.deadline_ns = int(self.env.now) + 1
        super().run()
        return time.perf_counter() - t0
