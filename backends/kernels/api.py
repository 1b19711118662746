"""Gather head slices of a paged KV pool into a staging buffer, and scatter them back.

``gather`` copies heads ``[head_start, head_start + layout.num_heads)`` of every plane of a pool,
for the tokens ``[token_start, token_end)`` of a request, into a staging buffer laid out by a
``StagingLayout``; ``scatter`` is the reverse. The staging buffer may live on the pool's GPU or in
pinned host memory: the kernel then reads or writes it over PCIe itself (``pinned_path=
"zero_copy"``, no GPU memory used) or through GPU scratch chunks and the copy engine
(``"copy_engine"``, faster, 3 x 64 MiB of scratch; see ``bounce``). Both run on a given CUDA stream
and return a CUDA event recorded after the work, so callers poll ``event.query()`` or make another
stream wait on it; nothing here synchronizes the device.

Every argument is validated before a launch (typed errors, counted on the pool's ``stats``):
page ids the host can see must lie inside the pool, and the kernel itself masks any page id
outside it, so no call reads or writes outside the pool or past the staging buffer's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from kvferry.backends.kernels import torch_fallback
from kvferry.backends.kernels.errors import DTypeWidthError, KernelArgError, KernelBackendUnavailable
from kvferry.backends.kernels.layout import StagingLayout

Backend = Literal["auto", "triton", "torch"]
# How a kernel reaches pinned staging: SM loads/stores over PCIe, or GPU scratch + copy engine.
PinnedPath = Literal["zero_copy", "copy_engine"]

# Integer type of each element width: the byte-exact view of any dtype of that width.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Widest word the kernels move; 4-byte words let Triton emit 16-byte vector accesses.
_MAX_WORD = 4


def _lowbit(x: int) -> int:
    return x & -x if x else 1 << 62


@dataclass
class KernelStats:
    """Per-pool counters: calls by backend, and calls rejected for bad arguments."""

    gathers: int = 0
    scatters: int = 0
    triton_launches: int = 0
    torch_runs: int = 0
    rejected: int = 0


class KVPool:
    """One rank's paged KV pool: ``planes[i]`` is ``[num_slots, num_heads, head_dim]``.

    Plane order is ``K0, V0, K1, V1, ...`` for MHA/GQA (``from_layers``) and one latent plane per
    layer for MLA. Slot ``page * page_size + i`` holds token ``i`` of page ``page``.
    """

    def __init__(self, planes: Sequence[torch.Tensor], page_size: int) -> None:
        if not planes:
            raise KernelArgError("a pool needs at least one plane")
        first = planes[0]
        for i, p in enumerate(planes):
            if p.dim() != 3:
                raise KernelArgError(
                    f"plane {i} must be [slots, heads, head_dim], got shape {tuple(p.shape)}"
                )
            if p.shape != first.shape or p.dtype != first.dtype or p.device != first.device:
                raise KernelArgError(
                    f"plane {i} is {tuple(p.shape)} {p.dtype} on {p.device}; plane 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}"
                )
            if not p.is_contiguous():
                raise KernelArgError(f"plane {i} is not contiguous")
        if page_size < 1 or first.shape[0] % page_size:
            raise KernelArgError(f"{first.shape[0]} slots do not split into pages of {page_size}")
        self.planes = tuple(planes)
        self.page_size = page_size
        self.num_slots, self.num_heads, self.head_dim = (int(d) for d in first.shape)
        self.num_pages = self.num_slots // page_size
        self.dtype = first.dtype
        self.itemsize = first.element_size()
        self.device = first.device
        addrs = [p.data_ptr() for p in planes]
        self.addr_align = min(min(_lowbit(a) for a in addrs), 16)
        # The pointer table the kernels read plane bases from, built once per pool.
        self.table = torch.tensor(addrs, dtype=torch.int64, device=self.device)
        self.stats = KernelStats()

    @classmethod
    def from_layers(
        cls, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor], page_size: int
    ) -> KVPool:
        """SGLang MHA layout: per layer a K and a V buffer."""
        if len(k_layers) != len(v_layers):
            raise KernelArgError(f"{len(k_layers)} K layers but {len(v_layers)} V layers")
        return cls([t for kv in zip(k_layers, v_layers, strict=True) for t in kv], page_size)

    @property
    def num_planes(self) -> int:
        return len(self.planes)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_usable(device: torch.device) -> bool:
    """Triton can run here: a CUDA device, or the CPU interpreter (TRITON_INTERPRET=1)."""
    if not _triton_importable():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class _Call:
    """A validated call, in the units each backend needs."""

    n_tokens: int
    token_start: int  # relative to pages_dev[0]
    pages_dev: torch.Tensor
    page_size: int
    num_pages: int
    head_start: int
    layout: StagingLayout
    staging: torch.Tensor


def _check_pages_host(pages: np.ndarray, p0: int, p1: int, num_pages: int, unique: bool) -> np.ndarray:
    if pages.ndim != 1 or not np.issubdtype(pages.dtype, np.integer):
        raise KernelArgError(f"page ids must be a 1-D integer array, got {pages.dtype} {pages.shape}")
    if len(pages) < p1:
        raise KernelArgError(f"{len(pages)} page ids do not cover page {p1 - 1} the token range needs")
    sub = pages[p0:p1].astype(np.int64, copy=False)
    bad = (sub < 0) | (sub >= num_pages)
    if bad.any():
        raise KernelArgError(f"page id {int(sub[bad][0])} outside the pool's {num_pages} pages")
    if unique and len(sub) > 1:
        # A sort and a neighbour compare: np.unique's hashing cost ~0.5 ms on a 4096-slot map,
        # on the thread that posts the scatter (the hop timeline showed it).
        ordered = np.sort(sub)
        if (ordered[1:] == ordered[:-1]).any():
            raise KernelArgError("duplicate page ids: two tokens would be scattered into one slot")
    return sub


def _validate(
    kind: str,
    pool: KVPool,
    staging: torch.Tensor,
    layout: StagingLayout,
    pages: np.ndarray | torch.Tensor,
    token_start: int,
    token_end: int,
    head_start: int,
    staging_token_offset: int,
    page_size: int,
) -> _Call:
    _check_staging(pool, staging)
    _check_layout(pool, staging, layout, head_start)
    n_tokens = token_end - token_start
    if token_start < 0 or n_tokens < 1:
        raise KernelArgError(f"empty or negative token range [{token_start}, {token_end})")
    if staging_token_offset < 0 or staging_token_offset + n_tokens > layout.num_tokens:
        raise KernelArgError(
            f"{n_tokens} tokens at staging offset {staging_token_offset} overflow the layout's "
            f"{layout.num_tokens} tokens"
        )
    num_pages = pool.num_slots // page_size
    pages_dev, rel_start = _device_pages(kind, pool, pages, token_start, token_end, page_size)
    # Staging token offset folds into the layout's base: the kernels see chunk-relative tokens.
    if staging_token_offset:
        layout = dataclasses.replace(layout, base=layout.base + staging_token_offset * layout.stride_token)
    return _Call(n_tokens, rel_start, pages_dev, page_size, num_pages, head_start, layout, staging)


def _check_staging(pool: KVPool, staging: torch.Tensor) -> None:
    """The staging buffer's width, device and contiguity against the pool's."""
    if staging.element_size() != pool.itemsize:
        raise DTypeWidthError(
            f"staging elements are {staging.element_size()} bytes ({staging.dtype}) but pool elements "
            f"are {pool.itemsize} bytes ({pool.dtype}); view the staging buffer with the pool's width"
        )
    if pool.device.type == "cuda":
        on_gpu = staging.device == pool.device
        pinned = staging.device.type == "cpu" and staging.is_pinned()
        if not (on_gpu or pinned):
            raise KernelArgError(
                f"staging on {staging.device} must be on {pool.device} or in pinned host memory"
            )
    elif staging.device != pool.device:
        raise KernelArgError(f"staging on {staging.device} but pool on {pool.device}")
    if not staging.is_contiguous():
        raise KernelArgError("staging buffer must be contiguous (the layout addresses its flat elements)")


def _check_layout(pool: KVPool, staging: torch.Tensor, layout: StagingLayout, head_start: int) -> None:
    """The layout's shape fits the pool, is dense, fits the staging buffer, and its heads the pool's."""
    if layout.num_planes != pool.num_planes:
        raise KernelArgError(f"layout has {layout.num_planes} planes, pool has {pool.num_planes}")
    if layout.head_dim != pool.head_dim:
        raise KernelArgError(f"layout head_dim {layout.head_dim} != pool head_dim {pool.head_dim}")
    if not layout.is_dense():
        raise KernelArgError(f"layout rows overlap: {layout}")
    if layout.extent > staging.numel():
        raise KernelArgError(f"layout needs {layout.extent} elements, staging has {staging.numel()}")
    if head_start < 0 or head_start + layout.num_heads > pool.num_heads:
        raise KernelArgError(
            f"heads [{head_start}, {head_start + layout.num_heads}) outside the pool's {pool.num_heads}"
        )


def _device_pages(
    kind: str,
    pool: KVPool,
    pages: np.ndarray | torch.Tensor,
    token_start: int,
    token_end: int,
    ps: int,
) -> tuple[torch.Tensor, int]:
    """The page ids on the pool's device and the first token's offset within them; host ids are
    checked (in range; unique for a scatter) on the way."""
    num_pages = pool.num_slots // ps
    p0, p1 = token_start // ps, -(-token_end // ps)
    if isinstance(pages, np.ndarray) or (isinstance(pages, torch.Tensor) and pages.device.type == "cpu"):
        host = pages if isinstance(pages, np.ndarray) else pages.numpy()
        sub = _check_pages_host(host, p0, p1, num_pages, unique=kind == "scatter")
        # A copy: the planner hands out read-only arrays, and torch wants writable memory.
        pages_dev = torch.from_numpy(np.array(sub, dtype=np.int64)).to(pool.device, non_blocking=True)
        return pages_dev, token_start - p0 * ps
    if isinstance(pages, torch.Tensor):
        # Device page ids stay unchecked on the host (that would synchronize); the kernel masks
        # any id outside the pool.
        if pages.device != pool.device or pages.dim() != 1 or pages.dtype not in (torch.int32, torch.int64):
            raise KernelArgError(f"device page ids must be 1-D int32/int64 on {pool.device}")
        if pages.numel() < p1:
            raise KernelArgError(f"{pages.numel()} page ids do not cover page {p1 - 1}")
        return pages, token_start
    raise KernelArgError(f"page ids must be a numpy array or a torch tensor, got {type(pages).__name__}")


def _word_bytes(pool: KVPool, staging: torch.Tensor, lay: StagingLayout) -> int:
    """Widest word (up to 4 bytes) that every row start and row length is a multiple of."""
    isz, word = pool.itemsize, _MAX_WORD
    for nbytes in (
        pool.head_dim * isz,
        pool.addr_align,
        staging.data_ptr(),
        lay.base * isz,
        lay.stride_head * isz,
        lay.stride_plane * isz,
        lay.stride_token * isz,
    ):
        word = min(word, _lowbit(nbytes))
    return max(word, 1)


def _run_triton(
    kind: str,
    pool: KVPool,
    c: _Call,
    *,
    planes: tuple[int, int] | None = None,
    head_start: int | None = None,
    layout: StagingLayout | None = None,
    staging: torch.Tensor | None = None,
    compile_only: bool = False,
) -> None:
    """One launch; the keywords narrow it to planes ``[p0, p0 + n)`` and another staging target
    (the copy-engine path's chunks)."""
    from kvferry.backends.kernels import triton_gather_scatter as tk

    lay = layout or c.layout
    staging = c.staging if staging is None else staging
    p0, n_planes = planes or (0, pool.num_planes)
    isz = pool.itemsize
    wb = _word_bytes(pool, staging, lay)
    flat = staging.reshape(-1).view(torch.uint8)[: lay.extent * isz].view(_INT_OF_WIDTH[wb])

    # All sizes in words: every one is a whole number of words by the choice of word size.
    def w(n_elems: int) -> int:
        return n_elems * isz // wb

    tk.launch(
        kind,
        pool.table if planes is None else pool.table[p0 : p0 + n_planes],
        c.pages_dev,
        flat,
        num_planes=n_planes,
        n_tokens=c.n_tokens,
        token_start=c.token_start,
        page_size=c.page_size,
        num_pages=c.num_pages,
        slot_stride=w(pool.num_heads * pool.head_dim),
        pool_head0=c.head_start if head_start is None else head_start,
        num_heads=lay.num_heads,
        row_words=w(pool.head_dim),
        s_base=w(lay.base),
        s_head=w(lay.stride_head),
        s_plane=w(lay.stride_plane),
        s_tok=w(lay.stride_token),
        pool_align=pool.addr_align,
        compile_only=compile_only,
    )


def _run_copy_engine(kind: str, pool: KVPool, c: _Call, stream: torch.cuda.Stream) -> torch.cuda.Event | None:
    """Pinned staging through GPU scratch and the copy engine; None if the layout cannot be cut
    into contiguous chunks (the caller then runs the zero-copy kernel)."""
    from kvferry.backends.kernels import bounce

    chunks = bounce.plan_chunks(c.layout, c.n_tokens, pool.head_dim * pool.itemsize, bounce.CHUNK_BYTES)
    if chunks is None:
        return None

    def launch_chunk(chunk: tuple[int, int, int, int], scratch: torch.Tensor, sub: StagingLayout) -> None:
        h0, _, p0, npl = chunk
        _run_triton(
            kind, pool, c, planes=(p0, npl), head_start=c.head_start + h0, layout=sub, staging=scratch
        )

    return bounce.run(kind, launch_chunk, c.staging.reshape(-1), c.layout, chunks, pool.device, stream)


def _run_torch(kind: str, pool: KVPool, c: _Call) -> None:
    ps, int_t = c.page_size, _INT_OF_WIDTH[pool.itemsize]
    t = torch.arange(c.n_tokens, device=pool.device) + c.token_start
    page = c.pages_dev.to(torch.int64)[t // ps]
    valid = (page >= 0) & (page < c.num_pages)
    slots = page * ps + t % ps
    tok_idx = None
    if not bool(valid.all()):
        tok_idx = valid.nonzero().squeeze(1)
        slots = slots[tok_idx]
    planes = [p.view(int_t) for p in pool.planes]
    lay = c.layout
    fn = torch_fallback.gather if kind == "gather" else torch_fallback.scatter
    fn(
        planes,
        slots,
        tok_idx,
        c.staging.reshape(-1).view(int_t),
        n_tokens=c.n_tokens,
        head0=c.head_start,
        num_heads=lay.num_heads,
        s_base=lay.base,
        s_head=lay.stride_head,
        s_plane=lay.stride_plane,
        s_tok=lay.stride_token,
    )


def _run(
    kind: str,
    pool: KVPool,
    staging: torch.Tensor,
    layout: StagingLayout,
    pages: np.ndarray | torch.Tensor,
    token_start: int,
    token_end: int,
    head_start: int,
    staging_token_offset: int,
    stream: torch.cuda.Stream | None,
    backend: Backend,
    page_size: int | None = None,
    pinned_path: PinnedPath = "zero_copy",
    compile_only: bool = False,
) -> torch.cuda.Event | None:
    backend = _chosen_backend(pool, backend, pinned_path)
    on_cuda = pool.device.type == "cuda"
    stream, ctx = _launch_stream(pool, stream)
    with ctx:
        try:
            call = _validate(
                kind,
                pool,
                staging,
                layout,
                pages,
                token_start,
                token_end,
                head_start,
                staging_token_offset,
                page_size or pool.page_size,
            )
        except KernelArgError:
            pool.stats.rejected += 1
            raise
        if compile_only:  # compile the Triton specialization of this call; move nothing
            if backend == "triton":
                _run_triton(kind, pool, call, compile_only=True)
            return None
        event = _launch(kind, pool, call, backend, pinned_path, stream)
    if kind == "gather":
        pool.stats.gathers += 1
    else:
        pool.stats.scatters += 1
    if not on_cuda:
        return None
    if event is None:
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _chosen_backend(pool: KVPool, backend: Backend, pinned_path: PinnedPath) -> Backend:
    """``auto`` resolved; an unusable or unknown backend or pinned path refused (and counted)."""
    if backend == "auto":
        return "triton" if triton_usable(pool.device) else "torch"
    if backend == "triton" and not triton_usable(pool.device):
        pool.stats.rejected += 1
        raise KernelBackendUnavailable(
            f"Triton cannot run on {pool.device} here (not installed, or CPU without TRITON_INTERPRET=1)"
        )
    if backend not in ("triton", "torch"):
        pool.stats.rejected += 1
        raise KernelArgError(f"unknown backend {backend!r}")
    if pinned_path not in ("zero_copy", "copy_engine"):
        pool.stats.rejected += 1
        raise KernelArgError(f"unknown pinned path {pinned_path!r}")
    return backend


def _launch_stream(
    pool: KVPool, stream: torch.cuda.Stream | None
) -> tuple[torch.cuda.Stream | None, contextlib.AbstractContextManager]:
    """The stream the copy runs on, and the context that makes it (and the pool's device) current."""
    if pool.device.type != "cuda":
        return stream, contextlib.nullcontext()
    # Switching streams costs more host time than a small gather takes on the GPU: only
    # switch (stream and device, since Triton launches on the current device) when needed.
    if stream is not None or pool.device.index != torch.cuda.current_device():
        stream = stream or torch.cuda.current_stream(pool.device)
        return stream, torch.cuda.stream(stream)
    return torch.cuda.current_stream(), contextlib.nullcontext()


def _launch(
    kind: str,
    pool: KVPool,
    call: _Call,
    backend: Backend,
    pinned_path: PinnedPath,
    stream: torch.cuda.Stream | None,
) -> torch.cuda.Event | None:
    """Run the validated call on its backend; the copy engine's own event when it took the copy."""
    if backend != "triton":
        _run_torch(kind, pool, call)
        pool.stats.torch_runs += 1
        return None
    event = None
    if pinned_path == "copy_engine" and pool.device.type == "cuda" and call.staging.device.type == "cpu":
        event = _run_copy_engine(kind, pool, call, stream)
    if event is None:
        _run_triton(kind, pool, call)
    pool.stats.triton_launches += 1
    return event


def gather(
    pool: KVPool,
    staging: torch.Tensor,
    layout: StagingLayout,
    pages: np.ndarray | torch.Tensor,
    *,
    token_start: int,
    token_end: int,
    head_start: int,
    staging_token_offset: int = 0,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    pinned_path: PinnedPath = "zero_copy",
) -> torch.cuda.Event | None:
    """Copy pool heads ``[head_start, head_start + layout.num_heads)`` of tokens
    ``[token_start, token_end)`` (token ``t`` in slot ``pages[t // page_size] * page_size +
    t % page_size``) into staging rows ``(h - head_start, plane, t - token_start +
    staging_token_offset)``. Returns the completion event on CUDA, None on CPU."""
    return _run(
        "gather",
        pool,
        staging,
        layout,
        pages,
        token_start,
        token_end,
        head_start,
        staging_token_offset,
        stream,
        backend,
        pinned_path=pinned_path,
    )


def scatter(
    pool: KVPool,
    staging: torch.Tensor,
    layout: StagingLayout,
    pages: np.ndarray | torch.Tensor,
    *,
    token_start: int,
    token_end: int,
    head_start: int,
    staging_token_offset: int = 0,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    pinned_path: PinnedPath = "zero_copy",
) -> torch.cuda.Event | None:
    """The reverse of ``gather``: staging rows into the pool. Several senders that each wrote
    their own head range of one buffer are scattered by one call over the whole range, or by one
    call each with ``layout.sub_heads(offset, n)`` and their own ``head_start``."""
    return _run(
        "scatter",
        pool,
        staging,
        layout,
        pages,
        token_start,
        token_end,
        head_start,
        staging_token_offset,
        stream,
        backend,
        pinned_path=pinned_path,
    )


def gather_slots(
    pool: KVPool,
    staging: torch.Tensor,
    layout: StagingLayout,
    slots: np.ndarray | torch.Tensor,
    *,
    head_start: int,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    compile_only: bool = False,
) -> torch.cuda.Event | None:
    """``gather`` with the page lookup already done: chunk token ``i`` lives in ``slots[i]``."""
    n = len(slots)
    return _run(
        "gather", pool, staging, layout, slots, 0, n, head_start, 0, stream, backend, page_size=1,
        compile_only=compile_only,
    )  # fmt: skip


def scatter_slots(
    pool: KVPool,
    staging: torch.Tensor,
    layout: StagingLayout,
    slots: np.ndarray | torch.Tensor,
    *,
    head_start: int,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    compile_only: bool = False,
) -> torch.cuda.Event | None:
    """``scatter`` with the page lookup already done: chunk token ``i`` goes to ``slots[i]``."""
    n = len(slots)
    return _run(
        "scatter", pool, staging, layout, slots, 0, n, head_start, 0, stream, backend, page_size=1,
        compile_only=compile_only,
    )  # fmt: skip
