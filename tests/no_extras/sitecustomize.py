"""Loaded at start-up by a Python whose PYTHONPATH starts with this folder: it hides the optional
extras' packages (KVFERRY_HIDE_MODULES, comma-separated top-level names) as if they were not
installed. Every finder on sys.meta_path is wrapped to answer "not found" for those names, so
``importlib.util.find_spec`` returns None and ``import zmq`` raises ``ModuleNotFoundError: No
module named 'zmq'``, as in an environment that never installed them (tests/test_no_extras.py)."""

from __future__ import annotations

import os
import sys

HIDDEN = frozenset(n for n in os.environ.get("KVFERRY_HIDE_MODULES", "").split(",") if n)


class _Hiding:
    """A meta-path finder that passes every question to ``inner`` except for the hidden names."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attr: str) -> object:  # invalidate_caches, find_distributions, ...
        return getattr(self._inner, attr)


if HIDDEN:
    sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]
