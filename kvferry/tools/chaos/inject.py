"""Puts one timed fault on the network or a process, and always takes it off again."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from kvferry.tools.chaos.netns import Network
from kvferry.tools.chaos.schedule import Fault

HOSTS = {"prefill": 0, "decode": 1}  # which namespace each side runs in


TRIGGER_WAIT_S = 60.0  # a segment that never reports its first rooms gets the fault anyway
POLL_S = 0.005


class Injector(threading.Thread):
    """Waits until ``ready()`` (the segment's first rooms are in), applies the fault, waits
    ``fault.for_s``, undoes it. ``stop`` cuts both waits short; the fault is undone whatever
    happens (a failing ``tc`` included)."""

    def __init__(
        self,
        net: Network,
        fault: Fault,
        pid: Callable[[str], int | None],
        ready: Callable[[], bool] = lambda: True,
        on_apply: Callable[[float], None] = lambda _at: None,
    ) -> None:
        super().__init__(daemon=True, name=f"chaos-{fault.kind}")
        self.net, self.fault, self.pid, self.on_apply, self.ready = net, fault, pid, on_apply, ready
        self.stop_event = threading.Event()
        self.applied_at: float | None = None
        self.undone_at: float | None = None
        self.error = ""

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        f = self.fault
        end = time.monotonic() + TRIGGER_WAIT_S
        while not self.ready() and time.monotonic() < end:
            if self.stop_event.wait(POLL_S):
                return
        host = HOSTS[f.side]
        pid = self.pid(f.side) if f.kind == "stall" else None
        try:
            self.applied_at = time.monotonic()
            self.on_apply(self.applied_at)
            if f.kind.startswith("partition"):
                self.net.set_link(host, up=False)
            elif f.kind == "slow_link":
                self.net.slow(host, f.rate_kbit)
            elif f.kind == "stall" and pid is not None:
                os.kill(pid, signal.SIGSTOP)
            self.stop_event.wait(f.for_s)
        except Exception as e:  # recorded for the report; the fault is undone below
            self.error = f"{f.kind}: {e}"
        finally:
            self._undo(host, pid)
            self.undone_at = time.monotonic()

    def _undo(self, host: int, pid: int | None) -> None:
        f = self.fault
        try:
            if f.kind.startswith("partition"):
                self.net.set_link(host, up=True)
            elif f.kind == "slow_link":
                self.net.fast(host)
            elif f.kind == "stall" and pid is not None:
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the stopped process is gone (killed by the run's own cleanup)
        except Exception as e:
            self.error = self.error or f"undo {f.kind}: {e}"
