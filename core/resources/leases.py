"""Push registration leases (vLLM PR 35264, DESIGN sections 3 and 6): prefill's registry of decode's
PUSH_REGs, pure and sans-IO (time is passed in, answers are returned as notices).

Decode registers its destination blocks as soon as it allocates them (``PushReg``: the router's
``transfer_id``, decode's identity and incarnation, block ids, the token range it still lacks);
prefill reports each request whose forward pass finished (``finish``). Either may come first: a
registration waits for its finish, a finish waits (holding prefill's blocks) for its
registration. A pair is ``MATCHED``: prefill may post writes into the blocks, each one through
``post``, which refuses once the lease is over. So nothing is ever written under an expired lease,
and blocks go back to decode (``RELEASED``) only once no write of prefill is in flight: expiry,
decode's abort (gap C1) and a write prefill cannot post (gap C2) all fence first.

Leases are renewed by decode's heartbeats (``renew``); a newer incarnation of a decode drops the
old one's registrations (its process and blocks are gone). A watchdog fails registrations and
finishes that never match, with a reason. Every outcome decode must learn is a notice addressed
to it (``to_decode``), so both sides see the same reason.

Matching is by ``transfer_id``. With ``suffix_match`` configured, an entry that has no transfer id
(a client that sends none) may match by the request id with its retry suffix stripped; two
candidates are an error for the newcomer, never a guess. Two entries that both carry transfer ids
pair only if those are equal, so a retried request (new transfer id) never pairs with its earlier
attempt's registration.

Misuse by the local caller (prefill's scheduler) raises ``LeaseMisuseError``; what a peer sends
(a registration) is answered, never raised: a bad or conflicting one is ``REFUSED`` with a reason.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvferry.core.deadlines import DeadlineHeap
from kvferry.core.errors import LocalMisuseError
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.machine import Transition, fire

__all__ = [
    "LEASE_TABLE",
    "Finish",
    "Lease",
    "LeaseIn",
    "LeaseMisuseError",
    "LeaseRegistry",
    "LeaseState",
    "Notice",
    "NoticeKind",
    "PushReg",
    "strip_retry_suffix",
]


class LeaseMisuseError(LocalMisuseError):
    """The local scheduler asked for something the registry cannot do (its own mistake)."""


def strip_retry_suffix(request_id: str) -> str:
    """``"req-abc-2"`` -> ``"req-abc"``: the base id retries share (a trailing ``-<digits>``)."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and tail.isdigit() and head else request_id


@dataclass(frozen=True, slots=True)
class PushReg:
    """Decode's PUSH_REG. ``blocks`` cover the request from token 0; ``[token_start, token_end)``
    is what decode still lacks (a partial prefix hit starts later), written at its own slots."""

    transfer_id: str
    request_id: str
    decode: Hashable
    incarnation: int
    blocks: tuple[int, ...]
    token_start: int
    token_end: int


@dataclass(frozen=True, slots=True)
class Finish:
    """Prefill's forward pass of a request finished; its KV sits in prefill's blocks."""

    transfer_id: str
    request_id: str


class NoticeKind(Enum):
    MATCHED = "matched"  # prefill may write (to prefill)
    REFUSED = "refused"  # a registration was not accepted (to decode)
    EXPIRED = "expired"  # the lease ran out before delivery (to both)
    FAILED = "failed"  # watchdog, ambiguity, or a write prefill could not post (to both)
    RELEASED = "released"  # no write of prefill is or will be in flight: decode may reuse the blocks
    DELIVERED = "delivered"  # every write landed under the lease (to both)
    HELD_DROPPED = "held_dropped"  # a finish no registration ever matched: prefill frees its blocks


@dataclass(frozen=True, slots=True)
class Notice:
    kind: NoticeKind
    transfer_id: str
    request_id: str
    decode: Hashable | None
    reason: str = ""

    @property
    def to_decode(self) -> bool:
        return self.decode is not None and self.kind is not NoticeKind.MATCHED


class LeaseState(IdentityEnum):
    WAITING = "waiting"  # registered, lease running, not matched
    MATCHED = "matched"  # paired: writes may be posted while the lease lives
    FENCING = "fencing"  # over (expired, aborted, failed): no new write; waiting for in-flight ones
    DONE = "done"  # removed from the registry


class LeaseIn(IdentityEnum):
    MATCH = "match"
    POST = "post"
    WRITE_DONE = "write_done"
    COMPLETE = "complete"  # prefill posted its last write
    EXPIRE = "expire"
    ABORT = "abort"
    POST_FAILED = "post_failed"  # a write prefill could not post (never in flight)
    WRITE_FAILED = "write_failed"  # a posted write ended in error
    WATCHDOG = "watchdog"
    SUPERSEDE = "supersede"  # decode restarted: its old process, blocks and writes are gone


@dataclass(slots=True)
class Lease:
    reg: PushReg
    deadline: int
    watchdog: int
    state: LeaseState = LeaseState.WAITING
    finish: Finish | None = None
    inflight: int = 0
    complete: bool = False
    over: str = ""  # why the lease ended (FENCING)
    outcome: NoticeKind | None = None
    writes: list[int] = field(default_factory=list)  # post times, for checks


_W, _M, _F, _D = LeaseState.WAITING, LeaseState.MATCHED, LeaseState.FENCING, LeaseState.DONE


class LeaseRegistry:
    """Every registration and held finish of one prefill rank."""

    def __init__(
        self,
        lease_ns: int,
        match_ns: int,
        *,
        suffix_match: bool = False,
        base_id: Callable[[str], str] = strip_retry_suffix,
        tombstone_ns: int | None = None,
    ) -> None:
        if lease_ns <= 0 or match_ns <= 0:
            raise LeaseMisuseError("lease_ns and match_ns must be positive")
        self.lease_ns = lease_ns
        self.match_ns = match_ns
        self.suffix_match = suffix_match
        self.base_id = base_id
        self.tombstone_ns = tombstone_ns if tombstone_ns is not None else 10 * lease_ns
        self.leases: dict[str, Lease] = {}  # by transfer id ("" ids are keyed by request id)
        self.held: dict[str, tuple[Finish, int]] = {}  # finishes waiting: key -> (finish, watchdog)
        self.finished: dict[str, NoticeKind] = {}  # tombstones: key -> how it ended
        self.expired_at: dict[str, int] = {}  # tombstones: key -> the deadline of a lease that expired
        self._tomb = DeadlineHeap()
        self._out: list[Notice] = []
        self.counters: dict[str, int] = {}
        self._dirty = True
        self._next: int | None = None

    # --- keys and lookups ------------------------------------------------------------------------

    @staticmethod
    def key(transfer_id: str, request_id: str) -> str:
        """Where the registry files an entry: by transfer id, else by request id."""
        return transfer_id if transfer_id else f"req:{request_id}"

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _emit(self, kind: NoticeKind, lease_or_fin: Lease | Finish, reason: str = "") -> None:
        if isinstance(lease_or_fin, Lease):
            reg = lease_or_fin.reg
            self._out.append(Notice(kind, reg.transfer_id, reg.request_id, reg.decode, reason))
        else:
            self._out.append(Notice(kind, lease_or_fin.transfer_id, lease_or_fin.request_id, None, reason))

    def _drain(self) -> list[Notice]:
        out, self._out = self._out, []
        return out

    def drain(self) -> list[Notice]:
        """Notices left by ``post`` (which answers with the registration, not notices)."""
        return self._drain()

    def _candidates(self, transfer_id: str, request_id: str, pool: dict[str, Any], tid_of: Any) -> list[str]:
        """Keys in ``pool`` this entry may pair with: its own transfer id, else (configured) the
        base request id, only against entries where one of the two has no transfer id."""
        key = self.key(transfer_id, request_id)
        if key in pool:
            return [key]
        if not self.suffix_match:
            return []
        base = self.base_id(request_id)
        out = []
        for k, v in pool.items():
            other_tid, other_req = tid_of(v)
            if transfer_id and other_tid:
                continue  # both carry router ids and they differ: different attempts
            if self.base_id(other_req) == base:
                out.append(k)
        return sorted(out)

    # --- peer input --------------------------------------------------------------------------------

    def register(self, reg: PushReg, now: int) -> list[Notice]:
        """Decode's PUSH_REG. Answers with notices (a refusal names its reason)."""
        self._dirty = True
        key = self.key(reg.transfer_id, reg.request_id)
        why = self._bad(reg)
        if why:
            self._count("refused")
            self._emit(NoticeKind.REFUSED, Lease(reg, now, now), why)
            return self._drain()
        done = self.finished.get(key)
        if done is not None:
            self._count("late_registration")
            self._emit(
                NoticeKind.REFUSED, Lease(reg, now, now), f"late registration: transfer already {done.value}"
            )
            return self._drain()
        old = self.leases.get(key)
        if old is not None:
            same_peer = old.reg.decode == reg.decode
            if same_peer and old.reg.incarnation == reg.incarnation:
                if old.reg == reg:
                    self._count("duplicate_registration")
                    if old.state is not _F:
                        old.deadline = max(old.deadline, now + self.lease_ns)
                    return self._drain()
                self._count("refused")
                self._emit(
                    NoticeKind.REFUSED, Lease(reg, now, now), "conflicting registration for the same transfer"
                )
                return self._drain()
            if same_peer and reg.incarnation > old.reg.incarnation:
                self._step(old, LeaseIn.SUPERSEDE, now)  # that process is gone, and with it its blocks
            else:
                self._count("refused")
                self._emit(
                    NoticeKind.REFUSED,
                    Lease(reg, now, now),
                    f"transfer already registered by {old.reg.decode} (incarnation {old.reg.incarnation})",
                )
                return self._drain()
        lease = Lease(reg, deadline=now + self.lease_ns, watchdog=now + self.match_ns)
        held = self._candidates(
            reg.transfer_id, reg.request_id, self.held, lambda h: (h[0].transfer_id, h[0].request_id)
        )
        if len(held) > 1:
            self._count("ambiguous")
            self._emit(
                NoticeKind.REFUSED, lease, f"ambiguous: {len(held)} finished requests share its base id"
            )
            return self._drain()
        self.leases[key] = lease
        if held:
            fin, _ = self.held.pop(held[0])
            self._count("matched_finish_first")  # prefill held its blocks for this registration
            self._step(lease, LeaseIn.MATCH, now, fin)
        return self._drain()

    def _bad(self, reg: PushReg) -> str:
        if not reg.transfer_id and not self.suffix_match:
            return "no transfer_id (matching by request id is not configured)"
        if not reg.transfer_id and not reg.request_id:
            return "neither a transfer_id nor a request id"
        if not 0 <= reg.token_start <= reg.token_end:
            return f"token range [{reg.token_start}, {reg.token_end}) is reversed or negative"
        if reg.token_end > reg.token_start and not reg.blocks:
            return "tokens asked for but no blocks"
        if len(set(reg.blocks)) != len(reg.blocks) or any(b < 0 for b in reg.blocks):
            return "a block is listed twice or negative"
        return ""

    def renew(self, decode: Hashable, incarnation: int, now: int) -> list[Notice]:
        """A heartbeat from ``decode``: its live leases run ``lease_ns`` from now; registrations of
        an older incarnation are superseded (that process is gone)."""
        self._dirty = True
        for lease in [x for x in self.leases.values() if x.reg.decode == decode]:
            if lease.reg.incarnation < incarnation:
                self._step(lease, LeaseIn.SUPERSEDE, now)
            elif lease.reg.incarnation == incarnation and lease.state is not _F and lease.deadline > now:
                lease.deadline = now + self.lease_ns
        return self._drain()

    def renew_key(self, transfer_id: str, request_id: str, now: int) -> None:
        """Renew one registration (decode named it in a heartbeat): a lease already over stays over."""
        self._dirty = True
        lease = self.leases.get(self.key(transfer_id, request_id))
        if lease is not None and lease.state is not _F and lease.deadline > now:
            lease.deadline = now + self.lease_ns

    def abort(self, transfer_id: str, request_id: str, decode: Hashable, now: int) -> list[Notice]:
        """Decode aborted after registering (gap C1): fence, then release its blocks."""
        self._dirty = True
        lease = self.leases.get(self.key(transfer_id, request_id))
        if lease is None or lease.reg.decode != decode:
            self._count("abort_unknown")
            # Nothing of ours can be writing for it: it may reuse its blocks now.
            reg = PushReg(transfer_id, request_id, decode, -1, (), 0, 0)
            self._emit(NoticeKind.RELEASED, Lease(reg, now, now), "nothing registered")
            return self._drain()
        if lease.state is not _F:
            self._step(lease, LeaseIn.ABORT, now)
        return self._drain()

    # --- local input (prefill's scheduler and driver) ---------------------------------------------

    def finish(self, fin: Finish, now: int) -> list[Notice]:
        self._dirty = True
        key = self.key(fin.transfer_id, fin.request_id)
        if key in self.held or (key in self.leases and self.leases[key].finish is not None):
            raise LeaseMisuseError(f"request {key} finished twice")
        if key in self.finished:
            raise LeaseMisuseError(f"request {key} already ended ({self.finished[key].value})")
        waiting = {k: v for k, v in self.leases.items() if v.state is _W}
        cands = self._candidates(
            fin.transfer_id, fin.request_id, waiting, lambda x: (x.reg.transfer_id, x.reg.request_id)
        )
        if len(cands) > 1:
            self._count("ambiguous")
            self._finished(key, NoticeKind.FAILED, now)
            self._emit(
                NoticeKind.HELD_DROPPED, fin, f"ambiguous: {len(cands)} registrations share its base id"
            )
            return self._drain()
        if cands:
            self._count("matched_registration_first")  # the registration waited for this finish
            self._step(self.leases[cands[0]], LeaseIn.MATCH, now, fin)
        else:
            self.held[key] = (fin, now + self.match_ns)
        return self._drain()

    def post(self, transfer_id: str, request_id: str, now: int) -> PushReg | None:
        """Prefill is about to post one write: the registration it writes into, or None when the
        lease is over (then nothing may be written; the notices say why)."""
        self._dirty = True
        lease = self._matched(transfer_id, request_id)
        if lease.state is _M and lease.deadline <= now:
            self._step(lease, LeaseIn.EXPIRE, now)
        if lease.state is not _M:
            return None
        self._step(lease, LeaseIn.POST, now)
        return lease.reg

    def write_done(self, transfer_id: str, request_id: str, ok: bool, now: int) -> list[Notice]:
        self._dirty = True
        lease = self._matched(transfer_id, request_id)
        if lease.inflight <= 0:
            raise LeaseMisuseError(f"write of {transfer_id or request_id} finished but none is in flight")
        self._step(lease, LeaseIn.WRITE_DONE if ok else LeaseIn.WRITE_FAILED, now)
        return self._drain()

    def post_failed(self, transfer_id: str, request_id: str, reason: str, now: int) -> list[Notice]:
        """A write prefill could not post (gap C2): decode hears it at once."""
        self._dirty = True
        lease = self._matched(transfer_id, request_id)
        if lease.state is _M:
            self._step(lease, LeaseIn.POST_FAILED, now, f"write could not be posted: {reason}")
        return self._drain()

    def complete(self, transfer_id: str, request_id: str, now: int) -> list[Notice]:
        """Prefill posted its last write of the request."""
        self._dirty = True
        lease = self._matched(transfer_id, request_id)
        if lease.state is _M:
            self._step(lease, LeaseIn.COMPLETE, now)
        return self._drain()

    def _matched(self, transfer_id: str, request_id: str) -> Lease:
        lease = self.leases.get(self.key(transfer_id, request_id))
        if lease is None or lease.finish is None:
            # The scheduler may only write a request the registry matched for it.
            raise LeaseMisuseError(f"no matched registration for {transfer_id or request_id}")
        return lease

    # --- time --------------------------------------------------------------------------------------

    def tick(self, now: int) -> list[Notice]:
        self._dirty = True
        for key in self._tomb.pop_due(now):
            self.finished.pop(key, None)  # type: ignore[arg-type]
            self.expired_at.pop(key, None)  # type: ignore[arg-type]
        for lease in list(self.leases.values()):
            if lease.state is _W and lease.watchdog <= now:
                self._step(lease, LeaseIn.WATCHDOG, now)
            elif lease.state in (_W, _M) and lease.deadline <= now:
                self._step(lease, LeaseIn.EXPIRE, now)
        for key, (fin, wd) in list(self.held.items()):
            if wd <= now:
                del self.held[key]
                self._count("held_dropped")
                self._finished(key, NoticeKind.FAILED, now)
                self._emit(NoticeKind.HELD_DROPPED, fin, "no registration arrived (watchdog)")
        return self._drain()

    def next_deadline(self) -> int | None:
        # Asked after every event by the driver: recomputed only after something changed.
        if not self._dirty:
            return self._next
        self._dirty = False
        self._next = self._compute_next()
        return self._next

    def _compute_next(self) -> int | None:
        # A waiting lease ends at its watchdog or its lease deadline, whichever comes first.
        times = [
            min(x.watchdog, x.deadline) if x.state is _W else x.deadline
            for x in self.leases.values()
            if x.state is not _F
        ]
        times += [wd for _, wd in self.held.values()]
        t = self._tomb.next()
        if t is not None:
            times.append(t)
        return min(times) if times else None

    def live_for(self, request_id: str) -> list[Lease]:
        """Live (not fencing) registrations whose request id is ``request_id``."""
        return [x for x in self.leases.values() if x.reg.request_id == request_id and x.state is not _F]

    # --- the table ----------------------------------------------------------------------------------

    def _step(self, lease: Lease, inp: LeaseIn, now: int, *args: Any) -> None:
        fire(LEASE_TABLE, lease, inp, self, now, *args)
        if lease.state is _D:
            key = self.key(lease.reg.transfer_id, lease.reg.request_id)
            if self.leases.get(key) is lease:
                del self.leases[key]
            assert lease.outcome is not None
            self._finished(key, lease.outcome, now)

    def _finished(self, key: str, how: NoticeKind, now: int) -> None:
        self.finished[key] = how
        self._tomb.set(key, now + self.tombstone_ns)


# --- handlers: (lease, registry, now, *args) -> outcome; the table names the next state ----------


def _h_match(lease: Lease, reg: LeaseRegistry, now: int, fin: Finish) -> str:
    lease.finish = fin
    reg._emit(NoticeKind.MATCHED, lease)
    return "matched"


def _h_post(lease: Lease, reg: LeaseRegistry, now: int) -> str:
    lease.inflight += 1
    lease.writes.append(now)
    return "stay"


def _h_write_done(lease: Lease, reg: LeaseRegistry, now: int) -> str:
    lease.inflight -= 1
    if lease.complete and lease.inflight == 0:
        return _end(lease, reg, NoticeKind.DELIVERED, "")
    return "stay"


def _h_complete(lease: Lease, reg: LeaseRegistry, now: int) -> str:
    lease.complete = True
    return _end(lease, reg, NoticeKind.DELIVERED, "") if lease.inflight == 0 else "stay"


def _h_write_failed(lease: Lease, reg: LeaseRegistry, now: int) -> str:
    lease.inflight -= 1
    return _over(lease, reg, NoticeKind.FAILED, "a write failed", now)


def _h_fenced_write(lease: Lease, reg: LeaseRegistry, now: int) -> str:
    """A write of a lease that is over finished (either way): release once none is left."""
    lease.inflight -= 1
    if lease.inflight:
        return "fencing"
    assert lease.outcome is not None
    return _end(lease, reg, lease.outcome, lease.over, notify=False)


def _ends_with(kind: NoticeKind, why: str) -> Callable[..., str]:
    def handler(lease: Lease, reg: LeaseRegistry, now: int, reason: str = "") -> str:
        if kind is NoticeKind.EXPIRED:
            # Writes are allowed strictly before this instant: what a checker compares them with.
            reg.expired_at[reg.key(lease.reg.transfer_id, lease.reg.request_id)] = lease.deadline
        return _over(lease, reg, kind, reason or why, now)

    return handler


def _over(lease: Lease, reg: LeaseRegistry, kind: NoticeKind, reason: str, now: int) -> str:
    if lease.inflight:
        # Writes in flight: decode hears it now; its blocks are released once they finished.
        lease.over, lease.outcome = reason, kind
        reg._count(f"fencing_{kind.value}")
        reg._emit(kind, lease, reason)
        return "fencing"
    return _end(lease, reg, kind, reason)


def _end(lease: Lease, reg: LeaseRegistry, kind: NoticeKind, reason: str, notify: bool = True) -> str:
    lease.outcome = kind
    reg._count(kind.value)
    if notify:
        reg._emit(kind, lease, reason)
    if kind is not NoticeKind.DELIVERED:
        reg._emit(NoticeKind.RELEASED, lease, reason)
    return "done"


def _h_supersede(lease: Lease, reg: LeaseRegistry, now: int) -> str:
    # The old process is gone: its blocks with it, and writes to its dead agent end in ERR.
    lease.inflight = 0
    lease.outcome = NoticeKind.FAILED
    reg._count("superseded")
    return "done"


_EXPIRED = _ends_with(NoticeKind.EXPIRED, "lease expired")
_ABORTED = _ends_with(NoticeKind.FAILED, "aborted by decode")
_POST_FAILED = _ends_with(NoticeKind.FAILED, "a write could not be posted")
_NEVER = _ends_with(NoticeKind.FAILED, "never matched (watchdog)")

LEASE_TABLE: dict[LeaseState, dict[LeaseIn, Transition]] = {
    _W: {
        LeaseIn.MATCH: Transition(_h_match, {"matched": _M}),
        LeaseIn.EXPIRE: Transition(_EXPIRED, {"done": _D}),
        LeaseIn.ABORT: Transition(_ABORTED, {"done": _D}),
        LeaseIn.WATCHDOG: Transition(_NEVER, {"done": _D}),
        LeaseIn.SUPERSEDE: Transition(_h_supersede, {"done": _D}),
    },
    _M: {
        LeaseIn.POST: Transition(_h_post, {"stay": _M}),
        LeaseIn.WRITE_DONE: Transition(_h_write_done, {"stay": _M, "done": _D}),
        LeaseIn.WRITE_FAILED: Transition(_h_write_failed, {"fencing": _F, "done": _D}),
        LeaseIn.COMPLETE: Transition(_h_complete, {"stay": _M, "done": _D}),
        LeaseIn.EXPIRE: Transition(_EXPIRED, {"fencing": _F, "done": _D}),
        LeaseIn.ABORT: Transition(_ABORTED, {"fencing": _F, "done": _D}),
        LeaseIn.POST_FAILED: Transition(_POST_FAILED, {"fencing": _F, "done": _D}),
        LeaseIn.SUPERSEDE: Transition(_h_supersede, {"done": _D}),
    },
    _F: {
        LeaseIn.WRITE_DONE: Transition(_h_fenced_write, {"fencing": _F, "done": _D}),
        LeaseIn.WRITE_FAILED: Transition(_h_fenced_write, {"fencing": _F, "done": _D}),
        LeaseIn.SUPERSEDE: Transition(_h_supersede, {"done": _D}),
    },
    _D: {},
}
