"""One device's descriptor work, processor-shared among the posts in their posting phase.

With ``FabricSpec.one_gpu`` and ``NicSpec.shared_desc_ns`` every node posts through the one GPU:
a descriptor costs its own node ``own_ns`` (per_desc, or read_desc for a READ: the posting CPU
work) and the device ``shared_ns``, served at 1/k of the device while k posts are posting. A
descriptor takes whichever is the bottleneck, ``max(own_ns, k * shared_ns)``, so a post that
runs at one k from start to end costs what the closed form says; when a post joins or leaves,
the others' remaining descriptors are worked at the new k from then on (as the fabric's
bandwidth shares are recomputed when a transfer starts or ends).

Remaining descriptors are exact fractions: a post's end is ``ceil`` of its exact end, so a post
that sees one k throughout ends on the integer ns the closed form gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(slots=True, eq=False)
class PostJob:
    xfer: Any  # the fabric's Xfer (not imported: the fabric imports this module)
    own_ns: int  # a descriptor's cost on the posting node (its CPU)
    shared_ns: int  # a descriptor's cost on the shared device
    left: Fraction | int  # descriptors still to post (int until a share change cuts one)
    finish_at: int = -1


class SharedDevice:
    """The posts in their posting phase on one device, in the order they joined (so every
    recomputation, and the order of posts ending at the same ns, is fixed)."""

    __slots__ = ("gen", "jobs", "since")

    def __init__(self) -> None:
        self.jobs: list[PostJob] = []
        self.since = 0  # the time every job's ``left`` is counted at
        self.gen = 0  # bumped at each recomputation: an older timer is stale

    def advance(self, now: int) -> None:
        """Work every job's descriptors from ``since`` to ``now`` at the current share."""
        dt = now - self.since
        self.since = now
        if dt <= 0 or not self.jobs:
            return
        k = len(self.jobs)
        for j in self.jobs:
            j.left -= Fraction(dt, max(j.own_ns, k * j.shared_ns))

    def reschedule(self, now: int) -> int:
        """Each job's end at the current share (``advance`` to ``now`` first); the soonest."""
        k = len(self.jobs)
        soonest = -1
        for j in self.jobs:
            cost = max(j.own_ns, k * j.shared_ns)
            left = j.left
            if isinstance(left, int):
                j.finish_at = now + max(0, left * cost)
            else:  # ceil: no post ends before its last descriptor is worked
                j.finish_at = now + max(0, -(-left.numerator * cost // left.denominator))
            if soonest < 0 or j.finish_at < soonest:
                soonest = j.finish_at
        return soonest

    def take_done(self, now: int) -> list[PostJob]:
        """Remove and return (in join order) the jobs whose end is ``now`` or earlier."""
        done = [j for j in self.jobs if j.finish_at <= now]
        if done:
            self.jobs = [j for j in self.jobs if j.finish_at > now]
        return done
