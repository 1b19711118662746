"""Where each (head, plane, token) row of a staging buffer lives: pure arithmetic, no torch.

A *plane* is one pool buffer: plane ``2*layer + 0`` is layer ``layer``'s K, ``2*layer + 1`` its V;
MLA pools have one latent plane per layer. A staging buffer holds ``num_heads`` heads of
``num_planes`` planes for ``num_tokens`` consecutive tokens; each row is ``head_dim`` contiguous
elements. Strides are in elements of the staging dtype, which has the pool's element width.

Two layouts are named because the two staging strategies use them:
- ``head_major`` ``[heads, planes, tokens, head_dim]`` (SGLang PR 18968's ``[heads, layers, K|V, tokens,
  head_dim]``): every head is one contiguous run, so a head range is one transfer descriptor.
- ``plane_major`` ``[planes, tokens, heads, head_dim]`` (SGLang PR 22536's ``[2L, tokens, heads,
  head_dim]``): one plane and token keeps its heads together.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.backends.kernels.errors import KernelArgError


@dataclass(frozen=True, slots=True)
class StagingLayout:
    """Element strides of a staging buffer; ``base`` is the element offset of row (0, 0, 0)."""

    num_heads: int
    num_planes: int
    num_tokens: int
    head_dim: int
    stride_head: int
    stride_plane: int
    stride_token: int
    base: int = 0

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_planes", "num_tokens", "head_dim"):
            if getattr(self, name) < 1:
                raise KernelArgError(f"StagingLayout.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stride_head", "stride_plane", "stride_token", "base"):
            if getattr(self, name) < 0:
                raise KernelArgError(f"StagingLayout.{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def head_major(
        cls, num_heads: int, num_planes: int, num_tokens: int, head_dim: int, base: int = 0
    ) -> StagingLayout:
        """``[heads, planes, tokens, head_dim]`` contiguous (SGLang PR 18968)."""
        return cls(
            num_heads,
            num_planes,
            num_tokens,
            head_dim,
            stride_head=num_planes * num_tokens * head_dim,
            stride_plane=num_tokens * head_dim,
            stride_token=head_dim,
            base=base,
        )

    @classmethod
    def plane_major(
        cls, num_heads: int, num_planes: int, num_tokens: int, head_dim: int, base: int = 0
    ) -> StagingLayout:
        """``[planes, tokens, heads, head_dim]`` contiguous (SGLang PR 22536)."""
        return cls(
            num_heads,
            num_planes,
            num_tokens,
            head_dim,
            stride_head=head_dim,
            stride_plane=num_tokens * num_heads * head_dim,
            stride_token=num_heads * head_dim,
            base=base,
        )

    def sub_heads(self, head_offset: int, num_heads: int) -> StagingLayout:
        """The same buffer seen from one sender: heads ``[head_offset, head_offset + num_heads)``."""
        if head_offset < 0 or num_heads < 1 or head_offset + num_heads > self.num_heads:
            raise KernelArgError(
                f"head slice [{head_offset}, {head_offset + num_heads}) outside {self.num_heads} heads"
            )
        return StagingLayout(
            num_heads,
            self.num_planes,
            self.num_tokens,
            self.head_dim,
            self.stride_head,
            self.stride_plane,
            self.stride_token,
            self.base + head_offset * self.stride_head,
        )

    @property
    def numel(self) -> int:
        """Elements the layout addresses (its rows), whatever the gaps between them."""
        return self.num_heads * self.num_planes * self.num_tokens * self.head_dim

    @property
    def extent(self) -> int:
        """One past the highest element index the layout touches: the buffer must be this long."""
        return (
            self.base
            + (self.num_heads - 1) * self.stride_head
            + (self.num_planes - 1) * self.stride_plane
            + (self.num_tokens - 1) * self.stride_token
            + self.head_dim
        )

    def is_dense(self) -> bool:
        """True when no two rows overlap: scatter reads and gather writes are then well defined."""
        dims = sorted(
            [
                (self.stride_head, self.num_heads),
                (self.stride_plane, self.num_planes),
                (self.stride_token, self.num_tokens),
            ]
        )
        span = self.head_dim
        for stride, count in dims:
            if count > 1 and stride < span:
                return False
            span = max(span, stride * (count - 1) + span) if count > 1 else span
        return True
