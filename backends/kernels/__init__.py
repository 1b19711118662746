"""Gather/scatter of head-sliced KV between a paged pool and a staging buffer (Triton or torch).

``StagingLayout`` and the errors import without torch; the torch-facing API (``KVPool``,
``gather``, ``scatter``) loads on first use, so ``kvferry.backends.kernels`` imports anywhere.
"""

from __future__ import annotations

from typing import Any

from kvferry.backends.kernels.errors import (
    DTypeWidthError,
    KernelArgError,
    KernelBackendUnavailable,
    KernelError,
)
from kvferry.backends.kernels.layout import StagingLayout

_LAZY = {"KVPool", "KernelStats", "gather", "scatter", "triton_usable"}

__all__ = [
    "DTypeWidthError",
    "KVPool",
    "KernelArgError",
    "KernelBackendUnavailable",
    "KernelError",
    "KernelStats",
    "StagingLayout",
    "gather",
    "scatter",
    "triton_usable",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvferry.backends.kernels import api

        return getattr(api, name)
    raise AttributeError(name)
