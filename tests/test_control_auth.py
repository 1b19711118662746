"""Authenticated control plane (docs/security.md): HMAC-SHA256 tags over real ZMQ
sockets, rejections counted by reason before anything reaches the caller, key rotation, replay
and old-incarnation rejection, sender binding, and the runtime refusing to start without a key
(or loading a peer's NIXL metadata when its Register is not authentic)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from kvferry.backends import pattern
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.backends.runtime.security import control_auth, message_src
from kvferry.backends.zmqctl import AuthConfigError, ControlAuth, ControlPlane, load_keys, pack_parts
from kvferry.backends.zmqctl.auth import ENV_KEY, HEADER
from kvferry.core import messages as m
from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll

OLD = b"old-key-0123456789abcdef"
NEW = b"new-key-0123456789abcdef"
OTHER = b"someone-else-0123456789"


def _recv(cp: ControlPlane, timeout_s: float = 30.0):
    # Liveness, not speed: a loaded 2-core CI box once took over 5 s to deliver a first frame over
    # a fresh connection (test_two_keys_rotate_without_downtime); a lost frame still fails here.
    msg = cp.recv(timeout_s)
    assert msg is not None, "no message within the timeout"
    return msg


def _until(pred, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < end:
        time.sleep(0.01)
    return pred()


@pytest.fixture
def receiver():
    b = ControlPlane("b", auth=ControlAuth((OLD,)), send_timeout_s=0.5)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(b.address)
    yield b, raw
    raw.close(0)
    b.close()


def _frames(auth: ControlAuth, payload: bytes, sender: bytes = b"a", to: bytes = b"b") -> list[bytes]:
    """What an authenticated plane named ``sender`` puts on the wire for ``to``."""
    return [sender, b"", auth.sign(sender, b"", to, payload), payload]


def _fence(b: ControlPlane, raw: zmq.Socket, auth: ControlAuth) -> None:
    """Send a good frame and wait for it: everything sent before it has been judged."""
    raw.send(pack_parts(_frames(auth, b"fence", sender=b"fence")))
    msg = _recv(b)
    assert msg.payload == b"fence", msg


def test_authenticated_round_trip_in_order():
    a = ControlPlane("a", auth=ControlAuth((OLD,)))
    b = ControlPlane("b", auth=ControlAuth((OLD,)))
    try:
        a.connect("b", b.address)
        for i in range(100):
            a.send("b", i.to_bytes(4, "little"))
        assert [int.from_bytes(_recv(b).payload, "little") for _ in range(100)] == list(range(100))
        b.send("a", b"pong")  # b learned a's reply address from an authentic frame
        assert _recv(a).payload == b"pong"
        assert not a.stats.rejected and not b.stats.rejected
    finally:
        a.close()
        b.close()


def test_concurrent_authenticated_senders_keep_order_and_are_never_taken_for_replays():
    """Threads sending to one peer at once (the runtime's API, control and worker threads do):
    every message arrives once, each thread's in its own order, and none is rejected: signing
    advances one sequence per plane, the receiver wants it strictly increasing per sender, so
    the sequence numbers must reach the wire in the order they were drawn."""
    import threading

    a = ControlPlane("a", auth=ControlAuth((OLD,)))
    b = ControlPlane("b", auth=ControlAuth((OLD,)))
    try:
        a.connect("b", b.address)
        a.send("b", b"hello")
        assert _recv(b).payload == b"hello"

        def burst(t: int) -> None:
            for i in range(200):
                a.send("b", bytes([t]) + i.to_bytes(4, "little"))

        threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        got: dict[int, list[int]] = {t: [] for t in range(4)}
        for _ in range(800):
            p = _recv(b).payload
            got[p[0]].append(int.from_bytes(p[1:], "little"))
        assert all(seq == list(range(200)) for seq in got.values())
        assert not b.stats.rejected
    finally:
        a.close()
        b.close()


def test_forged_frames_are_rejected_and_counted_by_reason(receiver):
    b, raw = receiver
    good = ControlAuth((OLD,))
    raw.send(pack_parts([b"a", b"", b"untagged payload"]))  # a plane without a key
    raw.send(pack_parts([b"a", b"", b"short header", b"payload"]))
    raw.send(pack_parts(_frames(ControlAuth((OTHER,)), b"signed with a key b does not hold")))
    f = _frames(good, b"original")
    raw.send(pack_parts([*f[:3], b"tampered"]))
    f = _frames(good, b"relabelled")
    raw.send(pack_parts([b"c", *f[1:]]))  # another sender name on a's frame
    raw.send(pack_parts(_frames(good, b"meant for c", to=b"c")))  # redirected to b
    f = _frames(good, b"bad tag")
    raw.send(pack_parts([f[0], f[1], f[2][:-1] + bytes([f[2][-1] ^ 1]), f[3]]))
    _fence(b, raw, good)
    assert dict(b.stats.rejected) == {"untagged": 2, "unknown_key": 1, "bad_tag": 4}
    assert b.recv(0.1) is None  # none of them reached the caller
    assert b.stats.received == 1


def test_replayed_and_old_incarnation_frames_are_rejected(receiver):
    b, raw = receiver
    first = ControlAuth((OLD,), incarnation=1_000)
    frame = _frames(first, b"once")
    raw.send(pack_parts(frame))
    assert _recv(b).payload == b"once"
    raw.send(pack_parts(frame))  # the same frame again: a replay
    restarted = ControlAuth((OLD,), incarnation=2_000)  # the peer restarted
    raw.send(pack_parts(_frames(restarted, b"new life")))
    assert _recv(b).payload == b"new life"
    raw.send(pack_parts(_frames(first, b"recorded from the old life")))  # validly signed, old
    stale = ControlAuth((OLD,), incarnation=3_000, clock_ns=lambda: time.time_ns() - 3600 * SEC)
    raw.send(pack_parts(_frames(stale, b"sent an hour ago")))
    _fence(b, raw, ControlAuth((OLD,)))
    assert dict(b.stats.rejected) == {"replayed": 1, "old_incarnation": 1, "stale": 1}


def test_two_keys_rotate_without_downtime():
    # (old) -> (old, new) -> (new, old) -> (new): at every step every pair still talks.
    stages = [(OLD,), (OLD, NEW), (NEW, OLD), (NEW,)]
    planes = [ControlPlane(f"p{i}", auth=ControlAuth(k)) for i, k in enumerate(stages)]
    try:
        for i, a in enumerate(planes):
            for j, b in enumerate(planes):
                if abs(i - j) <= 1 and i != j:  # neighbours in the rollout share a key
                    a.connect(b.identity, b.address)
                    a.send(b.identity, f"{i}->{j}".encode())
                    assert _recv(b).payload == f"{i}->{j}".encode()
        lone = ControlPlane("lone", auth=ControlAuth((OTHER,)))
        lone.connect("p0", planes[0].address)
        lone.send("p0", b"not ours")
        assert _until(lambda: planes[0].stats.rejected["unknown_key"] == 1)
        lone.close()
    finally:
        for p in planes:
            p.close()


def test_a_payload_naming_another_sender_is_rejected():
    b = ControlPlane("P#0", auth=ControlAuth((OLD,), src_of=message_src))
    a = ControlPlane("D#0", auth=ControlAuth((OLD,)))
    try:
        a.connect("P#0", b.address)
        a.send("P#0", m.encode(m.Heartbeat(src=m.Endpoint("D", 1))))  # D#0 speaking as D#1
        a.send("P#0", m.encode(m.Heartbeat(src=m.Endpoint("D", 0))))
        assert m.decode_control(_recv(b).payload).src == m.Endpoint("D", 0)
        assert dict(b.stats.rejected) == {"identity_mismatch": 1}
    finally:
        a.close()
        b.close()


def test_a_rejected_frame_teaches_no_reply_address(receiver):
    b, raw = receiver
    with zmq.Context.instance().socket(zmq.PULL) as trap:
        port = trap.bind_to_random_port("tcp://127.0.0.1")
        evil = f"tcp://127.0.0.1:{port}".encode()
        forged = ControlAuth((OTHER,))
        raw.send(pack_parts([b"mallory", evil, forged.sign(b"mallory", evil, b"b", b"hi"), b"hi"]))
        _fence(b, raw, ControlAuth((OLD,)))
        b.send("mallory", b"would leak")
        msg = _recv(b)
        assert msg.failed and msg.peer == "mallory"  # no route was learned
        assert trap.poll(200) == 0


def test_keys_from_config_file_and_environment(tmp_path: Path):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotation in progress\nhex:" + NEW.hex() + "\n" + OLD.decode() + "\n")
    assert load_keys(key_file=str(key_file), env={}) == (NEW, OLD)
    assert load_keys(env={ENV_KEY: f"{OLD.decode()},{NEW.decode()}"}) == (OLD, NEW)
    assert load_keys(["x" * 16], str(key_file), env={ENV_KEY: OLD.decode()}) == (b"x" * 16,)
    assert load_keys(env={}) == ()
    for bad, why in [
        (["short"], "at least 16 bytes"),
        (["a" * 16, "b" * 16, "c" * 16], "1 or 2 control keys"),
        (["hex:zz"], "not hexadecimal"),
    ]:
        with pytest.raises(AuthConfigError, match=why):
            load_keys(bad, env={})
    with pytest.raises(AuthConfigError, match="control key file"):
        load_keys(key_file=str(tmp_path / "missing"), env={})


def test_no_key_refuses_to_start_and_insecure_warns(monkeypatch, caplog):
    monkeypatch.delenv(ENV_KEY, raising=False)
    with pytest.raises(AuthConfigError, match="control_insecure=True"):
        control_auth(RuntimeConfig())
    with caplog.at_level(logging.WARNING):
        assert control_auth(RuntimeConfig(control_insecure=True)) is None
        ControlPlane("x", auth=None).close()
    assert "UNAUTHENTICATED" in caplog.text


MODEL = ModelGeometry("auth", num_layers=1, num_kv_heads=2, head_dim=8)
TIMEOUTS = Timeouts(
    bootstrap_ns=2 * SEC,
    waiting_ns=10 * SEC,
    transfer_ns=10 * SEC,
    heartbeat_interval_ns=100 * MS,
    heartbeat_timeout_ns=5 * SEC,
    fence_ns=4 * SEC,
    tombstone_ns=30 * SEC,
)


def _pair(pre_keys: tuple[str, ...], dec_keys: tuple[str, ...]):
    pre = PrefillEndpoint(
        "P", PoolGeometry(MODEL, 1, 0, 4, 16), config=RuntimeConfig(control_keys=pre_keys, timeouts=TIMEOUTS)
    )
    dec = DecodeEndpoint(
        "D",
        PoolGeometry(MODEL, 1, 0, 4, 16),
        prefill_server="P",
        prefill_addresses=[pre.address],
        config=RuntimeConfig(control_keys=dec_keys, timeouts=TIMEOUTS),
    )
    pre.start()
    dec.start()
    return pre, dec


def _room(pre, dec, room: int):
    pages = np.arange(4)
    rv = dec.receiver(room, f"t{room}")
    rv.init(pages, 10, 0)
    pattern.fill(pre.pool, pre.transport.region, room, pages, 0, 10)
    tx = pre.sender(room, f"t{room}")
    tx.write_aux(0, room.to_bytes(8, "little"))
    tx.init(0)
    tx.send(pages, 10, is_last=True)
    return rv.wait(15.0), tx.wait(15.0)


def test_runtime_rooms_run_over_authenticated_control_during_rotation():
    pre, dec = _pair(("a" * 16, "b" * 16), ("b" * 16, "a" * 16))  # mid-rotation: either signs
    try:
        assert _room(pre, dec, 5) == (KVPoll.Success, KVPoll.Success)
        for e in (pre, dec):
            assert not e.transport.control.stats.rejected
    finally:
        assert pre.close() == [] and dec.close() == []


def test_runtime_never_loads_nixl_metadata_of_an_unauthenticated_register():
    pre, dec = _pair(("a" * 16,), ("z" * 16,))
    try:
        assert _room(pre, dec, 6) == (KVPoll.Failed, KVPoll.Failed)
        assert pre.transport.control.stats.rejected["unknown_key"] > 0
        with pre.lock:
            assert not pre.engine.peers  # the Register never reached the engine
        assert not pre.transport.agent._peers  # and no NIXL remote agent was added
    finally:
        assert pre.close() == [] and dec.close() == []


def test_header_size_is_fixed():
    h = ControlAuth((OLD,)).sign(b"a", b"", b"b", b"x")
    assert len(h) == HEADER


def test_the_tag_is_hmac_sha256_over_the_documented_byte_string() -> None:
    """The wire format, pinned: HMAC-SHA256(key, domain || fixed header || length-prefixed
    sender, reply address, recipient || payload), computed here part by part, as peers built
    before the one-call digest do: they must accept each other's frames."""
    import hashlib
    import hmac
    import struct

    auth = ControlAuth((OLD,), clock_ns=lambda: 1_000_000_000)
    parts = (b"prefill-0", b"tcp://127.0.0.1:5555", b"decode-0", b"payload \x00\xff bytes")
    header = auth.sign(*parts)
    fixed, tag = header[:-32], header[-32:]
    assert struct.unpack(">B8sQQQ", fixed)[-1] == 1  # the first sequence number
    mac = hmac.new(OLD, b"kvferry-control/1\x00", hashlib.sha256)
    mac.update(fixed)
    for p in parts[:3]:
        mac.update(len(p).to_bytes(4, "big") + p)
    mac.update(parts[3])
    assert tag == mac.digest()
    checker = ControlAuth((OLD,), clock_ns=lambda: 1_000_000_000)
    assert checker.check(parts[0], parts[1], parts[2], header, parts[3]) == ""
    assert checker.check(parts[0], parts[1], parts[2], header, parts[3] + b"!") == "bad_tag"
