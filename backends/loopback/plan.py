"""The soak's rooms, derived by both sides from one seed and the room's index (so a restarted
side needs no history), and the geometry, timeouts and staging memory both sides use.

A room's ``abort`` says who aborts it and when (as in the two-process e2e tests):
``decode_early`` (right after opening), ``decode_mid`` (once the first chunk landed),
``prefill_early`` (once WaitingForInput, before any chunk), ``prefill_mid`` (right after handing
over the first chunk). A ``hold`` room (the last rooms of a segment that ends with a kill) sends its
first chunk and waits: it is in flight when a side is killed, so it can only end Failed.

A ``layerwise`` room's forward is drawn too (``layer_ends``): prefill reports each chunk's layers
in that many calls, in order, one per step of its loop, as layers finish; a held layerwise room
stops before its chunk's last report (in flight mid-stream when a side is killed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.flows import FLOW_NAMES
from kvferry.core.geometry import Layout, ModelGeometry, PoolGeometry

ABORTS = ("decode_early", "decode_mid", "prefill_early", "prefill_mid")
# Aborts that can reach a room that already ended: decode opens a ``decode_early`` room and aborts
# it at once, but the room's TransferInfo leaves with the open, and a process descheduled between
# the two calls (a loaded host) can find every chunk already landed: prefill handed them all over
# before the TransferInfo came. The abort of a room that is Success is a no-op, as the protocol
# says. (Every other abort comes before the room's last chunk is handed over, so it always wins.)
LATE_ABORTS = ("decode_early",)
FLOWS = FLOW_NAMES
MODEL = ModelGeometry("soak", num_layers=2, num_kv_heads=4, head_dim=16)
PREFILL_PAGE, DECODE_PAGE = 4, 8  # different page sizes on the two sides
PREFILL_PAGES, DECODE_PAGES = 512, 256
AUX_ROWS = 64
WINDOW = 16  # rooms in flight per side
MAX_TOKENS = 48
MAX_TP = 4  # the model has 4 KV heads


def timeouts(deadline_scale: float = 1.0) -> Timeouts:
    """Short enough that a kill costs seconds, generous enough for a loaded 2-core machine (a
    missed heartbeat fails every room of the peer, which the soak reports as a violation).

    ``deadline_scale`` stretches the rooms' own deadlines (and the fence and tombstones after
    them) for a host too loaded to meet them; the heartbeat, which the fault schedule's durations
    are drawn around, stays as it is."""
    k = deadline_scale
    return Timeouts(
        bootstrap_ns=int(4 * SEC * k),
        waiting_ns=int(4 * SEC * k),
        transfer_ns=int(8 * SEC * k),
        heartbeat_interval_ns=200 * MS,
        heartbeat_timeout_ns=3 * SEC,
        fence_ns=int(17 * SEC * k),  # > bootstrap + waiting + transfer (Timeouts.problems)
        tombstone_ns=int(40 * SEC * k),
    )


MAX_DEADLINE_SCALE = 10.0


def prefill_pools(tp: int) -> list[PoolGeometry]:
    return [PoolGeometry(MODEL, tp, r, PREFILL_PAGE, PREFILL_PAGES, Layout.SGLANG_NHD) for r in range(tp)]


def decode_pools(tp: int) -> list[PoolGeometry]:
    return [PoolGeometry(MODEL, tp, r, DECODE_PAGE, DECODE_PAGES, Layout.SGLANG_NHD) for r in range(tp)]


def staging() -> StagingConfig:
    """Every staged pool registered (rooms pick their flow), small enough that the ring wraps: a
    chunk to one decode rank is at most 4 regions x 48 tokens x 4 heads x 32 B = 24 KiB."""
    return StagingConfig(
        worker_buffer_bytes=64 << 10,
        ring_bytes=128 << 10,
        pinned_bytes=128 << 10,
        prefill_pinned_bytes=128 << 10,
    )


@dataclass(frozen=True)
class SoakRoom:
    index: int
    room: int
    tid: str
    tokens: int
    cuts: tuple[int, ...]  # chunk ends, the last one == tokens
    flow: str
    abort: str | None
    hold: bool
    layer_ends: tuple[int, ...] = (MODEL.num_layers,)  # a layerwise chunk's reports: [0, e0), [e0, e1), ...


def room_plan(seed: int, index: int, flows: tuple[str, ...], abort_rate: float, hold: bool) -> SoakRoom:
    """Room ``index`` of the run: its own random stream (seed, index), so any side at any time
    derives the same room without replaying the ones before it."""
    rng = random.Random(f"kvferry-soak:{seed}:{index}")
    room = rng.getrandbits(63)  # 10**4 rooms of 2**63: a collision is not a concern
    tokens = rng.randint(2, MAX_TOKENS)
    k = rng.randint(1, 3)
    cuts = tuple(sorted({rng.randint(1, tokens - 1) for _ in range(k - 1)} | {tokens}))
    flow = flows[index % len(flows)] if rng.random() < 0.5 else rng.choice(flows)
    abort = rng.choice(ABORTS) if rng.random() < abort_rate else None
    if hold:
        abort = None
    if (hold or abort in ("decode_mid", "prefill_mid")) and len(cuts) < 2:
        cuts = (tokens // 2, tokens)
    # Drawn last, for every flow: the draws above (and so every room of an older run) stay as they were.
    layers = MODEL.num_layers
    ends = (*(e for e in range(1, layers) if rng.random() < 0.75), layers)
    return SoakRoom(index, room, f"soak{seed}-{index}", tokens, cuts, flow, abort, hold, ends)


def segment_rooms(
    seed: int, start: int, end: int, hold_from: int, flows: tuple[str, ...], abort_rate: float
) -> list[SoakRoom]:
    """Rooms ``[start, end)``; those from ``hold_from`` on hold (``hold_from >= end``: none)."""
    return [room_plan(seed, i, flows, abort_rate, hold=i >= hold_from) for i in range(start, end)]
