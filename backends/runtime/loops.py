"""Thread plumbing shared by the endpoints: a stoppable loop with idle backoff.

A loop calls ``step()`` repeatedly. After a step that did work it goes again at once (after a
``sleep(0)`` yield); after idle steps it sleeps, doubling from ``idle_min_s`` up to ``idle_max_s``,
so an idle endpoint costs a few hundred wake-ups a second and never spins. ``idle_cap`` (optional)
lowers that ceiling while it returns a smaller number: a data thread with rooms in flight polls
every ``active_idle_max_s`` (a notification is noticed that soon) and backs off to ``idle_max_s``
only when the rank has nothing to wait for. ``step`` may wait on
its own (a worker waits on its queue's event). ``wait`` (optional) replaces the idle sleep: the
data thread of a native-engine endpoint sleeps on the engine's wake-up, so a completion or a
notification ends the sleep at once (it still sleeps at most the idle time); the one progress
thread of such a rank sleeps on the engine's wake-up and the control plane's inbox together
(base.py ``_wait_progress``). An exception from
``step`` never ends the thread: it goes to ``on_error`` with its original type and the loop continues.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Loop:
    def __init__(
        self,
        name: str,
        step: Callable[[], bool],
        on_error: Callable[[BaseException], None],
        *,
        idle_min_s: float = 50e-6,
        idle_max_s: float = 1e-3,
        idle_cap: Callable[[], float] | None = None,
        wait: Callable[[float], object] | None = None,
    ) -> None:
        self.name = name
        self._step = step
        self._on_error = on_error
        self._idle_min = idle_min_s
        self._idle_max = idle_max_s
        self._idle_cap = idle_cap
        self._wait = wait
        self.passes = 0  # steps run (tests count them; one int add per pass)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()

    def join(self, timeout_s: float) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def _run(self) -> None:
        idle = self._idle_min
        while not self.stop_event.is_set():
            self.passes += 1
            try:
                busy = self._step()
            except Exception as exc:  # the thread must survive; the error goes to the poller
                self._on_error(exc)
                busy = False
            if busy:
                idle = self._idle_min
                time.sleep(0)
            else:
                if self._idle_cap is not None:
                    idle = min(idle, self._idle_cap())
                if self._wait is not None:
                    self._wait(idle)
                else:
                    self.stop_event.wait(idle)
                idle = min(idle * 2, self._idle_max)
