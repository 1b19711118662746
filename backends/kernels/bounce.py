"""Pinned-memory gather/scatter through the copy engine: kernel on GPU scratch + async memcpy.

Zero-copy kernel stores to pinned memory reach about 95% of a pinned D2H memcpy on an H100
(docs/benchmarks.md), whatever the tile shape: the copy engine writes PCIe more efficiently than
SM stores do. This path keeps the copy engine on the PCIe leg. The staging buffer is cut into
chunks that are each one contiguous byte range (a head's planes for the head-major layout, a plane
group for the plane-major one); the kernel gathers chunk i into a GPU scratch slot on the caller's
stream while the copy stream moves chunk i-1 to pinned memory, so only the first chunk's gather
(or the last chunk's scatter) is not hidden behind the memcpy. Scratch: ``slots`` chunks of about
``chunk_bytes`` each, from torch's caching allocator.

Only dense layouts covering all their tokens qualify (``plan_chunks`` returns None otherwise); the
caller then uses the zero-copy kernel.
"""

from __future__ import annotations

import torch
from kvferry.backends.kernels.layout import StagingLayout

CHUNK_BYTES = 64 << 20
SLOTS = 3
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
# Calls and chunks that took this path (tests and the benchmark check it really ran).
STATS = {"runs": 0, "chunks": 0}


def plan_chunks(
    layout: StagingLayout, n_tokens: int, row_bytes: int, chunk_bytes: int
) -> list[tuple[int, int, int, int]] | None:
    """``(head_lo, heads, plane_lo, planes)`` chunks whose staging bytes are contiguous, in
    staging order; None when the layout has gaps or the call covers part of its tokens."""
    lay, d = layout, layout.head_dim
    if n_tokens != lay.num_tokens:
        return None
    t, nh, npl = lay.num_tokens, lay.num_heads, lay.num_planes
    head_major = (lay.stride_token, lay.stride_plane, lay.stride_head) == (d, t * d, npl * t * d)
    plane_major = (lay.stride_head, lay.stride_token, lay.stride_plane) == (d, nh * d, t * nh * d)
    if head_major:
        per_plane = t * row_bytes
        step = max(1, min(npl, chunk_bytes // per_plane))
        return [(h, 1, p, min(step, npl - p)) for h in range(nh) for p in range(0, npl, step)]
    if plane_major:
        per_plane = t * nh * row_bytes
        step = max(1, min(npl, chunk_bytes // per_plane))
        return [(0, nh, p, min(step, npl - p)) for p in range(0, npl, step)]
    return None


def chunk_layout(layout: StagingLayout, heads: int, planes: int) -> StagingLayout:
    """The compact layout of one chunk in scratch, in the parent's dimension order."""
    t, d = layout.num_tokens, layout.head_dim
    if layout.stride_head == d and heads == layout.num_heads:  # plane-major parent
        return StagingLayout.plane_major(heads, planes, t, d)
    return StagingLayout.head_major(heads, planes, t, d)


def run(
    kind: str,
    launch_chunk,
    staging_flat: torch.Tensor,
    layout: StagingLayout,
    chunks: list[tuple[int, int, int, int]],
    device: torch.device,
    stream: torch.cuda.Stream,
    slots: int = SLOTS,
) -> torch.cuda.Event:
    """Pipeline the chunks; ``launch_chunk(chunk, scratch, scratch_layout)`` runs the kernel on the
    current stream. ``staging_flat`` is the pinned buffer as a flat tensor of elements. Returns an
    event recorded once every copy and kernel is done (the caller's stream also waits for it)."""
    copy_stream = _COPY_STREAMS.get(device)
    if copy_stream is None:
        copy_stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    sizes = [h * p * layout.num_tokens * layout.head_dim for _, h, _, p in chunks]
    scratch = [
        torch.empty(max(sizes), dtype=staging_flat.dtype, device=device)
        for _ in range(min(slots, len(chunks)))
    ]
    free = [None] * len(scratch)  # event after which slot k may be overwritten
    done = torch.cuda.Event()
    STATS["runs"] += 1
    STATS["chunks"] += len(chunks)
    for i, (h0, nh, p0, npl) in enumerate(chunks):
        k = i % len(scratch)
        n = sizes[i]
        buf = scratch[k][:n]
        sub = chunk_layout(layout, nh, npl)
        e0 = layout.base + h0 * layout.stride_head + p0 * layout.stride_plane
        host = staging_flat[e0 : e0 + n]
        step = _gather_chunk if kind == "gather" else _scatter_chunk
        free[k] = step(launch_chunk, (h0, nh, p0, npl), buf, sub, host, free[k], stream, copy_stream)
    # Scratch was allocated on the current stream but used on both: keep it from reuse until done.
    for s in scratch:
        s.record_stream(copy_stream)
        s.record_stream(stream)
    if kind == "gather":
        done.record(copy_stream)
        stream.wait_event(done)
    else:
        done.record(stream)
    return done


def _gather_chunk(launch_chunk, chunk, buf, sub, host, slot_free, stream, copy_stream) -> torch.cuda.Event:
    """Kernel into scratch on ``stream``, then scratch to pinned host on ``copy_stream``; returns
    the event after which the scratch slot may be overwritten."""
    if slot_free is not None:
        stream.wait_event(slot_free)
    with torch.cuda.stream(stream):
        launch_chunk(chunk, buf, sub)
        ready = torch.cuda.Event()
        ready.record(stream)
    copy_stream.wait_event(ready)
    with torch.cuda.stream(copy_stream):
        host.copy_(buf, non_blocking=True)
        freed = torch.cuda.Event()
        freed.record(copy_stream)
    return freed


def _scatter_chunk(launch_chunk, chunk, buf, sub, host, slot_free, stream, copy_stream) -> torch.cuda.Event:
    """Pinned host to scratch on ``copy_stream``, then the kernel out of scratch on ``stream``;
    returns the event after which the scratch slot may be overwritten."""
    if slot_free is not None:
        copy_stream.wait_event(slot_free)
    with torch.cuda.stream(copy_stream):
        buf.copy_(host, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(copy_stream)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        launch_chunk(chunk, buf, sub)
        freed = torch.cuda.Event()
        freed.record(stream)
    return freed
