"""Typed errors of the gather/scatter kernels.

Every argument problem is caught before a launch: a kernel handed a wrong width or an out-of-range
head would move garbage bytes or write outside the pool, which no later check can undo.
"""

from __future__ import annotations

from kvferry.core.errors import KvferryError


class KernelError(KvferryError):
    """Base class of the kernel layer's errors."""


class KernelArgError(KernelError, ValueError):
    """A gather/scatter call whose arguments cannot be honoured (shapes, ranges, devices, sizes)."""


class DTypeWidthError(KernelArgError):
    """Pool and staging buffer disagree on the element width, so a byte copy would misplace data."""


class KernelBackendUnavailable(KernelError, RuntimeError):
    """The requested backend (Triton, CUDA streams) is not usable in this process."""
