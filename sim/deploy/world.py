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
- Decode memory (the "sglang" allocator, sim/deploy/decode_memory.py): decode admits a request
  only with ``decode_reserved_tokens`` to spare for it and for every request it holds; a step
  that finds no page for a generated token retracts requests (KV, and a hybrid model's recurrent
  state, swapped out to host memory at the GPU's pinned copy rate, the step waiting for it),
  which come back, swapped in, when there is room again, before any new admission.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import simpy
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.runtime import SimRank
from kvferry.core.flows import Flow
from kvferry.core.geometry import ModelGeometry
from kvferry.sim import scenario as sc
from kvferry.sim.deploy import hardware
from kvferry.sim.deploy.decode_memory import Running, admits, allocatable_tokens, never_fits, retraction_order
from kvferry.sim.deploy.router import Router
from kvferry.sim.deploy.spec import DeployError, DeploySpec
from kvferry.sim.deploy.timing import LayerPlanner, TimingFabric
from kvferry.sim.deploy.workload import Arrivals, DeployRequest
from kvferry.sim.pages import PageAllocator, make_allocator
from kvferry.sim.rng import Streams
from kvferry.sim.rooms import Request, Violation, split_chunks
from kvferry.sim.scenario import US, RoomSpec
from kvferry.sim.serving import Serving
from kvferry.sim.trace import Trace
from kvferry.sim.world import World

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
    retractions: int = 0  # times decode swapped it out to make room


class DeployWorld(Serving):
    """A deployment's servers around a ``World`` it composes (``self.world``) and serves."""

    world: World

    def __init__(
        self,
        spec: DeploySpec,
        scenario: sc.Scenario,
        arrivals: Arrivals,
        lengths: tuple[DeployRequest, ...],
        router: Router | None = None,
        queue_limit: int = 0,
        miss_limit: int = -1,
        warmup_ns: int = 0,
    ) -> None:
        """``queue_limit``: stop the run as overloaded once more requests than this wait for their
        first token (0: run every request to its end). ``miss_limit``: stop it once more requests
        arriving from ``warmup_ns`` on than this have missed an SLO (-1: never): the share asked
        for can no longer be met, so the rest of the run would change no verdict."""
        n_pre, n_dec = spec.prefill_instances, spec.decode_instances
        self.spec = spec  # before the World builds its allocators (page_allocator reads it)
        # The World attaches itself as self.world first thing: it asks page_allocator and
        # rank_planner while it builds.
        self.world = World(
            msgspec.structs.replace(scenario, workload=msgspec.structs.replace(scenario.workload, rooms=0)),
            seed=spec.seed,
            instances=(n_pre, n_dec),
            serving=self,
        )
        if isinstance(self.fabric, TimingFabric):
            self.fabric.xfer_log = []
            model = spec.geometry()
            if not self._full_plans():  # a full plan is charged as it is
                self.fabric.layers, self.fabric.kinds = model.num_layers, len(model.kinds)
        self.built = scenario  # as built from the spec (staging sized for its largest room)
        self.roof_p = spec.roofline("prefill")
        self.roof_d = spec.roofline("decode")
        self.router = router or Router(n_pre, n_dec, spec.router)
        # Per prefill instance: queued chunks (new tokens, cached, done) and the loop's wake-up.
        # (tokens, context start, done, layer-wise): a layer-wise job's done fires as it starts.
        self._pjobs: list[deque[tuple[int, int, simpy.Event, bool]]] = [deque() for _ in range(n_pre)]
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
        # Tokens routed and outstanding (the least-tokens router reads them): prompt tokens not yet
        # computed per prefill instance; prompt plus output per decode instance, until finished.
        self.pre_tokens = [0] * n_pre
        self.dec_tokens = [0] * n_dec
        self._weighed: set[int] = set()  # keys counted in those token loads
        self.router.watch(self.pre_tokens, self.dec_tokens)
        self.routed = {"prefill": [0] * n_pre, "decode": [0] * n_dec}
        # Simulated ns each instance spent in forward steps (its utilisation over the run).
        self.busy_ns = {"prefill": [0] * n_pre, "decode": [0] * n_dec}
        self._decoded: set[int] = set()  # keys past their last token: decode may free their pages
        # Pages decode took for generated tokens (sglang allocator), by key; and the pages a
        # step found no free page for even after retracting every request but one.
        self._grown: dict[int, list[np.ndarray]] = {}
        self.growth_short = 0
        # Decode's memory budget (sglang allocator), per instance: requests holding decode pages
        # (receiving, waiting or running; not retracted), the running batch (admission reads
        # it), and the retracted requests' keys, first in first out.
        self._holders = [0] * n_dec
        self._running: list[list[Track]] = [[] for _ in range(n_dec)]
        self._retracted: list[deque[int]] = [deque() for _ in range(n_dec)]
        self.retractions = 0
        self.swap_ns = 0  # simulated time decode steps waited for swaps out and in
        # A swap's ns: one decode page's bytes on one rank, and a hybrid model's recurrent state
        # of one request on one rank (SGLang's offload_kv_cache copies both), over the GPU's
        # pinned copy rate (each rank swaps its own slice at once).
        gbps = hardware.gpu(spec.gpu).copy_pinned_gbps
        self._swap_ns_per_page = spec.page_bytes("decode") / gbps
        self._swap_ns_state = spec.geometry().state_bytes // spec.decode_tp / gbps
        if self._grows:
            self._refuse_what_never_fits(lengths)
        # Serial pull: when each decode instance's running step ends (idle: a time already past),
        # each request's prefill-finished event, and when its decode side opened (key -> ns).
        self._step_end = [0] * n_dec
        self._prefilled: dict[int, simpy.Event] = {}
        self.decode_open_ns: dict[int, int] = {}
        # Set to a list to log every decode step as (instance, start ns, end ns).
        self.step_log: list[tuple[int, int, int]] | None = None
        # Requests arrived, given a first token, failed before one: the queue the monitor watches
        # (sampled once a simulated second as (ns, waiting)), and why the run stopped early.
        self.arrived_n = self.first_n = self.failed_early_n = 0
        self.waiting_log: list[tuple[int, int]] = []
        self.queue_limit = queue_limit
        self.miss_limit = miss_limit
        self.warmup_ns = warmup_ns
        self.stopped = ""
        self.overloaded = False  # stopped because the queue outgrew the limit (not by misses)
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
        self.env.process(self._monitor())
        # A deployment run is judged on its metrics, not on its trace hash: the ~50 trace records
        # of each request are not hashed (reproducibility is checked on the metrics instead).
        self.trace.record = _no_record  # type: ignore[method-assign]
        self.fabric.record = _no_record
        # When a prefill rank's transfer worker first takes up each chunk: (room, chunk) -> latest
        # over the ranks (the transfer split's queueing ends there).
        self.picked_ns: dict[tuple[int, int], int] = {}
        for name, rank in self.ranks.items():
            rank.record = self._tap(_no_record) if name.startswith("prefill") else _no_record

    # What the deployment reads of its world (and what its callers read: sim/deploy/run.py).
    @property
    def env(self) -> simpy.Environment:
        return self.world.env

    @property
    def fabric(self) -> Fabric:
        return self.world.fabric

    @property
    def trace(self) -> Trace:
        return self.world.trace

    @property
    def streams(self) -> Streams:
        return self.world.streams

    @property
    def ranks(self) -> dict[str, SimRank]:
        return self.world.ranks

    @property
    def scenario(self) -> sc.Scenario:
        return self.world.scenario

    @property
    def requests(self) -> list[Request]:
        return self.world.requests

    @property
    def by_room(self) -> dict[int, Request]:
        return self.world.by_room

    @property
    def violations(self) -> list[Violation]:
        return self.world.violations

    @property
    def seed(self) -> int:
        return self.world.seed

    @property
    def model(self) -> ModelGeometry:
        return self.world.model

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

    def rank_planner(self) -> Any:
        # Timing only: one layer's descriptors, charged for every layer (sim/deploy/timing.py).
        # A byte-moving run (the equivalence test's) plans and moves every layer.
        return None if self._full_plans() else LayerPlanner()

    def _full_plans(self) -> bool:
        """Plan every layer: a byte-moving run, or the layer-wise flow (it posts each layer's
        slice of the plan, so one layer cannot stand for the others)."""
        return self.scenario.move_bytes or self.scenario.flows.flow == Flow.LAYERWISE.value

    def page_allocator(self, side: str, n: int) -> PageAllocator:
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
            chunks=split_chunks(r.input_tokens, self.spec.chunk_tokens),
            arrival_ns=at_ns,
        )
        self.requests.append(req)
        self.by_room[room] = req
        self.tracks[key] = Track(r, at_ns)
        self.env.process(self.world.request_process(req))

    @property
    def waiting(self) -> int:
        """Requests arrived and neither given a first token nor failed."""
        return self.arrived_n - self.first_n - self.failed_early_n

    def _monitor(self):  # type: ignore[no-untyped-def]
        """Once a simulated second: log the queue; past ``queue_limit``, stop the run."""
        while not self.all_done.triggered:
            yield self.env.timeout(1_000_000_000)
            now, waiting = int(self.env.now), self.waiting
            self.waiting_log.append((now, waiting))
            if self.queue_limit and waiting > self.queue_limit and not self.all_done.triggered:
                self.stopped = (
                    f"stopped at {now / 1e9:.0f} s simulated: {waiting} requests waiting for a first "
                    f"token, more than the {self.queue_limit} a deployment meeting the TTFT SLO would "
                    "hold at this rate"
                )
                self.overloaded = True
                self.all_done.succeed()
            elif self.miss_limit >= 0 and not self.all_done.triggered:
                missed = self._missed(now)
                if missed > self.miss_limit:
                    self.stopped = (
                        f"stopped at {now / 1e9:.0f} s simulated: {missed} measured requests already "
                        f"missed an SLO, more than the {self.miss_limit} the attainment asked for allows"
                    )
                    self.all_done.succeed()

    def _missed(self, now: int) -> int:
        """Requests arriving from the warm-up on that can no longer meet both SLOs by ``now``:
        failed, a first token later than the TTFT SLO (or none yet, past it), or more time per
        token so far than the TPOT SLO allows for the tokens still to come."""
        ttft = self.spec.ttft_slo_ms * 1e6
        tpot = self.spec.tpot_slo_ms * 1e6
        n = 0
        for t in self.tracks.values():
            if t.arrival_ns < self.warmup_ns or t.arrival_ns > now:
                continue
            if t.failed:
                n += 1
            elif t.first_token_ns < 0:
                n += now - t.arrival_ns > ttft
            elif t.first_token_ns - t.arrival_ns > ttft:
                n += 1
            elif t.tokens > 1:
                # TPOT is the mean gap after the first token: already over the SLO for the gaps so
                # far, and the rest cannot be shorter than nothing.
                end = t.done_ns if t.done_ns >= 0 else now
                n += (end - t.first_token_ns) > tpot * max(1, t.req.output_tokens - 1)
        return n

    def arrived(self, req: Request) -> bool:
        """Route the request (at its arrival: the decode loads are those of now). A route to an
        instance that does not exist is the router's bug: a violation, and the request fails."""
        self.arrived_n += 1
        if len(self.load) == 1 and len(self._pjobs) == 1:
            self.routed["prefill"][0] += 1
            self.routed["decode"][0] += 1
            self.load[0] += 1
            return True
        p, d = self.router.route(tuple(self.load))
        if not (0 <= p < len(self._pjobs) and 0 <= d < len(self.load)):
            self.world.violate(
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
        r = self.tracks[req.key].req
        self.pre_tokens[p] += r.input_tokens - r.prefix_hit_tokens
        self.dec_tokens[d] += r.input_tokens + r.output_tokens
        self._weighed.add(req.key)
        return True

    def _finish(self, key: int, failed: bool) -> None:
        t = self.tracks[key]
        t.failed = failed
        if failed and t.first_token_ns < 0:
            self.failed_early_n += 1
        t.done_ns = int(self.env.now)
        self.finished += 1
        req = self.requests[key]
        if req.opened:
            self.load[req.dec_inst] -= 1
        if key in self._weighed:
            self._weighed.discard(key)
            self.dec_tokens[req.dec_inst] -= t.req.input_tokens + t.req.output_tokens
            if len(t.chunk_ready_ns) < len(req.chunks):  # failed before its prompt was computed
                self.pre_tokens[req.pre_inst] -= t.req.input_tokens - t.req.prefix_hit_tokens
        if self._closed and self._next < self.total:
            self._submit(int(self.env.now))
        if self.finished >= self.total and not self.all_done.triggered:
            self.all_done.succeed()

    # ------------------------------------------------------------------ prefill
    def compute_chunk(  # type: ignore[no-untyped-def]
        self, req: Request, start: int, tokens: int, on_layer: Callable[[int], None] | None = None
    ):
        hit = self.tracks[req.key].req.prefix_hit_tokens
        new_start = max(start, hit)
        new = max(0, start + tokens - new_start)
        if new:
            done = self.env.event()
            i = req.pre_inst
            self._pjobs[i].append((new, new_start, done, on_layer is not None))
            if not self._pwake[i].triggered:
                self._pwake[i].succeed()
            step = yield done  # a layer-wise job hears its forward step's length as it starts
            if on_layer is not None:
                yield from self.world.layers(step, on_layer)
        else:
            yield self.env.timeout(1)  # a cached chunk: nothing to compute
            for layer in range(self.model.num_layers if on_layer is not None else 0):
                on_layer(layer)  # type: ignore[misc]
        ready = self.tracks[req.key].chunk_ready_ns
        ready.append(int(self.env.now))
        if len(ready) == len(req.chunks) and req.key in self._weighed:
            r = self.tracks[req.key].req
            self.pre_tokens[req.pre_inst] -= r.input_tokens - r.prefix_hit_tokens
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
            step = self.roof_p.prefill_batch_ns([(t, ctx) for t, ctx, _, _ in batch])
            busy[i] += step
            for _, _, done, layered in batch:
                if layered:
                    done.succeed(step)  # its room reports the step's layers as they finish
            yield self.env.timeout(step)
            for _, _, done, layered in batch:
                if not layered:
                    done.succeed()

    # ------------------------------------------------------------------ serial pull
    def decode_opens_late(self, req: Request) -> bool:
        if self.spec.serial_pull:
            self._prefilled[req.key] = self.env.event()
            return True
        return super().decode_opens_late(req)

    def open_decode_later(self, req: Request, lag_ns: int):  # type: ignore[no-untyped-def]
        if not self.spec.serial_pull:
            yield from super().open_decode_later(req, lag_ns)
            return
        yield self._prefilled[req.key]
        yield self.env.timeout(round(self.spec.proxy_hop_ms * 1_000_000))
        # The request reached decode's engine; its scheduler admits it between two steps.
        wait = self._step_end[req.dec_inst] - int(self.env.now)
        if wait > 0:
            yield self.env.timeout(wait)
        self.decode_open_ns[req.key] = int(self.env.now)
        self.world.open_decode(req)
        self.world.check_side(req, "decode")

    # ------------------------------------------------------------------ decode
    def side_checked(self, req: Request, side: str, had: str) -> None:
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

    def free_dec_pages(self, req: Request) -> None:
        # Decode still needs a delivered request's pages: freed after its last token. (Keyed on
        # the outcome, set before the World frees, not on a set filled after: the engines may have
        # dropped the room already, and the pages then went back at KV arrival.)
        if req.outcome == "success" and req.key not in self._decoded:
            return
        if self._grows and not req.dec_pages_freed:
            j = req.dec_inst
            self._holders[j] -= 1
            if self._retracted[j] and not self._wake[j].triggered:
                self._wake[j].succeed()  # room for a retracted request, maybe
        super().free_dec_pages(req)

    # ------------------------------------------------------------------ decode memory
    def decode_fits(self, req: Request, pages: PageAllocator, n: int) -> bool:
        if not self._grows:
            return super().decode_fits(req, pages, n)
        j, ps = req.dec_inst, self.spec.decode_page_size
        reserved = self.spec.decode_reserved_tokens
        running = self._running_view(j)
        budget = allocatable_tokens(
            self._free_tokens(pages), reserved, self._holders[j], running, self._retracted_need(j)
        )
        r = self.tracks[req.key].req
        return admits(n * ps, r.input_tokens, r.output_tokens, reserved, budget, running)

    def admitted(self, req: Request) -> None:
        if self._grows:
            self._holders[req.dec_inst] += 1

    def _refuse_what_never_fits(self, lengths: tuple[DeployRequest, ...]) -> None:
        ps = self.spec.decode_page_size
        pool = self.scenario.topology.decode_pages * ps
        reserved = self.spec.decode_reserved_tokens
        for r in {(q.input_tokens, q.output_tokens) for q in lengths}:
            if never_fits(-(-r[0] // ps) * ps, r[0], r[1], reserved, pool):
                raise DeployError(
                    f"a request of {r[0]} input and {r[1]} output tokens never fits decode's "
                    f"{pool:,} tokens a rank with {reserved} reserved (SGLang would never admit it): "
                    "raise the decode TP or lower decode_reserved_tokens"
                )

    def _free_tokens(self, pages: PageAllocator) -> int:
        return (self.scenario.topology.decode_pages - pages.used) * self.spec.decode_page_size

    def _running_view(self, j: int) -> list[Running]:
        return [(t.req.input_tokens, t.tokens, t.req.output_tokens) for t in self._running[j]]

    def _pages_for(self, t: Track) -> int:
        """Pages holding a request's tokens so far (its prompt and what it generated)."""
        return -(-(t.req.input_tokens + t.tokens) // self.spec.decode_page_size)

    def _retracted_need(self, j: int) -> int:
        ps, reserved = self.spec.decode_page_size, self.spec.decode_reserved_tokens
        return sum(self._pages_for(self.tracks[k]) * ps + reserved for k in self._retracted[j])

    def _dec_pages(self, j: int) -> PageAllocator:
        w = self.world
        return w.allocs[w.instance_nodes["decode"][j][0]][0]

    def _retract(self, j: int, t: Track, k: int) -> int:
        """Swap request ``k`` out of decode instance ``j``: its pages go back, it queues to come
        back. Returns the swap's ns."""
        req = self.requests[k]
        held = [req.dec_pages, *self._grown.pop(k, [])]
        ids = np.concatenate(held)
        self._dec_pages(j).free(ids, k)
        req.dec_pages = ids[:0]  # until it comes back with new ones
        self._holders[j] -= 1
        self._retracted[j].append(k)
        t.retractions += 1
        self.retractions += 1
        return round(len(ids) * self._swap_ns_per_page + self._swap_ns_state)

    def _resume(self, j: int, batch: list[Track], keys: list[int]) -> tuple[int, int]:
        """Bring retracted requests back into the batch while there is room (first in, first
        out). Returns the swaps' ns and the tokens they add to the batch's context."""
        q, pages = self._retracted[j], self._dec_pages(j)
        ps, reserved = self.spec.decode_page_size, self.spec.decode_reserved_tokens
        ns = added = 0
        while q and len(batch) < self.spec.max_batch:
            k = q[0]
            t = self.tracks[k]
            n = self._pages_for(t)
            # SGLang resumes against the free tokens less the holders' reservation only.
            room = allocatable_tokens(self._free_tokens(pages), reserved, self._holders[j], ())
            if n * ps + reserved > room:
                break
            got = pages.alloc(n, k)
            if got is None:
                break
            q.popleft()
            self.requests[k].dec_pages = got
            self._holders[j] += 1
            batch.append(t)
            keys.append(k)
            ns += round(n * self._swap_ns_per_page + self._swap_ns_state)
            added += t.req.input_tokens + t.tokens
        return ns, added

    @property
    def _grows(self) -> bool:
        return self.spec.page_allocator == "sglang"

    def _grow(self, j: int, batch: list[Track], keys: list[int]) -> tuple[int, int]:
        """Give every sequence of the step a page for the token it writes when its pages are
        full, in batch order from one free list (SGLang's alloc_decode: the new pages of a step
        are consecutive free-list entries, interleaving the requests); first retract requests
        if the free pages do not cover them. Returns the swaps' ns and the tokens the retracted
        requests take out of the batch's context."""
        ps = self.spec.decode_page_size
        pages = self._dec_pages(j)
        ns = removed = 0
        needy = sum(1 for t in batch if (t.req.input_tokens + t.tokens) % ps == 0)
        short = needy - (self.scenario.topology.decode_pages - pages.used)
        if short > 0 and len(batch) > 1:
            order = retraction_order([(t.req.input_tokens, t.tokens) for t in batch])
            out: set[int] = set()
            for i in order:
                if short <= 0 or len(out) == len(batch) - 1:
                    break
                t = batch[i]
                held = len(self.requests[keys[i]].dec_pages) + sum(map(len, self._grown.get(keys[i], [])))
                short -= held + ((t.req.input_tokens + t.tokens) % ps == 0)  # its pages, its need
                ns += self._retract(j, t, keys[i])
                removed += t.req.input_tokens + t.tokens
                out.add(i)
            batch[:] = [t for i, t in enumerate(batch) if i not in out]
            keys[:] = [k for i, k in enumerate(keys) if i not in out]
            self.world.memory_event()
        for t, k in zip(batch, keys, strict=True):
            pos = t.req.input_tokens + t.tokens  # the token this step writes
            if pos % ps:
                continue  # room left in its last page
            got = pages.alloc(1, k)
            if got is None:
                self.growth_short += 1
                continue
            self._grown.setdefault(k, []).append(got)
        return ns, removed

    def _free_grown(self, req: Request) -> None:
        grown = self._grown.pop(req.key, None)
        if grown:
            self._dec_pages(req.dec_inst).free(np.concatenate(grown), req.key)
            self.world.memory_event()

    def _take(self, j: int) -> int | None:
        """The next request whose KV is in at decode instance ``j`` (None: none waiting)."""
        waiting = self._waiting[j]
        return waiting.popleft() if waiting else None

    def _decode_loop(self, j: int):  # type: ignore[no-untyped-def]
        """Decode instance ``j``'s batch loop: only requests routed to ``j`` may join its batch
        (another instance's would be decoded where its KV is not: a violation)."""
        env, tracks, requests = self.env, self.tracks, self.requests
        busy = self.busy_ns["decode"]
        batch: list[Track] = self._running[j]  # changed in place: admission reads it
        keys: list[int] = []
        ctx = 0  # tokens the batch attends to: kept as a running sum (a step is the hot loop)
        while True:
            swap = 0  # the step first waits for its swaps out and in
            if self._retracted[j]:
                swap, added = self._resume(j, batch, keys)
                ctx += added
            while len(batch) < self.spec.max_batch:
                k = self._take(j)
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
                ctx += t.req.input_tokens + t.tokens
            if not batch:
                self._wake[j] = env.event()
                yield self._wake[j]
                continue
            if self._grows:
                ns, removed = self._grow(j, batch, keys)
                swap += ns
                ctx -= removed
            self.swap_ns += swap
            step = self.roof_d.decode_ns(len(batch), ctx) + swap
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
                    self.first_n += 1
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
                    self.world.check_side(req, "decode")  # frees the pages now
                self._finish(k, failed=False)
            batch[:], keys[:] = still, still_keys

    # ------------------------------------------------------------------ running
    def run_deploy(self, limit_ns: int) -> float:
        """Run until every request finished (or ``limit_ns`` of simulated time), then check the
        invariants as a scenario run does. Returns the wall time."""
        t0 = time.perf_counter()
        stop = self.env.any_of([self.all_done, self.env.timeout(limit_ns)])
        self.env.run(until=stop)
        self.world.deadline_ns = int(self.env.now) + 1
        if not self.stopped:
            # A run stopped as overloaded has rooms in flight: the end-of-run checks (liveness,
            # quiescence) do not apply to it; every check made while it ran stands.
            self.world.run()
        return time.perf_counter() - t0
