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
from collections.abc import Callable
from typing import Any

import msgspec
import simpy
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.runtime import SimRank
from kvferry.core.flows import Flow
from kvferry.core.geometry import ModelGeometry
from kvferry.sim import scenario as sc
from kvferry.sim.deploy.decode import DecodeSteps
from kvferry.sim.deploy.decode_memory import DecodeMemory
from kvferry.sim.deploy.prefill import PrefillSteps
from kvferry.sim.deploy.router import Loads, Router
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.deploy.timing import LayerPlanner, TimingFabric
from kvferry.sim.deploy.tracks import Monitor, RequestLog, Track
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


# ``_no_record`` itself: a tool that replaces it to see the silenced records (bench/replay_count.py
# --digest) gets every one of them, the world's status records included.
_SILENT = _no_record


class DeployWorld(Serving):
    """A deployment's servers around a ``World`` it composes (``self.world``) and serves, made of
    parts with one job each: the requests' tracks and counts (``log``) and the monitor that stops
    an overloaded run (``monitor``), sim/deploy/tracks.py; the router and the loads it weighs
    (``loads``), sim/deploy/router.py; prefill's steps (``prefill``), sim/deploy/prefill.py;
    decode's memory (``memory``), sim/deploy/decode_memory.py; decode's batch loops
    (``decode``), sim/deploy/decode.py. This class answers the world's ``Serving`` calls by
    them, and submits and finishes the requests."""

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
        self.prefill = PrefillSteps(self.env, spec, n_pre)
        self.log = RequestLog(self.env, arrivals, lengths)
        self.memory = DecodeMemory(spec, self.world, self.log.tracks, n_dec)
        self.decode = DecodeSteps(self.world, spec, self.log, self.memory, self._finish)
        self.loads = Loads(router or Router(n_pre, n_dec, spec.router), n_pre, n_dec)
        if self.memory.grows:
            self.memory.refuse_what_never_fits(lengths)
        # Serial pull: each request's prefill-finished event, and when its decode side opened.
        self._prefilled: dict[int, simpy.Event] = {}
        self.decode_open_ns: dict[int, int] = {}
        self.monitor = Monitor(self.env, spec, self.log, queue_limit, miss_limit, warmup_ns)
        # When a prefill rank's transfer worker first takes up each chunk: (room, chunk) -> latest
        # over the ranks (the transfer split's queueing ends there).
        self.picked_ns: dict[tuple[int, int], int] = {}
        self._start(arrivals)

    def _start(self, arrivals: Arrivals) -> None:
        """Submit the first requests, start every instance's loop and the monitor; silence the
        trace. (The order of these processes is the order of same-time events: kept as is.)"""
        if self.log.closed:
            for _ in range(min(arrivals.concurrency, self.log.total)):
                self._submit(0)
        else:
            for r in arrivals.requests:
                self._submit(r.arrival_ns, r)
        for j in range(self.spec.decode_instances):
            self.env.process(self.decode.loop(j))
        for i in range(self.spec.prefill_instances):
            self.env.process(self.prefill.loop(i))
        self.env.process(self.monitor.run())
        # A deployment run is judged on its metrics, not on its trace hash: the ~50 trace records
        # of each request are not hashed (reproducibility is checked on the metrics instead).
        self.trace.record = _no_record  # type: ignore[method-assign]
        self.world.status_records = _no_record is not _SILENT
        self.fabric.record = _no_record
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
    @property
    def tracks(self) -> dict[int, Track]:
        """Every request's timeline, by key."""
        return self.log.tracks

    @property
    def busy_ns(self) -> dict[str, list[int]]:
        """Simulated ns each instance spent in forward steps, by side."""
        return {"prefill": self.prefill.busy_ns, "decode": self.decode.busy_ns}

    def _submit(self, at_ns: int, r: DeployRequest | None = None) -> None:
        r = self.log.next_request(r)
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
        self.log.tracks[key] = Track(r, at_ns)
        self.env.process(self.world.request_process(req))

    def arrived(self, req: Request) -> bool:
        """Route the request (at its arrival: the decode loads are those of now). A route to an
        instance that does not exist is the router's bug: a violation, and the request fails."""
        self.log.arrived_n += 1
        p, d = self.loads.route(req, self.log.tracks[req.key].req)
        if self.loads.valid(p, d):
            return True
        self.world.violate(
            "routing",
            f"request {req.key} routed to prefill instance {p}, decode instance {d} of "
            f"{len(self.loads.pre_tokens)}P{len(self.loads.load)}D",
            req,
        )
        self._finish(req.key, failed=True)
        return False

    def _finish(self, key: int, failed: bool) -> None:
        now = int(self.env.now)
        t = self.log.finish(key, failed, now)
        self.loads.finished(self.requests[key], t.req, len(t.chunk_ready_ns))
        if self.log.more:
            self._submit(now)
        self.log.end_if_all_finished()

    # ------------------------------------------------------------------ prefill
    def compute_chunk(  # type: ignore[no-untyped-def]
        self, req: Request, start: int, tokens: int, on_layer: Callable[[int], None] | None = None
    ):
        t = self.log.tracks[req.key]
        new_start = max(start, t.req.prefix_hit_tokens)
        new = max(0, start + tokens - new_start)
        if new:
            done = self.prefill.queue(req.pre_inst, new, new_start, on_layer is not None)
            step = yield done  # a layer-wise job hears its forward step's length as it starts
            if on_layer is not None:
                yield from self.world.layers(step, on_layer)
        else:
            yield self.env.timeout(1)  # a cached chunk: nothing to compute
            for layer in range(self.model.num_layers if on_layer is not None else 0):
                on_layer(layer)  # type: ignore[misc]
        ready = t.chunk_ready_ns
        ready.append(int(self.env.now))
        if len(ready) == len(req.chunks):
            self.loads.prefilled(req, t.req)
            if req.key in self._prefilled:
                self._prefilled.pop(req.key).succeed()

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
        wait = self.decode.step_end[req.dec_inst] - int(self.env.now)
        if wait > 0:
            yield self.env.timeout(wait)
        self.decode_open_ns[req.key] = int(self.env.now)
        self.world.open_decode(req)
        self.world.check_side(req, "decode")

    # ------------------------------------------------------------------ decode
    def side_checked(self, req: Request, side: str, had: str) -> None:
        if side != "decode" or had or not req.outcome:
            return
        if req.outcome == "success":
            self.log.tracks[req.key].kv_done_ns = int(self.env.now)
            self.decode.deliver(req.dec_inst, req.key)
        else:
            self._finish(req.key, failed=True)

    def free_dec_pages(self, req: Request) -> None:
        # Decode still needs a delivered request's pages: freed after its last token. (Keyed on
        # the outcome, set before the World frees, not on a set filled after: the engines may have
        # dropped the room already, and the pages then went back at KV arrival.)
        if req.outcome == "success" and req.key not in self.decode.decoded:
            return
        if self.memory.grows and not req.dec_pages_freed and self.memory.released(req.dec_inst):
            self.decode.wake_up(req.dec_inst)  # room for a retracted request, maybe
        super().free_dec_pages(req)

    def decode_fits(self, req: Request, pages: PageAllocator, n: int) -> bool:
        if not self.memory.grows:
            return super().decode_fits(req, pages, n)
        return self.memory.fits(req, pages, n)

    def admitted(self, req: Request) -> None:
        if self.memory.grows:
            self.memory.holders[req.dec_inst] += 1

    # ------------------------------------------------------------------ running
    def run_deploy(self, limit_ns: int) -> float:
        """Run until every request finished (or ``limit_ns`` of simulated time), then check the
        invariants as a scenario run does. Returns the wall time."""
        t0 = time.perf_counter()
        stop = self.env.any_of([self.log.all_done, self.env.timeout(limit_ns)])
        self.env.run(until=stop)
        self.world.deadline_ns = int(self.env.now) + 1
        if not self.monitor.stopped:
            # A run stopped as overloaded has rooms in flight: the end-of-run checks (liveness,
            # quiescence) do not apply to it; every check made while it ran stands.
            self.world.run()
        return time.perf_counter() - t0
