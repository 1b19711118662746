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

_LAZY = {"KVPool", "KernelStats", "gather", "gather_slots", "scatter", "scatter_slots", "triton_usable"}
_LAZY_MAPS = {"gather_map", "scatter_map", "map_layout"}

__all__ = [
    "DTypeWidthError",
    "KVPool",
    "KernelArgError",
    "KernelBackendUnavailable",
    "KernelError",
    "KernelStats",
    "StagingLayout",
    "gather",
    "gather_map",
    "gather_slots",
    "map_layout",
    "scatter",
    "scatter_map",
    "scatter_slots",
    "triton_usable",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvferry.backends.kernels import api

        return getattr(api, name)
    if name in _LAZY_MAPS:
        from kvferry.backends.kernels import planner_maps

        return getattr(planner_maps, name)
    raise AttributeError(name)
