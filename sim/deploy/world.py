"""A deployment run: the simulator's World (real core engines, real flows, the simulated fabric,
the invariant checker) with a prefill GPU, a decode batch loop and requests that arrive over time.

- Prefill: chunked prefill. Chunks wait first come first served (a request's next chunk queues
  behind chunks that arrived meanwhile); each forward step takes queued chunks, of any requests,
  up to the chunk size in tokens (SGLang's chunked_prefill_size is both), and costs the roofline
  of the batch (weights read once). Prefix hits are not computed, still transferred. A chunk's
  KV goes to decode as soon as its step ends.
- Decode: a request joins the batch once its room is Success on every decode rank; each step's
  time is the roofline over the batch and its context; decode keeps the request's pages until
  its last token.
- TTFT: arrival to the end of the request's first decode step (the first token the client gets
  from decode); TPOT: the mean gap between its later tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import simpy
from kvferry.sim import scenario as sc
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.deploy.timing import TimingFabric
from kvferry.sim.deploy.workload import Arrivals, DeployRequest
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
        self, spec: DeploySpec, scenario: sc.Scenario, arrivals: Arrivals, lengths: tuple[DeployRequest, ...]
    ) -> None:
        super().__init__(replace(scenario, workload=replace(scenario.workload, rooms=0)), seed=spec.seed)
        assert isinstance(self.fabric, TimingFabric)
        self.fabric.xfer_log = []
        self.spec = spec
        self.roof_p = spec.roofline("prefill")
        self.roof_d = spec.roofline("decode")
        self._pjobs: deque[tuple[int, int, simpy.Event]] = deque()  # (new tokens, cached, done)
        self._pwake = self.env.event()
        self.tracks: dict[int, Track] = {}  # by request key
        self.finished = 0
        self.total = arrivals.count
        self.all_done = self.env.event()
        self._lengths = list(lengths)
        self._next = 0
        self._waiting: deque[int] = deque()  # keys whose KV is in, not yet in the batch
        self._wake = self.env.event()
        self._hold_dec: set[int] = set()  # keys whose decode pages wait for the last token
        self._closed = arrivals.concurrency > 0
        if self._closed:
            for _ in range(min(arrivals.concurrency, self.total)):
                self._submit(0)
        else:
            for r in arrivals.requests:
                self._submit(r.arrival_ns, r)
        self.env.process(self._decode_loop())
        self.env.process(self._prefill_loop())
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

    def _finish(self, key: int, failed: bool) -> None:
        t = self.tracks[key]
        t.failed = failed
        t.done_ns = int(self.env.now)
        self.finished += 1
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
            self._pjobs.append((new, new_start, done))
            if not self._pwake.triggered:
                self._pwake.succeed()
            yield done
        else:
            yield self.env.timeout(1)  # a cached chunk: nothing to compute
        self.tracks[req.key].chunk_ready_ns.append(int(self.env.now))

    def _prefill_loop(self):  # type: ignore[no-untyped-def]
        budget = self.spec.chunk_tokens
        while True:
            if not self._pjobs:
                self._pwake = self.env.event()
                yield self._pwake
                continue
            batch = [self._pjobs.popleft()]
            used = batch[0][0]
            while self._pjobs and used + self._pjobs[0][0] <= budget:
                used += self._pjobs[0][0]
                batch.append(self._pjobs.popleft())
            yield self.env.timeout(self.roof_p.prefill_batch_ns([(t, ctx) for t, ctx, _ in batch]))
            for _, _, done in batch:
                done.succeed()

    # ------------------------------------------------------------------ decode
    def _check_side(self, req: Request, side: str) -> None:
        had = req.outcome
        super()._check_side(req, side)
        if side != "decode" or had or not req.outcome:
            return
        t = self.tracks[req.key]
        if req.outcome == "success":
            t.kv_done_ns = int(self.env.now)
            self._hold_dec.add(req.key)
            self._waiting.append(req.key)
            if not self._wake.triggered:
                self._wake.succeed()
        else:
            self._finish(req.key, failed=True)

    def _free_dec_pages(self, req: Request) -> None:
        if req.key in self._hold_dec:
            return  # decode still needs them: freed after the last token
        super()._free_dec_pages(req)

    def _decode_loop(self):  # type: ignore[no-untyped-def]
        env, tracks = self.env, self.tracks
        batch: list[Track] = []
        keys: list[int] = []
        ctx = 0  # tokens the batch attends to: kept as a running sum (a step is the hot loop)
        while True:
            while self._waiting and len(batch) < self.spec.max_batch:
                k = self._waiting.popleft()
                t = tracks[k]
                batch.append(t)
                keys.append(k)
                ctx += t.req.input_tokens + t.tokens
            if not batch:
                self._wake = env.event()
                yield self._wake
                continue
            yield env.timeout(self.roof_d.decode_ns(len(batch), ctx))
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
                self._hold_dec.discard(k)
                req = self.requests[k]
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
