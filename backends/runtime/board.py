"""The status board: the latest KVPoll of every room the local engine asked about.

The core's engine is single-threaded and guarded by the driver's lock, which a worker may hold
while it plans and posts a large chunk. The scheduler polls every room on every iteration, so
``poll()`` reads this board instead of taking the driver lock.

Ownership: ``_rooms`` is written by the driver's ``on_status``/``on_free_pages`` callbacks (in
whichever runtime thread holds the driver lock) and by API calls (track, drop); every access holds
``_cond``'s lock, and ``_cond`` wakes ``wait()`` callers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvferry.core.kvpoll import KVPoll, advance, is_terminal


@dataclass
class RoomView:
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    error: BaseException | None = None  # the original exception behind a failure, if any
    pages_freed: bool = False


class StatusBoard:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._rooms: dict[tuple[int, str], RoomView] = {}
        self._live = 0  # views not terminal yet: the data thread's "poll fast" hint, O(1)

    def track(self, room: int, tid: str) -> None:
        with self._cond:
            if (room, tid) not in self._rooms:
                self._rooms[(room, tid)] = RoomView()
                self._live += 1

    def update(
        self, room: int, tid: str, status: KVPoll, reason: str = "", error: BaseException | None = None
    ) -> None:
        with self._cond:
            view = self._rooms.get((room, tid))
            if view is None:
                return  # the caller already cleared it: late news of a finished room
            before = view.status
            view.status = advance(before, status)
            self._live -= is_terminal(view.status) and not is_terminal(before)
            if view.status is KVPoll.Failed and before is not KVPoll.Failed:
                view.reason = reason or view.reason
                view.error = view.error or error
            self._cond.notify_all()

    def fail(self, room: int, tid: str, error: BaseException) -> None:
        """Record an exception raised outside the core (a worker bug) for the poller."""
        with self._cond:
            view = self._rooms.get((room, tid))
            if view is not None and view.error is None:
                view.error = error
            self._cond.notify_all()

    def freed(self, room: int, tid: str) -> None:
        with self._cond:
            view = self._rooms.get((room, tid))
            if view is not None:
                view.pages_freed = True
            self._cond.notify_all()

    def get(self, room: int, tid: str) -> RoomView | None:
        with self._cond:
            view = self._rooms.get((room, tid))
            return None if view is None else RoomView(view.status, view.reason, view.error, view.pages_freed)

    def drop(self, room: int, tid: str) -> None:
        with self._cond:
            view = self._rooms.pop((room, tid), None)
            if view is not None and not is_terminal(view.status):
                self._live -= 1

    def wait_for(self, room: int, tid: str, statuses: set[KVPoll], timeout_s: float) -> KVPoll | None:
        """Block until the room reaches one of ``statuses`` (or the timeout); returns its status."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while True:
                view = self._rooms.get((room, tid))
                if view is None:
                    return None
                if view.status in statuses:
                    return view.status
                left = end - time.monotonic()
                if left <= 0:
                    return view.status
                self._cond.wait(left)

    def in_flight(self) -> bool:
        """Some tracked room is not terminal yet (its data may arrive any moment)."""
        with self._cond:
            return self._live > 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._rooms)
