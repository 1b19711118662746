"""Wire messages: round trips, typed rejection of invalid values, and a decoder fuzz."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core import messages as m
from kvferry.core.errors import WireError
from kvferry.core.geometry import ModelGeometry, PoolGeometry

EP = m.Endpoint("decode-a", 3)
POOL = PoolGeometry(ModelGeometry("tiny", 2, 4, 8), 4, 3, 16, 100)


def samples() -> list[Any]:
    return [
        m.Register(
            src=EP,
            agent_name="agent",
            agent_meta=b"\x00\x01meta",
            geometry=m.GeometryWire.from_pool(POOL),
            regions=[m.RegionAddr(region_id=i, addr=4096 * i, nbytes=4096) for i in range(4)],
            aux_addr=1 << 40,
            aux_row_bytes=64,
            aux_rows=128,
        ),
        m.RegisterAck(src=EP, ok=False, retry=True, reason="not registered"),
        m.Heartbeat(src=EP),
        m.TransferInfo(
            src=EP,
            room=(1 << 63) - 1,
            transfer_id="router-42",
            reg=12345,
            dst_pages=list(range(50)),
            num_tokens=800,
            aux_index=7,
            send_aux=True,
            dummy=False,
            expected_infos=2,
        ),
        m.RoomFailed(src=EP, room=1, transfer_id="t", reason="write ERR"),
        m.FailedAck(src=EP, room=1, transfer_id="t", known=True),
        m.Abort(src=EP, room=1, transfer_id="t", reason="timeout"),
        m.Stopped(src=EP, room=1, transfer_id="t"),
    ]


@pytest.mark.parametrize("msg", samples(), ids=lambda x: type(x).__name__)
def test_control_round_trip(msg: Any) -> None:
    data = m.encode(msg)
    assert m.decode_control(data) == msg
    assert b"pickle" not in data and data[:1] != b"\x80"  # msgpack map, not a pickle stream


def test_geometry_round_trip() -> None:
    assert m.GeometryWire.from_pool(POOL).to_pool() == POOL


def test_note_round_trip() -> None:
    n = m.ChunkNote(
        room=5, transfer_id="t", src=EP, chunk_index=2, token_start=10, token_end=20, is_last=True
    )
    assert m.decode_note(m.encode(n)) == n


def _raw(msg: Any, **changes: Any) -> bytes:
    d = msgspec.to_builtins(msg)
    d.update(changes)
    return msgspec.msgpack.encode(d)


INFO = samples()[3]


@pytest.mark.parametrize(
    "changes",
    [
        {"v": 2},
        {"room": -1},
        {"room": 1 << 63},
        {"transfer_id": ""},
        {"transfer_id": "x" * 300},
        {"dst_pages": [1, -2]},
        {"dst_pages": "abc"},
        {"num_tokens": "7"},
        {"expected_infos": 0},
        {"dummy": True, "send_aux": True},
        {"src": {"server": "x", "rank": -1}},
        {"t": "nope"},
        {"t": None},
    ],
)
def test_invalid_values_are_typed_rejections(changes: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        m.decode_control(_raw(INFO, **changes))


def test_missing_field_and_wrong_root_type() -> None:
    d = msgspec.to_builtins(INFO)
    del d["room"]
    for data in (msgspec.msgpack.encode(d), msgspec.msgpack.encode([1, 2, 3]), b"", "text"):
        with pytest.raises(WireError):
            m.decode_control(data)  # type: ignore[arg-type]


def test_note_rejects_reversed_range_and_bad_version() -> None:
    base = dict(room=1, transfer_id="t", src={"server": "p", "rank": 0}, chunk_index=0, is_last=False)
    with pytest.raises(WireError):
        m.decode_note(msgspec.msgpack.encode({**base, "token_start": 5, "token_end": 4}))
    with pytest.raises(WireError):
        m.decode_note(msgspec.msgpack.encode({**base, "token_start": 0, "token_end": 4, "v": 9}))


def test_register_rank_must_match_geometry() -> None:
    reg = samples()[0]
    with pytest.raises(WireError):
        m.decode_control(_raw(reg, src={"server": "d", "rank": 0}))


ENCODED = [m.encode(x) for x in samples()]


@settings(max_examples=400)
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    for decode in (m.decode_control, m.decode_note):
        with contextlib.suppress(WireError):
            decode(data)


@settings(max_examples=400)
@given(
    base=st.sampled_from(ENCODED),
    edits=st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from("rid")), max_size=6
    ),
)
def test_fuzz_mutated_messages(base: bytes, edits: list[tuple[int, int, str]]) -> None:
    buf = bytearray(base)
    for pos, byte, op in edits:
        i = pos % (len(buf) + 1)
        if op == "r" and i < len(buf):
            buf[i] = byte
        elif op == "i":
            buf.insert(i, byte)
        elif op == "d" and i < len(buf):
            del buf[i]
    try:
        msg = m.decode_control(bytes(buf))
    except WireError:
        return
    # Whatever decodes is a fully valid message: it re-encodes to an equal message.
    assert m.decode_control(m.encode(msg)) == msg
