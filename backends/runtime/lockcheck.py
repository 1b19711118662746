"""Lock discipline debug mode: the engine may be entered only by a thread holding its endpoint's
lock (the ownership rule of base.py). On when ``$KVFERRY_LOCK_CHECK`` is ``1`` (the test suite
sets it, tests/conftest.py); off, nothing here runs and the endpoint keeps a plain Lock.

On, the endpoint's lock is an ``OwnedLock`` (it knows which thread holds it) and, from ``start()``,
the endpoint and its driver see the engine through a ``GuardedEngine``: every attribute read or
write of it checks that the calling thread holds the lock, and raises ``LockDisciplineError`` (and
records it in ``VIOLATIONS``, which the suite checks after every test, so a violation in a
background thread fails the test too) if not. The engine's own methods are not slowed: they see
the real engine as ``self``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = [
    "ENV",
    "VIOLATIONS",
    "GuardedEngine",
    "LockDisciplineError",
    "OwnedLock",
    "enabled",
    "guard",
    "new_lock",
]

ENV = "KVFERRY_LOCK_CHECK"
VIOLATIONS: list[str] = []
_violations_lock = threading.Lock()


class LockDisciplineError(AssertionError):
    """The engine was entered by a thread that does not hold its endpoint's lock."""


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


class OwnedLock:
    """A non-reentrant lock that knows its holder (``threading.Lock`` does not)."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._owner = threading.get_ident()
        return got

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("release of a lock this thread does not hold")
        self._owner = None
        self._lock.release()

    def __enter__(self) -> OwnedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held_by_me(self) -> bool:
        return self._owner == threading.get_ident()


class GuardedEngine:
    """The engine, as seen from outside it: entered only under ``lock``."""

    __slots__ = ("_engine", "_lock")

    def __init__(self, engine: Any, lock: OwnedLock) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_lock", lock)

    def _check(self, what: str) -> None:
        if not self._lock.held_by_me():
            msg = (
                f"{type(self._engine).__name__}.{what} entered by thread "
                f"{threading.current_thread().name!r} without the endpoint lock"
            )
            with _violations_lock:
                VIOLATIONS.append(msg)
            raise LockDisciplineError(msg)

    def __getattr__(self, name: str) -> Any:
        self._check(name)
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._check(name)
        setattr(self._engine, name, value)


def new_lock() -> Any:
    """The endpoint's lock: an OwnedLock in the debug mode, else a plain Lock."""
    return OwnedLock() if enabled() else threading.Lock()


def guard(endpoint: Any) -> None:
    """Put the endpoint's engine behind its lock (debug mode only; idempotent)."""
    if not isinstance(endpoint.lock, OwnedLock) or isinstance(endpoint.engine, GuardedEngine):
        return
    guarded = GuardedEngine(endpoint.engine, endpoint.lock)
    endpoint.engine = guarded
    endpoint.driver.engine = guarded
