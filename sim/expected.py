"""The expected time of a scenario's largest room on its fabric, and the deadlines derived from it.

A fault-free room must not time out, so a deadline left out of a scenario is derived from what
the room costs on the simulated fabric (backends/simfabric: posting is ``post_cost + per_desc x
descriptors`` serialised per NIC, bytes share the NIC bandwidth, staged flows add a gather and a
scatter kernel). The estimate is the largest room alone on the fabric, its pages in any order
(descriptors merge at most within a page: a fragmented pool merges little), posting, wire,
kernels and compute added up rather than overlapped: an upper bound of what one room costs
(tests/test_presets.py checks it against runs) and a lower bound of what a deadline must allow.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.core.geometry import PoolGeometry, links
from kvferry.sim.scenario_schema import (
    REORDER_MAX_NS,
    US,
    WRITE_SLACK_NS,
    Scenario,
    TimeoutSpec,
    pools,
    staging_sizes,
)
from msgspec.structs import replace

__all__ = [
    "SAFETY",
    "RoomEstimate",
    "derive",
    "estimate",
    "flows_used",
    "max_msg_ns",
    "max_write_ns",
    "rooms_together",
    "valid_deadlines",
    "worst",
]

MS = 1_000_000
# A derived deadline allows this many times the largest room's expected time: room for rooms
# queued ahead of it on the same NIC and for the control round trips around the writes.
SAFETY = 4


@dataclass(frozen=True, slots=True)
class RoomEstimate:
    flow: str
    tokens: int
    chunks: int
    descriptors: int  # posted by the busiest prefill rank, every descriptor charged
    post_ns: int  # the busiest prefill rank's posting
    kernel_ns: int  # gather (prefill) + scatter (decode) on the busiest ranks, staged flows
    wire_bytes: int  # through the busiest NIC
    wire_ns: int
    compute_ns: int  # prefill's compute of the room before its last chunk can go
    total_ns: int

    def describe(self) -> str:
        parts = [
            f"{self.flow} flow, {self.tokens} tokens in {self.chunks} chunk(s)",
            f"posting {self.descriptors:,} descriptors {self.post_ns / MS:.1f} ms",
            f"wire {self.wire_bytes / 1e6:.1f} MB {self.wire_ns / MS:.1f} ms",
        ]
        if self.kernel_ns:
            parts.append(f"kernels {self.kernel_ns / MS:.1f} ms")
        if self.compute_ns:
            parts.append(f"compute {self.compute_ns / MS:.1f} ms")
        return ", ".join(parts)


def flows_used(s: Scenario) -> tuple[str, ...]:
    """The flows a run of ``s`` can move rooms with (the policy's choice included)."""
    f = staging_sizes(s)
    ring = bool(f.ring_bytes and f.worker_buffer_bytes)
    pinned = bool(f.pinned_bytes and f.prefill_pinned_bytes)
    if f.flow in ("direct", "ring", "pinned", "layerwise"):
        out = [f.flow]
    elif f.flow in ("pull", "push"):  # the planner's descriptors, as direct posts them
        out = ["direct"]
    elif f.flow == "mixed":
        out = ["direct"] + ["ring"] * ring + ["pinned"] * pinned
    else:  # the policy: direct for equal TP, else ring if offered, else pinned, else direct
        t = s.topology
        if t.prefill_tp == t.decode_tp:
            out = ["direct"]
        else:
            out = ["ring"] if ring else ["pinned"] if pinned else ["direct"]
    if f.fallback_direct and "direct" not in out:
        out.append("direct")
    return tuple(out)


def _chunks(s: Scenario) -> tuple[int, ...]:
    """The chunk lengths of the largest room the scenario can draw or lists."""
    w = s.workload
    rooms = [r.chunks or _split(r.tokens, w.chunk_tokens) for r in w.explicit]
    if w.rooms > len(w.explicit):
        rooms.append(_split(w.tokens_max, w.chunk_tokens))
    return max(rooms, key=sum, default=(0,))


def _split(tokens: int, chunk: int) -> tuple[int, ...]:
    if chunk <= 0 or chunk >= tokens:
        return (tokens,)
    return (chunk,) * (tokens // chunk) + ((tokens % chunk,) if tokens % chunk else ())


def _direct_descriptors(
    s: Scenario, chunks: tuple[int, ...], heads: int, src: PoolGeometry, dst: PoolGeometry, head_major: bool
) -> int:
    """Descriptors of one rank pair's direct writes of a room, for pages in any order.

    One piece per token (per token and head on a head-major side). Where a piece is a whole token
    row on both sides, prepared lists merge the pieces of a page into one descriptor; a run also
    breaks at every page boundary of either side (pages need not be adjacent).
    """
    regions = src.model.num_regions
    if head_major:
        return sum(chunks) * regions * heads
    whole_rows = heads == src.heads_per_rank == dst.heads_per_rank
    if not (whole_rows and s.fabric.prepped):
        return sum(chunks) * regions
    runs = sum(c // src.page_size + c // dst.page_size + 2 for c in chunks)
    return min(sum(chunks), runs) * regions


def _writes_per_chunk(flow: str, num_layers: int) -> int:
    """WRITEs one rank pair posts per chunk: layer-wise posts every layer on its own (the engine
    reports them one by one; core/flows/layerwise.py), the others one per chunk."""
    return num_layers if flow == "layerwise" else 1


def estimate(s: Scenario, flow: str) -> RoomEstimate:
    """The largest room of ``s`` alone on its fabric, moved by ``flow``."""
    pre, dec = pools(s)
    model = pre[0].model
    nic, kern = s.fabric.nic, s.fabric.kernel
    chunks = _chunks(s)
    tokens = sum(chunks)
    regions = model.num_regions
    head_major = pre[0].layout.head_major_in_page or dec[0].layout.head_major_in_page
    post = [0] * len(pre)
    descs = [0] * len(pre)
    out_bytes = [0] * len(pre)
    in_bytes = [0] * len(dec)
    for link in links(model, len(pre), len(dec)):
        if link.is_dummy:
            continue
        p, d = link.prefill_rank, link.decode_rank
        nbytes = tokens * regions * link.num_heads * model.head_bytes
        out_bytes[p] += nbytes
        in_bytes[d] += nbytes
        if flow in ("direct", "layerwise"):  # a layer's slice of a plan: that layer's descriptors
            n = _direct_descriptors(s, chunks, link.num_heads, pre[p], dec[d], head_major)
        else:  # staged: one block per writer and chunk
            n = len(chunks)
        descs[p] += n + 1  # + the aux row
        post[p] += (_writes_per_chunk(flow, model.num_layers) * len(chunks) + 1) * nic.post_cost_ns
        post[p] += (n + 1) * nic.per_desc_ns
    kernel_ns = 0
    if flow in ("ring", "pinned"):
        pinned = flow == "pinned"
        launches = 2 * len(chunks) * kern.launch_ns  # a gather and a scatter per chunk
        kernel_ns = launches + kern.cost_ns(max(out_bytes), pinned) + kern.cost_ns(max(in_bytes), pinned)
        kernel_ns -= 2 * kern.launch_ns  # cost_ns charged one launch each, counted above
    busiest = max(range(len(pre)), key=lambda p: post[p])
    wire_bytes = max(max(out_bytes), max(in_bytes))
    wire_ns = wire_bytes * 1_000_000_000 // nic.bandwidth_bps
    w = s.workload
    compute_ns = w.compute_ns_per_token * tokens + 50 * US  # + the drawn prefill delay, < 50 us
    latency = 2 * (nic.latency_ns + nic.jitter_ns) + 4 * (
        s.fabric.control.latency_ns + s.fabric.control.jitter_ns
    )
    total = post[busiest] + kernel_ns + wire_ns + compute_ns + latency
    return RoomEstimate(
        flow,
        tokens,
        len(chunks),
        descs[busiest],
        post[busiest],
        kernel_ns,
        wire_bytes,
        wire_ns,
        compute_ns,
        total,
    )


def worst(s: Scenario) -> RoomEstimate:
    """The slowest of the flows ``s`` can use."""
    return max((estimate(s, f) for f in flows_used(s)), key=lambda e: e.total_ns)


def rooms_together(s: Scenario) -> int:
    """The most rooms in flight at once: every room the workload has, up to one per aux row."""
    return max(1, min(s.workload.rooms, s.topology.aux_rows))


def max_msg_ns(s: Scenario) -> int:
    """The longest a control message (a failure notice among them) may take to arrive."""
    c = s.fabric.control
    return c.latency_ns + c.jitter_ns + s.faults.ctrl_delay_max_us * US + REORDER_MAX_NS


def max_write_ns(s: Scenario, est: RoomEstimate) -> int:
    """The longest a WRITE may take from its post to landing or failing (``Timeouts.problems``'
    ``max_write_ns``: the fence must outlive it).

    A NIC posts one transfer at a time (backends/simfabric), so a write waits behind everything
    posted on that NIC before it: at most the posting and the bytes of every room in flight with
    it, each no more than the largest (``est``). A flow that posts more WRITEs per chunk queues
    deeper: layer-wise posts each layer of a chunk on its own, so its queue is ``num_layers``
    times direct's, and a write posted before decode failed the room may land long after it.
    """
    backlog = rooms_together(s) * (est.post_ns + est.wire_ns)
    return s.fabric.nic.error_timeout_ns + WRITE_SLACK_NS + backlog


def _ceil_ms(ns: int) -> int:
    return -(-ns // MS) * MS


def derive(s: Scenario, given_timeouts: frozenset[str], given_phases: frozenset[str]) -> Scenario:
    """``s`` with every deadline it does not set (names not in ``given_*``) long enough for its
    largest room: unchanged where the defaults already allow ``SAFETY`` times that room."""
    est = worst(s)
    need = _ceil_ms(SAFETY * est.total_ns)
    vals = {n: getattr(s.timeouts, n) for n in TimeoutSpec.__slots__}
    changed = False
    for n in ("waiting_ns", "transfer_ns"):
        if n not in given_timeouts and vals[n] < need:
            vals[n] = need
            changed = True
    max_msg = max_msg_ns(s)
    life = max_msg + vals["bootstrap_ns"] + vals["waiting_ns"] + vals["transfer_ns"] + max_write_ns(s, est)
    # Only where the core's rules (Timeouts.problems) need it: a fence outliving the writer.
    if "fence_ns" not in given_timeouts and vals["fence_ns"] <= life:
        vals["fence_ns"] = _ceil_ms(life + life // 4)
        changed = True
    if "tombstone_ns" not in given_timeouts and vals["tombstone_ns"] <= max_msg + vals["fence_ns"]:
        vals["tombstone_ns"] = _ceil_ms(max_msg + vals["fence_ns"] + 50 * MS)
        changed = True
    if not changed:
        return s
    phases = s.phases
    if "liveness_us" not in given_phases:
        # After the last arrival the backlog (at most the rooms admitted together) must drain.
        backlog = rooms_together(s) * est.total_ns
        live_ns = max(phases.liveness_us * US, vals["waiting_ns"] + vals["transfer_ns"] + backlog)
        phases = replace(phases, liveness_us=_ceil_ms(live_ns) // US)
    return replace(s, timeouts=TimeoutSpec(**vals), phases=phases)


def valid_deadlines(s: Scenario) -> Scenario:
    """``s`` with every deadline the scenario reader would refuse derived, the others as they are:
    a fence (and its tombstone) the peers' writes may outlive, a waiting or transfer deadline
    shorter than the largest room. What a campaign draws then replays from its saved file."""
    est = worst(s)
    short = {n for n in ("waiting_ns", "transfer_ns") if getattr(s.timeouts, n) <= est.total_ns}
    keep = frozenset(TimeoutSpec.__slots__) - short - {"fence_ns", "tombstone_ns"}
    return derive(s, keep, frozenset() if short else frozenset({"liveness_us"}))
