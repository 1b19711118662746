"""One simulated deployment: prefill and decode servers on the fake fabric, a scheduler that feeds
them rooms, the fault schedule, and the bookkeeping the invariant checker reads.

The scheduler plays both LLM servers: decode allocates pages and an aux row and opens the room on
each decode rank; prefill allocates its own pages, "computes" each chunk (writes the room's
recognisable bytes, backends/pattern.py) and hands it to each prefill rank. It reacts to status
changes like a real scheduler: a room Failed on one rank of a server is aborted on the others;
once terminal everywhere on a side it is released; decode pages go back to the allocator only on
FreePages (the fence), prefill pages once the sender engine dropped the room (no write in flight).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import numpy as np
import simpy
from kvferry.backends import pattern
from kvferry.backends.simfabric.calls import FarTimeouts, call_after
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.runtime import SimRank
from kvferry.backends.simfabric.transport import SimTransport, node_name
from kvferry.backends.transport import encode_aux_room
from kvferry.core.commands import FreePages, StatusChanged
from kvferry.core.deadlines import Timeouts
from kvferry.core.errors import LocalMisuseError, WireError
from kvferry.core.events import AbortRoom, ChunkReady, LayersReady, ReceiverOpen, ReleaseRoom, SenderOpen
from kvferry.core.flows import Flow, FlowPolicy
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION, worker_region
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import Endpoint, RoomFailed, decode_control
from kvferry.core.sender import SenderEngine
from kvferry.sim import planted
from kvferry.sim.chaos import Chaos
from kvferry.sim.checker import check_final, check_liveness
from kvferry.sim.deploy.timing import TimingFabric, TimingTransport
from kvferry.sim.faults import Injector, draw_personality
from kvferry.sim.instances import Routing
from kvferry.sim.live_checks import LiveChecks
from kvferry.sim.pages import PageAllocator
from kvferry.sim.peek import NOTICE_TAGS, peek_decoder
from kvferry.sim.rng import Streams
from kvferry.sim.rooms import AUX_ROW_BYTES, Findings, Progress, Request, RoomTable, Violation, split_chunks
from kvferry.sim.scenario_schema import US, RoomSpec, Scenario, staging_sizes
from kvferry.sim.servers import Servers
from kvferry.sim.serving import Serving
from kvferry.sim.trace import Trace
from msgspec.structs import replace

_PEEKS_KEPT = 4096  # messages in flight whose peek is kept for their delivery (``_on_control``)
_POLL_NAME = {s: s.name for s in KVPoll}  # KVPoll -> its name, without the enum property
# The terminal members as plain module names: under Python 3.11 every ``KVPoll.Failed`` read goes
# through EnumType.__getattr__'s slow attribute hook (about ten times a global's cost), and the
# scheduler's reactions compare statuses several times per status change.
_FAILED, _SUCCESS = KVPoll.Failed, KVPoll.Success


class World:
    """Build with a scenario and a seed, then ``run()``; the result is in ``report()``."""

    def __init__(
        self,
        scenario: Scenario,
        seed: int | None = None,
        keep_trace: bool = False,
        instances: tuple[int, int] | None = None,
        serving: Serving | None = None,
    ) -> None:
        """``instances``: how many prefill and decode servers (each of the topology's TP) share the
        fabric (None: the scenario's ``[topology]``); a room runs between one of each, chosen by
        ``serving.arrived`` (sim/instances.py routes; sim/deploy routes its own way).
        ``serving``: the servers around the room process (sim/serving.py; None: a scenario's)."""
        self.serving = serving or Serving()
        self.serving.attach(self)  # before anything below asks it
        seed = scenario.seed if seed is None else seed
        self.streams = Streams(seed)
        if instances is not None:
            # Into the scenario, so a swarm draws its faults over every server's nodes and a saved
            # failure replays with the same servers.
            topo = replace(scenario.topology, prefill_instances=instances[0], decode_instances=instances[1])
            scenario = replace(scenario, topology=topo)
        self.scenario = s = draw_personality(replace(scenario, seed=seed), self.streams)
        self._hooks = frozenset(s.hooks)  # asked at every settled side: built once
        self.env = simpy.Environment()
        self.arrivals = FarTimeouts(self.env)  # every request's arrival, off SimPy's queue until next
        # The clock read at every trace record: a C-level call, no Python frame (env.now is a property).
        self.trace = Trace(partial(getattr, self.env, "_now"), keep=keep_trace)
        # Off where the trace is silenced (a deployment run): ``mark``, a dozen calls a room,
        # then skips building and passing a record nobody takes.
        self.status_records = True
        self.injector = Injector(s.faults, s.phases.fault_window_us * US, self.streams)
        # Timing only (deployment-sized models): the same costs, no byte copied (sim/deploy/timing.py).
        fabric_cls = Fabric if s.move_bytes else TimingFabric
        self.fabric = fabric_cls(self.env, s.fabric, self.streams["fabric"], self.injector, self.trace.record)
        self.live_checks = LiveChecks(self)
        self.fabric.on_land = self.live_checks.on_land
        self.fabric.on_control = self._on_control
        self.fabric.push_room = self._runs_push
        self.timeouts = Timeouts(**{f: getattr(s.timeouts, f) for f in s.timeouts.__struct_fields__})
        self.rooms = RoomTable()  # before the servers: routing reads it
        self._instances()
        clock = self.streams["clock"]
        skew_max = s.faults.clock_skew_max_us * US
        for name, ep in self.fleet.endpoint.items():  # a server's ranks share its host
            skew = clock.randrange(skew_max + 1) if skew_max else 0
            self.fabric.add_node(name, skew_ns=skew, host=ep.server)
        self.ranks: dict[str, SimRank] = {}
        self.findings = Findings()
        self._deferred: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        # A message's peek from its sending, taken back at its delivery (the same bytes): one
        # decode a message instead of two. Bounded: a dropped message is never taken back.
        self._peeked: dict[bytes, Any] = {}
        self.progress = Progress()
        self.staging = staging_sizes(s)
        for name in self.fleet.endpoint:
            self.start_rank(name)
        self._build_workload()
        self.chaos = Chaos(self)  # crashes, restarts, link faults and the heal
        self.env.process(self.chaos.schedule())

    def _instances(self) -> None:
        """Name every server's ranks and give each server its own page and aux-row allocators
        (sim/servers.py), and route rooms to them (sim/instances.py)."""
        s = self.scenario
        self.fleet = f = Servers(
            s, self.env, self.serving.page_allocator, "links_cache_by_decode" in self.hooks
        )
        self.routing = Routing(f.names, f.nodes, self.rooms.by_room, self.trace.record, self.violate)

    # Read by the checkers, metrics and sim/deploy: the geometry, each side's TP and pools, the
    # servers of each side, their rank nodes, and each node's allocators (sim/servers.py).
    @property
    def seed(self) -> int:
        return self.scenario.seed

    @property
    def hooks(self) -> frozenset[str]:
        """The planted bugs switched on (sim/planted.py), asked where each one acts."""
        return self._hooks

    # The run's rooms and findings, read by the checkers, metrics, the CLI, sim/deploy and tests.
    @property
    def requests(self) -> list[Request]:
        return self.rooms.requests

    @property
    def by_room(self) -> dict[int, Request]:
        return self.rooms.by_room

    @property
    def violations(self) -> list[Violation]:
        return self.findings.violations

    @property
    def agreement_exempt(self) -> list[tuple[int, str]]:
        return self.findings.agreement_exempt

    @property
    def deadline_ns(self) -> int:
        return self.progress.deadline_ns

    @deadline_ns.setter
    def deadline_ns(self, ns: int) -> None:  # sim/deploy ends a run early
        self.progress.deadline_ns = ns

    @property
    def model(self) -> ModelGeometry:
        return self.fleet.model

    @property
    def P(self) -> int:
        return self.fleet.P

    @property
    def D(self) -> int:
        return self.fleet.D

    @property
    def pre_pools(self) -> tuple[PoolGeometry, ...]:
        return self.fleet.pre_pools

    @property
    def dec_pools(self) -> tuple[PoolGeometry, ...]:
        return self.fleet.dec_pools

    @property
    def servers(self) -> dict[str, tuple[str, ...]]:
        return self.fleet.names

    @property
    def instance_nodes(self) -> dict[str, tuple[tuple[str, ...], ...]]:
        return self.fleet.nodes

    @property
    def allocs(self) -> dict[str, tuple[PageAllocator, PageAllocator]]:
        return self.fleet.allocs

    def room_nodes(self, req: Request, side: str) -> tuple[str, ...]:
        """The ranks of the server on ``side`` that the room runs on."""
        return self.fleet.nodes[side][req.pre_inst if side == "prefill" else req.dec_inst]

    # --------------------------------------------------------------------------- ranks
    def _endpoint(self, node: str) -> Endpoint:
        return self.fleet.endpoint[node]

    def start_rank(self, node: str) -> None:
        ep = self._endpoint(node)
        prefill = self.fleet.side_of[node] == "prefill"
        pool = self.pre_pools[ep.rank] if prefill else self.dec_pools[ep.rank]
        tr = (SimTransport if self.scenario.move_bytes else TimingTransport)(self.fabric, ep, pool)
        tr.register_regions(pool.regions, self.scenario.topology.aux_rows, AUX_ROW_BYTES)
        st = self.staging
        planner = self.serving.rank_planner()
        if prefill:
            if "chunk_offset_own_length" in self.hooks:
                planner = planted.offset_from_own_length_planner()
            workers = self.scenario.topology.workers
            buffers = {worker_region(i): st.worker_buffer_bytes for i in range(workers)}
            tr.register_staging({**buffers, PINNED_REGION: st.prefill_pinned_bytes})
            engine: Any = planted.sender_class(self.hooks)(
                ep,
                pool,
                timeouts=self.timeouts,
                num_shards=workers,
                planner=planner,
                policy=FlowPolicy(fallback_direct=st.fallback_direct),
                worker_buffer_bytes=st.worker_buffer_bytes,
                pinned_bytes=st.prefill_pinned_bytes,
                registration=tr.registration(),
                push_match=self.staging.push_match,
            )
        else:
            tr.register_staging(
                {RING_REGION: st.ring_bytes, PINNED_REGION: st.pinned_bytes}, st.ring_bytes, st.pinned_bytes
            )
            engine = planted.receiver_class(self.hooks)(
                tr.registration(), timeouts=self.timeouts, planner=planner
            )
            workers = 0
        tr.kernel_rng = self.streams[f"kernels.{node}"]
        self.ranks[node] = SimRank(self.env, self.fabric, tr, engine, self, workers, self.trace.record)

    def room_flow(self, req: Request) -> str | None:
        """The flow a room is opened with: None lets the policy choose."""
        f = self.staging.flow
        if f == "policy":
            return None
        if f != "mixed":
            return f
        offered = [Flow.DIRECT.value, Flow.PULL.value, Flow.PUSH.value]
        if self.staging.ring_bytes and self.staging.worker_buffer_bytes:
            offered.append(Flow.RING.value)
        if self.staging.pinned_bytes and self.staging.prefill_pinned_bytes:
            offered.append(Flow.PINNED.value)
        return offered[self.streams["flows"].randrange(len(offered))]

    def _runs_push(self, room: int) -> bool:
        """The room was opened with the push flow (the policy never picks push by itself)."""
        req = self.rooms.by_room.get(room)
        return req is not None and req.flow == Flow.PUSH.value

    def receivers_of(self, node: str, req: Request) -> list[str]:
        """The decode nodes a prefill node exchanges data or notes with for the room."""
        return [node_name(ep) for ep in self.fleet.links(req)[1][self.fleet.endpoint[node].rank]]

    def alive(self, node: str, req: Request) -> bool:
        r = self.ranks[node]
        return not r.dead and req.inc.get(node) == r.incarnation

    # --------------------------------------------------------------------------- workload
    def _build_workload(self) -> None:
        s = self.scenario
        w = s.workload
        rng = self.streams["workload"]
        rooms_rng = self.streams["rooms"]
        specs: list[RoomSpec] = list(w.explicit)
        t = 0
        while len(specs) < w.rooms:
            t += int(rng.expovariate(1.0 / max(1, w.arrival_mean_us))) if w.arrival_mean_us else 0
            specs.append(
                RoomSpec(
                    tokens=rng.randint(w.tokens_min, w.tokens_max),
                    arrival_us=t,
                    prefill_delay_us=rng.randrange(0, 50),
                )
            )
        if w.decode_lag_us_max:
            lag_rng = self.streams["workload.decode_lag"]
            specs = [
                replace(x, decode_lag_us=lag_rng.randint(0, w.decode_lag_us_max))
                if i >= len(w.explicit)
                else x
                for i, x in enumerate(specs)
            ]
        if w.length_mismatch:
            specs = self._mismatch(specs, len(w.explicit))
        used: set[int] = set()
        abort_rng = self.streams["faults.abort"]
        # An abort hits one rank of the room's own servers, known only once it is routed: drawn
        # as (side, rank) here, from as many choices as one server a side has nodes (so a world
        # of one server a side draws exactly what it drew when aborts named nodes).
        ranks = [("prefill", r) for r in range(self.P)] + [("decode", r) for r in range(self.D)]
        for key, spec in enumerate(specs):
            room = rooms_rng.getrandbits(63)
            while room in used:
                room = rooms_rng.getrandbits(63)
            used.add(room)
            chunks = spec.chunks or split_chunks(spec.tokens, w.chunk_tokens)
            req = Request(
                key=key,
                room=room,
                tid=f"t{self.seed}-{key}",
                spec=spec,
                chunks=chunks,
                arrival_ns=spec.arrival_us * US,
            )
            self.rooms.requests.append(req)
            self.rooms.by_room[room] = req
            self.env.process(self.request_process(req))
            f = s.faults
            if f.abort and abort_rng.random() < f.abort:
                at = req.arrival_ns + abort_rng.randrange(1, 3000 * US)
                side, rank = abort_rng.choice(ranks)
                if at < s.phases.fault_window_us * US:
                    self.env.process(self._abort_later(req, side, rank, at))
        last = max((r.arrival_ns for r in self.rooms.requests), default=0)
        self.progress.deadline_ns = max(s.phases.fault_window_us * US, last) + s.phases.liveness_us * US

    def _mismatch(self, specs: list[RoomSpec], first: int) -> list[RoomSpec]:
        """Give a share of the drawn rooms a decode allocation shorter or longer than prefill's
        (its own stream: other draws of the seed stay as they were)."""
        rng = self.streams["workload.mismatch"]
        t = self.scenario.topology
        cap = t.decode_pages * t.decode_page_size
        out = list(specs)
        for i in range(first, len(out)):
            if rng.random() >= self.scenario.workload.length_mismatch:
                continue
            n = out[i].tokens
            # Off by one page boundary or a whole chunk, either way; never 0, never past the pool.
            delta = rng.choice((1, 2, max(1, n // 4), n))
            dec = n - delta if rng.random() < 0.5 and n - delta >= 1 else n + delta
            dec = min(dec, cap)
            if dec != n:
                out[i] = replace(out[i], decode_tokens=dec)
        return out

    def _abort_later(self, req: Request, side: str, rank: int, at: int):  # type: ignore[no-untyped-def]
        yield self.env.timeout(at - int(self.env._now))
        node = self.room_nodes(req, side)[rank]
        if req.opened and self.alive(node, req) and not _terminal(req.status.get(node)):
            self.injector.counts["abort"] += 1
            self.trace.record("abort", node, room=req.room)
            self.ranks[node].feed(
                AbortRoom(room=req.room, transfer_id=req.tid, reason="scheduler abort (fault)")
            )

    def request_process(self, req: Request):  # type: ignore[no-untyped-def]
        """The room's life from its arrival: memory, opening both sides, its chunks."""
        env = self.env
        # Absolute: a request may be added later. Made for every request at the start: one of the
        # far timeouts, kept off SimPy's queue (as long as the run) until it is next.
        yield self.arrivals.timeout(req.arrival_ns - int(env._now))
        if not self.serving.arrived(req):
            return
        yield from self._admit(req)
        yield from self._open_room(req)
        yield from self._compute_chunks(req)

    def _admit(self, req: Request):  # type: ignore[no-untyped-def]
        """Wait for memory like a real scheduler would, first come first served: a request waits
        until the ones that arrived before it got their memory and enough is free for it."""
        serving = self.serving
        t = self.scenario.topology
        n_dec = -(-req.dec_tokens // t.decode_page_size)
        n_pre = -(-req.spec.tokens // t.prefill_page_size)
        pre_pages, pre_aux = self.fleet.allocs[self.room_nodes(req, "prefill")[0]]
        dec_pages, dec_aux = self.fleet.allocs[self.room_nodes(req, "decode")[0]]
        lane = (req.pre_inst, req.dec_inst)
        turn = self.fleet.admission.ticket(lane)
        if turn is not None:
            yield turn
        while not (
            serving.decode_fits(req, dec_pages, n_dec)
            and pre_pages.used + n_pre <= t.prefill_pages
            and dec_aux.used < t.aux_rows
            and pre_aux.used < t.aux_rows
        ):
            yield self.fleet.admission.changed  # only the head of the line waits here
        self.fleet.admission.admitted(lane)
        req.dec_pages = dec_pages.alloc(n_dec, req.key)
        req.pre_pages = pre_pages.alloc(n_pre, req.key)
        req.dec_aux = dec_aux.alloc(1, req.key)
        req.pre_aux = pre_aux.alloc(1, req.key)
        serving.admitted(req)

    def _open_room(self, req: Request):  # type: ignore[no-untyped-def]
        """Open the room on both sides (decode first, or prefill first when decode opens late),
        its flow chosen and its prefix hit drawn."""
        serving, env, s = self.serving, self.env, self.scenario
        self.progress.rooms_started += 1
        self.trace.record(
            "room_arrive", "scheduler", room=req.room, key=req.key, tokens=req.spec.tokens, chunks=req.chunks
        )
        req.opened = True
        req.flow = self.room_flow(req)
        prefix_rng = self.streams["workload.prefix"]
        hit = prefix_rng.random() < s.workload.prefix_hit  # drawn for every room: stable streams
        length = prefix_rng.randint(0, req.spec.tokens)
        if hit and req.flow in _PREFIX_FLOWS:
            req.token_start = min(length, req.dec_tokens)  # a hit lies inside decode's allocation
        if serving.decode_opens_late(req):
            # Decode allocates late: prefill opens and computes first (staging requests arrive
            # before decode knows the room and must be held there).
            self._open_prefill(req)
            env.process(serving.open_decode_later(req, req.spec.decode_lag_us * US))
        else:
            self.open_decode(req)
            if req.spec.prefill_delay_us:
                yield env.timeout(req.spec.prefill_delay_us * US)
            self._open_prefill(req)
        self.check_side(req, "decode")
        self.check_side(req, "prefill")

    def _compute_chunks(self, req: Request):  # type: ignore[no-untyped-def]
        """Prefill computes the room's chunks in order, each handed over to its ranks."""
        serving = self.serving
        start = 0
        for i, n in enumerate(req.chunks):
            end = start + n
            if req.flow == _LAYERWISE:
                # The layer-wise flow: the chunk is handed over when its forward starts, each
                # layer the moment it is computed (core/flows/layerwise.py).
                fed = self._hand_over(req, i, start, end)
                yield from serving.compute_chunk(
                    req, start, n, lambda layer, i=i, fed=fed: self._layer_done(req, i, layer, fed)
                )
            else:
                yield from serving.compute_chunk(req, start, n)
                self._hand_over(req, i, start, end)
            start = end

    def _hand_over(self, req: Request, i: int, start: int, end: int) -> list[str]:
        """Chunk ``i`` (tokens [start, end)) to every prefill rank of the room still in it; the
        ranks that took it."""
        s = self.scenario
        fed = []
        for node in self.room_nodes(req, "prefill"):
            if not self.alive(node, req) or _terminal(req.status.get(node)):
                continue
            rank = self.ranks[node]
            if s.move_bytes:
                tr = rank.transport
                pattern.fill(tr.pool, tr.memory.region, req.key, req.pre_pages, start, end)
            chunk = ChunkReady(
                room=req.room,
                transfer_id=req.tid,
                chunk_index=i,
                token_end=end,
                src_pages=req.pre_pages,
                is_last=i == len(req.chunks) - 1,
            )
            try:
                rank.feed(chunk)
            except LocalMisuseError as exc:
                if not req.mismatched:
                    raise
                # The sender knows decode's length and refuses a chunk past it, to us, its
                # caller: a real scheduler would abort the room, and so do we.
                self.trace.record("chunk_refused", node, room=req.room, reason=str(exc))
                rank.feed(AbortRoom(room=req.room, transfer_id=req.tid, reason=f"refused: {exc}"))
            else:
                fed.append(node)
        return fed

    def _layer_done(self, req: Request, i: int, layer: int, nodes: list[str]) -> None:
        """Layer ``layer`` of chunk ``i`` computed on the prefill ranks that took the chunk. A
        forward, once started, runs to its end whatever became of the room (an engine reports
        every layer of its batch): a rank whose room failed meanwhile hears the rest too, and its
        Failed room must post none of them (core/sender.py)."""
        ev = LayersReady(
            room=req.room, transfer_id=req.tid, chunk_index=i, first_layer=layer, end_layer=layer + 1
        )
        for node in nodes:
            if self.alive(node, req):
                self.ranks[node].feed(ev)

    def layers(self, total_ns: int, on_layer: Callable[[int], None]):  # type: ignore[no-untyped-def]
        """A forward pass of ``total_ns`` layer by layer (equal shares), ``on_layer`` after each."""
        n = self.model.num_layers
        for layer in range(n):
            yield self.env.timeout(total_ns * (layer + 1) // n - total_ns * layer // n)
            on_layer(layer)

    def open_decode(self, req: Request) -> None:
        senders = self.fleet.links(req)[0]
        for d, node in enumerate(self.room_nodes(req, "decode")):
            rank = self.ranks[node]
            req.inc[node] = rank.incarnation
            if rank.dead:
                self.mark(req, node, _FAILED, "node down at open")
                continue
            if req.token_start and self.scenario.move_bytes:
                # The prefix cache: decode's own copy of the first tokens, already in its pages.
                tr = rank.transport
                pattern.fill(tr.pool, tr.memory.region, req.key, req.dec_pages, 0, req.token_start)
            rank.feed(
                ReceiverOpen(
                    room=req.room,
                    transfer_id=req.tid,
                    dst_pages=req.dec_pages,
                    num_tokens=req.dec_tokens,
                    aux_index=int(req.dec_aux[0]),
                    senders=senders[d],
                    token_start=req.token_start,
                )
            )

    def _open_prefill(self, req: Request) -> None:
        aux_row = np.frombuffer(encode_aux_room(req.room), dtype=np.uint8)
        receivers = self.fleet.links(req)[1]
        for p, node in enumerate(self.room_nodes(req, "prefill")):
            rank = self.ranks[node]
            req.inc[node] = rank.incarnation
            if rank.dead:
                self.mark(req, node, _FAILED, "node down at open")
                continue
            rank.transport.aux_row(int(req.pre_aux[0]))[: aux_row.size] = aux_row
            rank.feed(
                SenderOpen(
                    room=req.room,
                    transfer_id=req.tid,
                    aux_index=int(req.pre_aux[0]),
                    receivers=receivers[p],
                    flow=req.flow,
                )
            )

    # --------------------------------------------------------------------------- sink (from ranks)
    def status(self, rank: SimRank, cmd: StatusChanged) -> None:
        req = self.rooms.by_room.get(cmd.room)
        if req is None or req.tid != cmd.transfer_id:
            return
        if self.routing.multi and self.scenario.checks.isolation:
            self.routing.check_status(req, rank.node)
        # React after the driver finished executing this batch of commands (no re-entry into
        # the engine from inside its own command list), at the same simulated instant.
        self.later(self.mark, req, rank.node, cmd.status, cmd.reason, rank.incarnation)

    def after_pump(self, rank: SimRank) -> None:
        if (
            rank.node.startswith("prefill")
            and rank.engine.staged.stalled
            and self.scenario.checks.ring_progress
        ):
            self.live_checks.ring_progress(rank)
        waiting = self.rooms.awaiting_prefill
        if waiting and rank.node.startswith("prefill"):
            for key in sorted(waiting):
                self._maybe_free_prefill(self.rooms.requests[key])

    def later(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at this simulated instant, after the current callback, in call order.

        One SimPy event per batch rather than per call: status changes come in bursts.
        """
        self._deferred.append((fn, args))
        if len(self._deferred) == 1:
            call_after(self.env, 0, self._flush_deferred)

    def _flush_deferred(self) -> None:
        i = 0
        while i < len(self._deferred):  # fns may defer more; they run in this same flush
            fn, args = self._deferred[i]
            fn(*args)
            i += 1
        self._deferred.clear()

    def mark(self, req: Request, node: str, status: KVPoll, reason: str, inc: int | None = None) -> None:
        inc = self.ranks[node].incarnation if inc is None else inc
        # The name from a table: ``Enum.name`` is a Python-level property (16 calls a room).
        if self.status_records:
            name = _POLL_NAME[status]
            self.trace.record("status", node, room=req.room, key=req.key, status=name, reason=reason)
        checks = self.scenario.checks
        key = (node, inc, req.key, req.tid)
        status_log = self.findings.status_log
        old = status_log.get(key)
        if old is not None and checks.monotone:
            if old is _FAILED and status is not _FAILED:
                self.violate("failed_absorbing", f"{node} room {req.key}: {old.name} -> {status.name}", req)
            elif status < old and status is not _FAILED:
                self.violate("status_monotone", f"{node} room {req.key}: {old.name} -> {status.name}", req)
        status_log[key] = status
        if req.inc.get(node, inc) != inc:
            return  # an old incarnation's news
        side = self.fleet.side_of[node]
        released = req.dec_released if side == "decode" else req.pre_released
        if req.success_all_ns >= 0 and status is not _SUCCESS and checks.success_stable and released:
            self.violate(
                "success_stable",
                f"{node} room {req.key}: {status.name} ({reason}) after the room was Success on "
                f"every rank and released",
                req,
            )
        prev = req.status.get(node)
        if prev is _FAILED:
            return
        req.status[node] = status
        if status is _FAILED:
            req.reason[node] = reason
            req.terminal_ns.setdefault(node, int(self.env._now))
            if side == "decode" and "free_pages_early" in self.hooks:
                self.serving.free_dec_pages(req)  # planted bug: ignores the fence
        elif status is _SUCCESS:
            req.terminal_ns.setdefault(node, int(self.env._now))
            if req.success_all_ns < 0 and self._all_success(req):
                req.success_all_ns = int(self.env._now)
        self.check_side(req, side)

    def _all_success(self, req: Request) -> bool:
        status = req.status
        for n in self.room_nodes(req, "prefill") + self.room_nodes(req, "decode"):
            if status.get(n) is not _SUCCESS:  # a loop: no generator frame per Success
                return False
        return True

    def free_pages(self, rank: SimRank, cmd: FreePages) -> None:
        req = self.rooms.by_room.get(cmd.room)
        if req is None or req.tid != cmd.transfer_id or req.inc.get(rank.node) != rank.incarnation:
            return
        req.freed.add(rank.node)
        self.trace.record("free_pages", rank.node, room=req.room, reason=cmd.reason)
        self.later(self.check_side, req, "decode")

    # --------------------------------------------------------------------------- scheduler reactions
    def check_side(self, req: Request, side: str) -> None:
        """React to the room's state on one side (abort its other ranks, settle its outcome,
        release it, free its memory); then the servers hear of it."""
        had = req.outcome
        self._settle_side(req, side)
        self.serving.side_checked(req, side, had)

    def _settle_side(self, req: Request, side: str) -> None:
        if not req.opened:
            return
        # ``room_nodes`` inline (asked at every status change)
        nodes = self.fleet.nodes[side][req.pre_inst if side == "prefill" else req.dec_inst]
        inc = req.inc
        for n in nodes:
            if n not in inc:
                return  # not opened on every rank yet
        status = req.status
        stats = list(map(status.get, nodes))  # no comprehension frame (every status change)
        # One failed rank fails the room on this server: abort it on the others.
        if _FAILED in stats:
            for n in nodes:
                if n not in req.aborted and self.alive(n, req) and not _terminal(req.status.get(n)):
                    req.aborted.add(n)
                    self.ranks[n].feed(
                        AbortRoom(room=req.room, transfer_id=req.tid, reason="failed on another rank")
                    )
            stats = list(map(status.get, nodes))
        for st in stats:  # every rank terminal (asked on every status change: no generator)
            if st is not _SUCCESS and st is not _FAILED:
                return
        if side == "decode":
            if not req.outcome:
                req.outcome = "success" if all(st is _SUCCESS for st in stats) else "failed"
                if req.outcome == "success" and self.scenario.checks.bytes and self.scenario.move_bytes:
                    self.live_checks.verify(req)
            if not req.dec_released:
                req.dec_released = True
                if "keep_room_tables" not in self.hooks:
                    for n in nodes:
                        if self.alive(n, req):
                            self.ranks[n].feed(ReleaseRoom(room=req.room, transfer_id=req.tid))
            # Pages go back once no decode rank protects them: FreePages (the fence) for a failed
            # room, or the engine dropping a released Success room (decode then owns the pages).
            if not req.dec_pages_freed and all(
                n in req.freed or not self.alive(n, req) or not self.ranks[n].engine.pages_in_use(req.room)
                for n in nodes
            ):
                self.serving.free_dec_pages(req)
        else:
            if not req.pre_released:
                req.pre_released = True
                for n in nodes:
                    if self.alive(n, req):
                        self.ranks[n].feed(ReleaseRoom(room=req.room, transfer_id=req.tid))
            self._maybe_free_prefill(req)

    def _maybe_free_prefill(self, req: Request) -> None:
        if req.pre_pages_freed or not req.pre_released:
            return
        for n in self.room_nodes(req, "prefill"):
            if self.alive(n, req) and self.ranks[n].engine.state(req.room) is not None:
                self.rooms.awaiting_prefill.add(req.key)
                return
        self.rooms.awaiting_prefill.discard(req.key)
        req.pre_pages_freed = True
        pages, aux = self.fleet.allocs[self.room_nodes(req, "prefill")[0]]
        pages.free(req.pre_pages, req.key)
        aux.free(req.pre_aux, req.key)
        self.memory_event()

    def memory_event(self) -> None:
        """Wake the requests waiting for memory (admission order is kept by their tickets)."""
        self.fleet.admission.memory_freed()

    def release_dec_pages(self, req: Request) -> None:
        """Decode's pages and aux row of the room back to its server (once)."""
        if req.dec_pages_freed:
            return
        req.dec_pages_freed = True
        self.routing.unload(req)
        pages, aux = self.fleet.allocs[self.room_nodes(req, "decode")[0]]
        pages.free(req.dec_pages, req.key)
        aux.free(req.dec_aux, req.key)
        self.memory_event()

    def _on_control(self, what: str, src: str, dst: str, payload: bytes) -> bool:
        """Log every failure notice per room (what the agreement exemption is judged from)."""
        # Every message is seen twice here (sent, delivered): its tag and room are read without
        # building the rest (a pull offer carries a whole registration); only failure notices are
        # decoded in full.
        peek = self._peeked.pop(payload, None) if what == "delivered" else None
        if peek is None:
            try:
                peek = peek_decoder.decode(payload)
            except (msgspec.MsgspecError, ValueError, TypeError):
                return True
            if what == "sent":
                if len(self._peeked) >= _PEEKS_KEPT:
                    self._peeked.clear()
                self._peeked[payload] = peek
        if self.routing.multi and what == "sent" and self.scenario.checks.isolation:
            self.routing.check_message(peek, src, dst)
        if peek.t not in NOTICE_TAGS:
            return True
        try:
            msg = decode_control(payload)
        except WireError:
            return True
        t = type(msg)
        req = self.rooms.by_room.get(msg.room)
        if req is None or req.tid != msg.transfer_id:
            return True
        now = int(self.env._now)
        k = (src, dst, t.__name__)
        rec = req.notices.get(k)
        if what == "sent":
            if rec is None:
                req.notices[k] = [now, now, 0, -1]
            else:
                rec[1] = now
            return True
        if rec is not None:
            rec[2] += 1
            if rec[3] < 0:
                rec[3] = now
        if t is RoomFailed and "decode_ignores_room_failed" in self.hooks and req.status.get(dst) is _SUCCESS:
            # Planted bug: decode in Success drops a peer's failure notice unanswered (the old
            # core's behaviour): prefill ends Failed, decode Success, though the news arrived.
            self.trace.record("planted_ignore", dst, room=req.room, src=src)
            return False
        return True

    def could_settle(self, req: Request) -> bool:
        """The room is not settled and the protocol could still bring the two sides together.

        Once every rank is terminal, the sides can only meet through a failure notice; if a copy
        already reached the other side before now, the core had the news, so a disagreement
        that outlasts it is not the crash's doing.
        """
        if self.settled(req):
            return False
        nodes = self.room_nodes(req, "prefill") + self.room_nodes(req, "decode")
        if not all(_terminal(req.status.get(n)) for n in nodes):
            return True
        now = int(self.env._now)
        return not any(0 <= rec[3] < now for rec in req.notices.values())

    def settled(self, req: Request) -> bool:
        """Terminal on every rank of both sides, with the same outcome on both sides."""
        pre = [req.status.get(n) for n in self.room_nodes(req, "prefill")]
        dec = [req.status.get(n) for n in self.room_nodes(req, "decode")]
        if not all(_terminal(st) for st in pre + dec):
            return False
        return all(st is _SUCCESS for st in pre) == all(st is _SUCCESS for st in dec)

    # --------------------------------------------------------------------------- running
    def violate(self, invariant: str, detail: str, req: Request | None = None) -> None:
        self.findings.violations.append(
            Violation(invariant, detail, int(self.env._now), None if req is None else req.key)
        )
        self.trace.record("violation", "checker", invariant=invariant, detail=detail)

    def run(self) -> None:
        self.env.run(until=self.progress.deadline_ns)
        self.progress.phase = "liveness"
        check_liveness(self)
        # Quiescence: every room released and its memory back, or give up after the fence.
        limit = self.progress.deadline_ns + self.timeouts.fence_ns + self.timeouts.heartbeat_timeout_ns * 4
        step = max(self.timeouts.heartbeat_interval_ns, 1_000_000)
        while self.env.now < limit and not (
            all(r.done for r in self.rooms.requests) and not self._notices_pending()
        ):
            self.env.run(until=int(self.env._now) + step)
        self.progress.quiesced_ns = int(self.env._now)
        # Let in-flight transfers and messages drain (bounded: nothing new is started).
        self.env.run(until=int(self.env._now) + self.fabric.spec.nic.error_timeout_ns + step)
        check_final(self)

    def _notices_pending(self) -> bool:
        """A live prefill rank still resends a failure notice (RoomFailed, until every peer's
        FailedAck or the give-up): the peer may yet change its outcome, so the final checks wait.
        Asked of the engine itself: a renamed or removed table fails here, loudly."""
        for node, rank in self.ranks.items():
            if rank.dead or self.fleet.side_of[node] != "prefill":
                continue
            sender: SenderEngine = rank.engine
            if sender.notices:
                return True
        return False


_PREFIX_FLOWS = (Flow.DIRECT.value, Flow.PULL.value, Flow.PUSH.value, Flow.LAYERWISE.value)
_LAYERWISE = Flow.LAYERWISE.value


def _terminal(st: KVPoll | None) -> bool:
    return st is _FAILED or st is _SUCCESS
