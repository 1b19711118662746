"""Lock discipline debug mode: the engine may be entered only by a thread holding its endpoint's
lock (the ownership rule of base.py). On when ``$KVFERRY_LOCK_CHECK`` is ``1`` (the test suite
sets it, tests/conftest.py); off, nothing here runs and the endpoint keeps a plain Lock.

On, the endpoint's lock is an ``OwnedLock`` (it knows which thread holds it) and, from ``start()``,
the endpoint and its driver see the engine through a ``GuardedEngine``: every attribute read or
write of it checks that the calling thread holds the lock, and raises ``LockDisciplineError`` (and
records it in ``VIOLATIONS``, which the suite checks after every test, so a violation in a
background thread fails the test too) if not. The engine's own methods are not slowed: they see
the real engine as ``self``.

The other lock-protected tables are covered the same way (``guard_table``): the driver's
in-flight write and copy tables (under the endpoint lock), the native executor's transfer,
settled and notification tables (under its own lock, backends/nixl/native.py) and the host copy
executor's jobs (backends/copy_exec.py). Every operation on such a table checks its lock is held
by the caller; a truth or length peek does not (one atomic read under the GIL, which the runtime
uses on purpose to skip a lock round trip when a table is empty).
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = [
    "ENV",
    "VIOLATIONS",
    "GuardedEngine",
    "GuardedTable",
    "LockDisciplineError",
    "OwnedLock",
    "enabled",
    "guard",
    "guard_table",
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


def _violation(what: str) -> None:
    msg = f"{what} entered by thread {threading.current_thread().name!r} without its lock"
    with _violations_lock:
        VIOLATIONS.append(msg)
    raise LockDisciplineError(msg)


class GuardedTable:
    """A dict, set, list or deque that only a holder of ``lock`` may use (peeks excepted)."""

    __slots__ = ("_lock", "_name", "_table")

    def __init__(self, table: Any, lock: OwnedLock, name: str) -> None:
        self._table = table
        self._lock = lock
        self._name = name

    def _check(self, what: str) -> Any:
        if not self._lock.held_by_me():
            _violation(f"{self._name}.{what}")
        return self._table

    def __getattr__(self, name: str) -> Any:
        return getattr(self._check(name), name)

    def __getitem__(self, key: Any) -> Any:
        return self._check("[]")[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check("[]=")[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._check("del")[key]

    def __contains__(self, key: Any) -> bool:
        return key in self._check("in")

    def __iter__(self) -> Any:
        return iter(self._check("iter"))

    def __len__(self) -> int:  # a peek: no lock
        return len(self._table)

    def __bool__(self) -> bool:  # a peek: no lock
        return bool(self._table)


def guard_table(table: Any, lock: Any, name: str) -> Any:
    """``table`` behind ``lock`` in the debug mode (``lock`` an OwnedLock), else itself."""
    return GuardedTable(table, lock, name) if isinstance(lock, OwnedLock) else table


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
    driver = endpoint.driver
    driver.handles = guard_table(driver.handles, endpoint.lock, "Driver.handles")
    driver.copies = guard_table(driver.copies, endpoint.lock, "Driver.copies")
    driver.prepared = guard_table(driver.prepared, endpoint.lock, "Driver.prepared")
