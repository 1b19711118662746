"""The same gather/scatter with plain torch indexing, for machines without Triton.

Arguments arrive already validated by ``api``; buffers are viewed as integers of the element width
so the copy is bit-exact for every dtype. One indexed copy per plane: far slower than the kernel
(many small copies, a temporary of the gathered rows), but the same bytes land in the same places.
"""

from __future__ import annotations

import torch


def _staging_view(staging: torch.Tensor, n_tok: int, nh: int, row: int, strides, offset: int) -> torch.Tensor:
    s_tok, s_head = strides
    return torch.as_strided(staging, size=(n_tok, nh, row), stride=(s_tok, s_head, 1), storage_offset=offset)


def gather(
    planes: list[torch.Tensor],
    slots: torch.Tensor,
    tok_idx: torch.Tensor | None,
    staging: torch.Tensor,
    *,
    n_tokens: int,
    head0: int,
    num_heads: int,
    s_base: int,
    s_head: int,
    s_plane: int,
    s_tok: int,
) -> None:
    """planes: ``[slots, heads, row]`` integer views; slots: pool slot of every moved token;
    tok_idx: chunk index of each moved token, None when all ``n_tokens`` move, in order."""
    row = planes[0].shape[2]
    for p, plane in enumerate(planes):
        rows = plane[slots, head0 : head0 + num_heads, :]
        dst = _staging_view(
            staging,
            n_tokens,
            num_heads,
            row,
            (s_tok, s_head),
            staging.storage_offset() + s_base + p * s_plane,
        )
        if tok_idx is None:
            dst.copy_(rows)
        else:
            dst.index_copy_(0, tok_idx.to(dst.device), rows.to(dst.device))


def scatter(
    planes: list[torch.Tensor],
    slots: torch.Tensor,
    tok_idx: torch.Tensor | None,
    staging: torch.Tensor,
    *,
    n_tokens: int,
    head0: int,
    num_heads: int,
    s_base: int,
    s_head: int,
    s_plane: int,
    s_tok: int,
) -> None:
    """The reverse of ``gather``: staging rows into the pool's slots."""
    row = planes[0].shape[2]
    for p, plane in enumerate(planes):
        src = _staging_view(
            staging,
            n_tokens,
            num_heads,
            row,
            (s_tok, s_head),
            staging.storage_offset() + s_base + p * s_plane,
        )
        if tok_idx is not None:
            src = src[tok_idx.to(src.device)]
        plane[slots, head0 : head0 + num_heads, :] = src.to(plane.device)
