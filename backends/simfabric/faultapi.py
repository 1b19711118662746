"""What the fabric asks of a fault injector. The default injects nothing.

The fabric calls these hooks at the moments a real network could misbehave; sim/faults.py
implements them from seeded RNG streams. Keeping the interface here lets the backend run
(fault-free) without the simulator package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ControlFate:
    """What happens to one control message: dropped, or delivered `copies` times with extra delays."""

    dropped: bool = False
    extra_delays_ns: tuple[int, ...] = (0,)


@dataclass(frozen=True, slots=True)
class NotifFate:
    dropped: bool = False
    extra_delay_ns: int = 0


DELIVER = ControlFate()
NOTIF_OK = NotifFate()


class NoFaults:
    """A perfect network."""

    def control_fate(self, src: str, dst: str, now: int) -> ControlFate:
        return DELIVER

    def transfer_err(self, src: str, dst: str, now: int) -> bool:
        return False

    def notif_fate(self, src: str, dst: str, now: int) -> NotifFate:
        return NOTIF_OK
