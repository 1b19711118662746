"""The push registration lease registry (core/resources/leases.py) against DESIGN section 6.

A Hypothesis state machine drives registrations, finishes, writes, heartbeats, aborts, decode
restarts, retries and time against one registry and checks after every step: at most one live
registration per request; nothing written under an expired lease; expired registrations
reclaimed; a retried request never pairs with another attempt's registration; blocks released
only with no write in flight. Example tests cover both orders reaching delivery and each failure
reaching decode. Two planted registries (a write after expiry, greedy suffix matching) prove the
machine's checks can fail.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from kvferry.core.resources.leases import (
    Finish,
    LeaseMisuseError,
    LeaseRegistry,
    LeaseState,
    NoticeKind,
    PushReg,
    strip_retry_suffix,
)

LEASE, MATCH = 100, 250


def reg(attempt: str, decode: str = "d0", inc: int = 0, tid: bool = True, start: int = 0) -> PushReg:
    return PushReg(
        transfer_id=f"t-{attempt}" if tid else "",
        request_id=attempt,
        decode=decode,
        incarnation=inc,
        blocks=(3, 9, 4),
        token_start=start,
        token_end=40,
    )


def fin(attempt: str, tid: bool = True) -> Finish:
    return Finish(f"t-{attempt}" if tid else "", attempt)


def kinds(notices: list[Any]) -> list[NoticeKind]:
    return [n.kind for n in notices]


# --- examples ------------------------------------------------------------------------------------


@pytest.mark.parametrize("register_first", [True, False])
def test_both_orders_deliver(register_first: bool) -> None:
    r = LeaseRegistry(LEASE, MATCH)
    first = r.register(reg("a-0"), 0) if register_first else r.finish(fin("a-0"), 0)
    assert kinds(first) == []
    second = r.finish(fin("a-0"), 5) if register_first else r.register(reg("a-0"), 5)
    assert kinds(second) == [NoticeKind.MATCHED]
    got = r.post("t-a-0", "a-0", 6)
    assert got is not None and got.blocks == (3, 9, 4)
    assert r.complete("t-a-0", "a-0", 7) == []
    out = r.write_done("t-a-0", "a-0", True, 8)
    assert kinds(out) == [NoticeKind.DELIVERED] and out[0].to_decode
    assert r.leases == {} and r.held == {}


def test_partial_prefix_hit_keeps_the_token_range_decode_asked_for() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    r.register(reg("a-0", start=16), 0)
    r.finish(fin("a-0"), 1)
    got = r.post("t-a-0", "a-0", 2)
    assert got is not None and (got.token_start, got.token_end) == (16, 40)  # not front-trimmed


def test_expired_lease_refuses_the_write_and_releases_the_blocks() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    r.register(reg("a-0"), 0)
    r.finish(fin("a-0"), 1)
    assert r.post("t-a-0", "a-0", LEASE) is None  # the deadline is exclusive
    assert r.finished["t-a-0"] is NoticeKind.EXPIRED
    assert r.leases == {}


def test_heartbeats_renew_and_expiry_fences_writes_in_flight() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    r.register(reg("a-0"), 0)
    r.finish(fin("a-0"), 1)
    assert r.renew("d0", 0, 90) == []
    assert r.post("t-a-0", "a-0", 150) is not None  # renewed at 90: runs to 190
    out = r.tick(190)
    assert kinds(out) == [NoticeKind.EXPIRED]  # told at once, blocks not yet released
    assert r.leases["t-a-0"].state is LeaseState.FENCING
    assert r.post("t-a-0", "a-0", 191) is None
    out = r.write_done("t-a-0", "a-0", True, 200)
    assert kinds(out) == [NoticeKind.RELEASED] and out[0].to_decode


def test_abort_after_registration_fences_before_release() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    r.register(reg("a-0"), 0)
    r.finish(fin("a-0"), 1)
    r.post("t-a-0", "a-0", 2)
    assert kinds(r.abort("t-a-0", "a-0", "d0", 3)) == [NoticeKind.FAILED]
    assert kinds(r.write_done("t-a-0", "a-0", True, 4)) == [NoticeKind.RELEASED]


def test_a_write_prefill_cannot_post_reaches_decode_at_once() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    r.register(reg("a-0"), 0)
    r.finish(fin("a-0"), 1)
    out = r.post_failed("t-a-0", "a-0", "descriptor outside the peer's regions", 2)
    assert kinds(out) == [NoticeKind.FAILED, NoticeKind.RELEASED]
    assert all(n.to_decode for n in out) and "descriptor" in out[0].reason


def test_watchdog_fails_registrations_and_finishes_that_never_match() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    r.register(reg("a-0"), 0)
    r.finish(fin("b-0"), 0)
    for t in range(0, MATCH, 50):
        r.renew("d0", 0, t)
    out = r.tick(MATCH)
    assert sorted(n.kind.value for n in out) == ["failed", "held_dropped", "released"]
    assert any("never matched" in n.reason for n in out)
    late = r.register(reg("b-0"), MATCH + 1)
    assert kinds(late) == [NoticeKind.REFUSED] and "late registration" in late[0].reason


def test_duplicate_and_conflicting_registrations() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    assert r.register(reg("a-0"), 0) == []
    assert r.register(reg("a-0"), 10) == []  # a resent PUSH_REG
    assert r.counters["duplicate_registration"] == 1
    out = r.register(reg("a-0", decode="d1"), 11)
    assert kinds(out) == [NoticeKind.REFUSED] and "already registered" in out[0].reason
    assert r.register(reg("a-0", inc=1), 12) == []  # d0 restarted: the new incarnation replaces it
    assert r.leases["t-a-0"].reg.incarnation == 1


def test_suffix_matching_only_when_configured_and_ambiguity_is_an_error() -> None:
    assert strip_retry_suffix("req-abc-12") == "req-abc" and strip_retry_suffix("abc") == "abc"
    plain = LeaseRegistry(LEASE, MATCH)
    assert kinds(plain.register(reg("a-1", tid=False), 0)) == [NoticeKind.REFUSED]
    r = LeaseRegistry(LEASE, MATCH, suffix_match=True)
    r.register(reg("a-1", tid=False), 0)
    r.register(reg("a-2", decode="d1", tid=False), 0)
    out = r.finish(fin("a-3", tid=False), 1)
    assert kinds(out) == [NoticeKind.HELD_DROPPED] and "ambiguous" in out[0].reason
    # A request with a router id never pairs by suffix with another attempt's registration.
    r2 = LeaseRegistry(LEASE, MATCH, suffix_match=True)
    r2.register(reg("a-0"), 0)
    assert r2.finish(fin("a-1"), 1) == []
    assert r2.leases["t-a-0"].finish is None


def test_local_misuse_raises() -> None:
    r = LeaseRegistry(LEASE, MATCH)
    with pytest.raises(LeaseMisuseError):
        r.post("t-x", "x", 0)
    r.finish(fin("a-0"), 0)
    with pytest.raises(LeaseMisuseError):
        r.finish(fin("a-0"), 1)


# --- the state machine ------------------------------------------------------------------------------

BASES = ("a", "b")
DECODES = ("d0", "d1")


class LeaseMachine(RuleBasedStateMachine):
    registry_class: type[LeaseRegistry] = LeaseRegistry

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.r: LeaseRegistry = None  # type: ignore[assignment]
        self.inc = dict.fromkeys(DECODES, 0)
        self.inflight: dict[str, int] = {}  # registry key -> writes we posted and not finished
        self.tid_less = False

    @initialize(suffix=st.booleans(), tid_less=st.booleans())
    def setup(self, suffix: bool, tid_less: bool) -> None:
        self.r = self.registry_class(LEASE, MATCH, suffix_match=suffix)
        self.tid_less = suffix and tid_less

    def _ready(self) -> bool:
        return self.r is not None

    def _check_notices(self, out: list[Any]) -> None:
        for n in out:
            key = self.r.key(n.transfer_id, n.request_id)
            if n.kind is NoticeKind.RELEASED and n.reason != "nothing registered":
                assert self.inflight.get(key, 0) == 0, f"blocks of {key} released with writes in flight"
            if n.kind is NoticeKind.MATCHED:
                lease = self.r.leases[key]
                f = lease.finish
                assert f is not None
                if f.transfer_id and lease.reg.transfer_id:
                    assert f.transfer_id == lease.reg.transfer_id, f"{f} paired with {lease.reg}"
                else:
                    assert strip_retry_suffix(f.request_id) == strip_retry_suffix(lease.reg.request_id)
                if f.transfer_id or lease.reg.transfer_id:
                    # One side has a router id: it must be the same attempt's.
                    assert f.request_id == lease.reg.request_id or not (
                        f.transfer_id and lease.reg.transfer_id
                    )

    @rule(base=st.sampled_from(BASES), attempt=st.integers(0, 2), d=st.sampled_from(DECODES))
    def register(self, base: str, attempt: int, d: str) -> None:
        if not self._ready():
            return
        tid = not (self.tid_less and attempt % 2)
        self._check_notices(self.r.register(reg(f"{base}-{attempt}", d, self.inc[d], tid=tid), self.now))

    @rule(base=st.sampled_from(BASES), attempt=st.integers(0, 2))
    def finish(self, base: str, attempt: int) -> None:
        if not self._ready():
            return
        with contextlib.suppress(LeaseMisuseError):  # finished twice: the scheduler's mistake, refused
            self._check_notices(self.r.finish(fin(f"{base}-{attempt}", tid=not self.tid_less), self.now))

    def _matched(self) -> list[Any]:
        return sorted(
            (k for k, x in self.r.leases.items() if x.finish is not None and x.state is LeaseState.MATCHED)
        )

    @rule(data=st.data())
    def post(self, data: st.DataObject) -> None:
        if not self._ready() or not self._matched():
            return
        key = data.draw(st.sampled_from(self._matched()))
        lease = self.r.leases[key]
        deadline = lease.deadline
        got = self.r.post(lease.reg.transfer_id, lease.reg.request_id, self.now)
        if got is not None:
            assert self.now < deadline, f"write posted at {self.now} under a lease that ended at {deadline}"
            self.inflight[key] = self.inflight.get(key, 0) + 1
        self._check_notices(self.r._drain())

    @rule(data=st.data(), ok=st.booleans())
    def write_done(self, data: st.DataObject, ok: bool) -> None:
        keys = sorted(k for k, n in self.inflight.items() if n > 0)
        if not self._ready() or not keys:
            return
        key = data.draw(st.sampled_from(keys))
        lease = self.r.leases[key]
        self.inflight[key] -= 1
        self._check_notices(self.r.write_done(lease.reg.transfer_id, lease.reg.request_id, ok, self.now))

    @rule(data=st.data(), kind=st.sampled_from(["complete", "post_failed", "abort"]))
    def end(self, data: st.DataObject, kind: str) -> None:
        if not self._ready() or not self._matched():
            return
        key = data.draw(st.sampled_from(self._matched()))
        x = self.r.leases[key].reg
        if kind == "complete":
            out = self.r.complete(x.transfer_id, x.request_id, self.now)
        elif kind == "post_failed":
            out = self.r.post_failed(x.transfer_id, x.request_id, "refused", self.now)
        else:
            out = self.r.abort(x.transfer_id, x.request_id, x.decode, self.now)
        self._check_notices(out)

    @rule(d=st.sampled_from(DECODES))
    def heartbeat(self, d: str) -> None:
        if self._ready():
            self._check_notices(self.r.renew(d, self.inc[d], self.now))

    @rule(d=st.sampled_from(DECODES))
    def restart(self, d: str) -> None:
        if not self._ready():
            return
        self.inc[d] += 1
        # The old process's writes die with it: nothing of them is in flight any more.
        for k, x in list(self.r.leases.items()):
            if x.reg.decode == d:
                self.inflight.pop(k, None)
        self._check_notices(self.r.renew(d, self.inc[d], self.now))

    @rule(dt=st.sampled_from([1, 10, 40, 99, 100, 150]), tick=st.booleans())
    def advance(self, dt: int, tick: bool) -> None:
        """Time passes; the deadline tick may come later than the deadline (a busy driver)."""
        if not self._ready():
            return
        self.now += dt
        if not tick:
            return
        self._check_notices(self.r.tick(self.now))
        for x in self.r.leases.values():  # expired registrations are reclaimed
            assert x.state is LeaseState.FENCING or x.deadline > self.now, x
            assert x.state is not LeaseState.WAITING or x.watchdog > self.now, x
        assert all(wd > self.now for _, wd in self.r.held.values())

    @invariant()
    def one_live_registration_per_request(self) -> None:
        if not self._ready():
            return
        for base in BASES:
            for attempt in range(3):
                live = self.r.live_for(f"{base}-{attempt}")
                assert len(live) <= 1, live
        for x in self.r.leases.values():
            if x.state is LeaseState.FENCING:
                assert x.inflight > 0  # a fencing lease waits for writes, else it is released
        assert self.r.next_deadline() == self.r._compute_next()  # the cached horizon is current


settings_ = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_lease_registry_state_machine() -> None:
    run_state_machine_as_test(LeaseMachine, settings=settings_)


# --- planted bugs: the machine must catch them ------------------------------------------------------


class _NoExpiryCheck(LeaseRegistry):
    """Planted: a write is allowed whatever the lease deadline (write after expiry)."""

    def post(self, transfer_id: str, request_id: str, now: int) -> PushReg | None:
        lease = self._matched(transfer_id, request_id)
        if lease.state is not LeaseState.MATCHED:
            return None
        lease.inflight += 1
        return lease.reg


class _GreedySuffix(LeaseRegistry):
    """Planted: suffix matching ignores the transfer ids (pairs a retry with an old attempt)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        kw["suffix_match"] = True
        super().__init__(*a, **kw)

    def _candidates(self, transfer_id: str, request_id: str, pool: dict[str, Any], tid_of: Any) -> list[str]:
        key = self.key(transfer_id, request_id)
        if key in pool:
            return [key]
        base = self.base_id(request_id)
        return sorted(k for k, v in pool.items() if self.base_id(tid_of(v)[1]) == base)[:1]


@pytest.mark.parametrize(
    ("planted", "message"), [(_NoExpiryCheck, "under a lease"), (_GreedySuffix, "paired")]
)
def test_planted_registry_bugs_are_caught(planted: type[LeaseRegistry], message: str) -> None:
    machine = type(f"Planted{planted.__name__}", (LeaseMachine,), {"registry_class": planted})
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(
            # Derandomized: the same search every run, so a pass here is not luck.
            machine,
            settings=settings(
                settings_,
                max_examples=600,
                database=None,
                derandomize=True,
                print_blob=True,
                phases=(Phase.generate,),  # finding it is the point; shrinking would only cost time
            ),
        )
