"""Wire format: versioned msgspec structs, encoded with msgpack. No pickle, no positional frames.

Two families travel between a prefill rank and a decode rank:

- Control messages (``Control`` union, tagged by the ``t`` field) over the control plane (ZMQ
  in the real backend): registration, per-room TransferInfo, failure and its ack, abort and its
  fence ack, heartbeats.
- Notification payloads (``ChunkNote``) attached to a WRITE (or sent alone for a chunk that
  moves no bytes): which room, incarnation, sender, chunk and token range just landed.

Decoding validates types, sizes and ranges (msgspec constraints plus ``__post_init__`` checks)
and turns every failure into ``WireError``; callers count it and carry on.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec
from kvferry.core.errors import WireError

__all__ = [
    "MAX_PAGES",
    "MAX_ROOM",
    "PROTOCOL_VERSION",
    "Abort",
    "ChunkNote",
    "Control",
    "Endpoint",
    "FailedAck",
    "GeometryWire",
    "Heartbeat",
    "InfoAck",
    "LayerNote",
    "PullOffer",
    "Pulled",
    "ReadsStopped",
    "RegionAddr",
    "Register",
    "RegisterAck",
    "RoomFailed",
    "StagingReq",
    "StagingRsp",
    "Stopped",
    "TransferInfo",
    "Watermark",
    "decode_control",
    "decode_layer_note",
    "decode_note",
    "encode",
    "registration_id",
]

PROTOCOL_VERSION = 1
MAX_ROOM = 2**63  # bootstrap_room is a 63-bit id
MAX_PAGES = 1 << 22  # a room larger than 4M pages is garbage, not a request
MAX_TOKENS = 1 << 31

Room = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM - 1)]
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
PageId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Addr = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Reason = Annotated[str, msgspec.Meta(max_length=2048)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Blob = Annotated[bytes, msgspec.Meta(max_length=1 << 20)]


def _check_version(v: int) -> None:
    if v != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {v} not supported (this side speaks {PROTOCOL_VERSION})")


class Endpoint(msgspec.Struct, frozen=True, order=True, gc=False):
    """Identity of one rank of one server: the key for multi-sender accounting (never a PP rank)."""

    server: Name
    rank: Rank

    def __str__(self) -> str:
        return f"{self.server}#{self.rank}"


class RegionAddr(msgspec.Struct, frozen=True):
    """One registered region of the registering rank: the id descriptors use, and where it lives."""

    region_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
    addr: Addr
    nbytes: Annotated[int, msgspec.Meta(ge=1, lt=1 << 48)]


class GeometryWire(msgspec.Struct, frozen=True):
    """A PoolGeometry as plain fields (core.geometry stays free of msgspec)."""

    model_name: Name
    num_layers: Annotated[int, msgspec.Meta(ge=1, lt=1 << 12)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1, lt=1 << 12)]
    head_dim: Annotated[int, msgspec.Meta(ge=1, lt=1 << 16)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    is_mla: bool
    tp_size: Annotated[int, msgspec.Meta(ge=1, lt=1 << 12)]
    tp_rank: Rank
    page_size: Annotated[int, msgspec.Meta(ge=1, lt=1 << 16)]
    num_pages: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    layout: Annotated[str, msgspec.Meta(max_length=32)]
    fused_kv: bool = False

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} >= tp_size {self.tp_size}")

    @classmethod
    def from_pool(cls, pool: Any) -> GeometryWire:
        m = pool.model
        return cls(
            model_name=m.name,
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=str(m.dtype.value),
            is_mla=m.is_mla,
            tp_size=pool.tp_size,
            tp_rank=pool.tp_rank,
            page_size=pool.page_size,
            num_pages=pool.num_pages,
            layout=str(pool.layout.value),
            fused_kv=m.fused_kv,
        )

    def to_pool(self) -> Any:
        """The PoolGeometry it describes; GeometryError if the fields cannot exist together."""
        from kvferry.core.geometry import ModelGeometry, PoolGeometry

        model = ModelGeometry(
            self.model_name, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.is_mla,
            fused_kv=self.fused_kv,
        )  # fmt: skip
        return PoolGeometry(model, self.tp_size, self.tp_rank, self.page_size, self.num_pages, self.layout)


# gc=False: plain data that never forms a reference cycle, so the cycle collector need not
# track the many short-lived instances (fewer collections on the hot path).
class _Msg(msgspec.Struct, frozen=True, tag_field="t", kw_only=True, gc=False):
    v: int = PROTOCOL_VERSION
    src: Endpoint

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:  # inline test: this runs for every message and note
            _check_version(self.v)


class Register(_Msg, tag="reg"):
    """Decode rank -> prefill rank, once per peer: who I am, my agent, my regions and geometry."""

    agent_name: Name
    agent_meta: Blob
    geometry: GeometryWire
    regions: Annotated[list[RegionAddr], msgspec.Meta(max_length=1 << 14)]
    aux_addr: Addr
    aux_row_bytes: Annotated[int, msgspec.Meta(ge=8, lt=1 << 20)]
    aux_rows: Count
    # What else this rank can receive (core.flows): a staging ring and a pinned bounce region,
    # each registered among ``regions`` under the ids in core.flows.regions; 0 = not offered.
    ring_bytes: Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)] = 0
    pinned_bytes: Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)] = 0

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:  # inline test: this runs for every message and note
            _check_version(self.v)
        if self.geometry.tp_rank != self.src.rank:
            raise ValueError(f"geometry rank {self.geometry.tp_rank} != sender rank {self.src.rank}")
        ids = [r.region_id for r in self.regions]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate region ids")


class RegisterAck(_Msg, tag="reg_ack"):
    """Prefill rank -> decode rank: registration accepted (ok) or refused with a reason."""

    ok: bool
    retry: bool = False  # refused because the sender does not know us (yet): register again
    reason: Reason = ""


class Heartbeat(_Msg, tag="hb"):
    """Either direction, periodic: I am alive. Any message counts as liveness; this one is spare.
    ``rooms`` (decode -> prefill): the rooms decode still waits on from this prefill rank; each
    renews that room's push registration lease (core/resources/leases.py)."""

    rooms: Annotated[list[Room], msgspec.Meta(max_length=1 << 16)] = []


class TransferInfo(_Msg, tag="info"):
    """Decode rank -> prefill rank, per room: where to write, what to expect, who else is coming.

    ``expected_infos``: how many decode ranks will send this prefill rank a TransferInfo for the
    room (from ``receivers_for``); the prefill room is WaitingForInput once it has that many.
    ``dummy``: this prefill rank writes nothing to this decode rank but must still finish.
    ``send_aux``: this prefill rank writes the aux row (exactly one sender per decode rank does).
    ``reg``: which registration (incarnation) of the decode rank these pages belong to; a prefill
    rank writes only while it holds that same registration, so a decode rank that restarted (new
    agent, same endpoint, same page ids reused) never receives a write meant for its past life.
    """

    room: Room
    transfer_id: TransferId
    reg: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # registration_id() of the sender's Register
    dst_pages: Annotated[list[PageId], msgspec.Meta(max_length=MAX_PAGES)]
    num_tokens: Tokens
    aux_index: Count
    send_aux: bool
    dummy: bool
    expected_infos: Annotated[int, msgspec.Meta(ge=1, lt=1 << 12)]
    token_start: Tokens = 0  # decode holds [0, token_start) already (a prefix hit): send the rest

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:  # inline test: this runs for every message and note
            _check_version(self.v)
        if self.dummy and self.send_aux:
            raise ValueError("a dummy sender cannot carry the aux row")
        if self.token_start > self.num_tokens:
            raise ValueError(f"token_start {self.token_start} past the {self.num_tokens} tokens")


class InfoAck(_Msg, tag="info_ack"):
    """Prefill -> decode: your TransferInfos for these rooms reached me (stop resending). A lost
    TransferInfo would otherwise keep the room waiting for its deadline, and with a staging ring
    its granted space pinned for every room behind it."""

    room: Room
    transfer_id: TransferId
    # Further rooms answered by this one message: prefill owes its InfoAcks a quarter of a
    # heartbeat interval and sends what its notes did not answer together (core/info_acks.py).
    more: Annotated[list[tuple[Room, TransferId]], msgspec.Meta(max_length=1 << 16)] = []


class RoomFailed(_Msg, tag="failed"):
    """Either direction: this room failed on my side, and why (so no counter waits forever)."""

    room: Room
    transfer_id: TransferId
    reason: Reason


class FailedAck(_Msg, tag="failed_ack"):
    """Answer to RoomFailed (decode -> prefill): your failure notice reached me, stop resending it.

    ``known``: the room (live or tombstoned) was here, so this side now reports Failed for it too;
    False when the room was unknown (restarted since, or its tombstone expired), so nothing could
    be recorded.
    """

    room: Room
    transfer_id: TransferId
    known: bool


class Abort(_Msg, tag="abort"):
    """Decode -> prefill: stop writing into this room's pages and confirm with Stopped."""

    room: Room
    transfer_id: TransferId
    reason: Reason


class Stopped(_Msg, tag="stopped"):
    """Prefill -> decode: the fence. No write of mine for this room is or will be in flight."""

    room: Room
    transfer_id: TransferId


class PullOffer(_Msg, tag="pull_offer"):
    """Prefill -> decode (pull flow): chunk ``chunk_index`` (tokens ``[token_start, token_end)``)
    is computed and sits in ``src_pages`` (prefill's page ids covering the room from token 0);
    READ it, then answer ``Pulled``. Prefill keeps the pages until every offered chunk was
    pulled, or until decode says it stopped reading (``ReadsStopped``), or its fence deadline.
    ``registration`` is prefill's own Register (agent, regions, geometry): decode needs it to READ,
    and carrying it in every offer makes each offer usable alone, in any order. Resent each
    heartbeat interval until answered."""

    room: Room
    transfer_id: TransferId
    registration: Register
    chunk_index: Count
    token_start: Tokens
    token_end: Tokens
    is_last: bool
    src_pages: Annotated[list[PageId], msgspec.Meta(max_length=MAX_PAGES)]

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:  # inline test: this runs for every message and note
            _check_version(self.v)
        if self.token_end < self.token_start:
            raise ValueError(f"token range [{self.token_start}, {self.token_end}) is reversed")
        if self.registration.src != self.src:
            raise ValueError("an offer carries its sender's own registration")


class Pulled(_Msg, tag="pulled"):
    """Decode -> prefill (pull flow): my READ of chunk ``chunk_index`` finished; those pages are
    yours again as far as I am concerned. Answers every copy of the offer."""

    room: Room
    transfer_id: TransferId
    chunk_index: Count


class ReadsStopped(_Msg, tag="reads_stopped"):
    """Decode -> prefill (pull flow), the reverse fence: the room failed here and no READ of
    mine from your pages is or will be in flight; you may free them."""

    room: Room
    transfer_id: TransferId


StagedFlow = Literal["ring", "pinned"]
Offset = Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)]
Round = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]


class StagingReq(_Msg, tag="stg_req"):
    """Prefill -> decode: staging space for one chunk of a room (ahead of need, resent until
    answered). Every writer of a decode rank asks; the writers of one chunk share one allocation,
    granted to all of them on the first request. ``again``: a resend (the grant may have been
    lost); a first request for a chunk already granted is not answered, its grant is on its way."""

    room: Room
    transfer_id: TransferId
    flow: StagedFlow
    chunk_index: Count
    token_start: Tokens
    token_end: Tokens
    again: bool = False

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:  # inline test: this runs for every message and note
            _check_version(self.v)
        if self.token_end <= self.token_start:
            raise ValueError(f"token range [{self.token_start}, {self.token_end}) is empty or reversed")


class StagingRsp(_Msg, tag="stg_rsp"):
    """Decode -> every writer of the chunk: where to write (``offset``: this writer's block inside
    the allocation ``[start, end)`` of ``round``), and decode's current watermark. Refused (not
    ``ok``) when the chunk can never fit; the room then fails with ``reason``."""

    room: Room
    transfer_id: TransferId
    chunk_index: Count
    reg: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    ok: bool = True
    reason: Reason = ""
    alloc_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)] = 0
    round: Round = 0
    start: Offset = 0
    end: Offset = 0
    offset: Offset = 0
    flow: StagedFlow = "ring"
    wm_round: Round = 0
    wm_offset: Offset = 0


class Watermark(_Msg, tag="wm"):
    """Decode -> prefill: the oldest live allocation of decode's staging ring (round, offset);
    space before it in the previous round is free to overwrite. For the pinned pool
    (``pool="pinned"``) ``round`` is the grant sequence number of the oldest live reservation:
    grants before it are scattered. Monotone; ``reg`` names the registration (incarnation)."""

    reg: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    round: Round
    offset: Offset
    pool: StagedFlow = "ring"


Control = (
    Register
    | RegisterAck
    | Heartbeat
    | TransferInfo
    | InfoAck
    | RoomFailed
    | FailedAck
    | Abort
    | Stopped
    | StagingReq
    | StagingRsp
    | Watermark
    | PullOffer
    | Pulled
    | ReadsStopped
)


class ChunkNote(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Notification payload carried by a chunk's WRITE (``aux``: the aux-row write of the room;
    ``dummy``: sent alone by a dummy sender when it ran its last chunk)."""

    v: int = PROTOCOL_VERSION
    room: Room
    transfer_id: TransferId
    src: Endpoint
    chunk_index: Count
    token_start: Tokens
    token_end: Tokens
    is_last: bool
    aux: bool = False
    dummy: bool = False  # a dummy sender's "done": no bytes came with it
    staged: Annotated[int, msgspec.Meta(ge=-1, lt=1 << 62)] = -1  # staging allocation the bytes landed in

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:  # inline test: this runs for every message and note
            _check_version(self.v)
        if self.dummy and (self.aux or not self.is_last):
            raise ValueError("a dummy note is the last one and carries no aux row")
        if self.staged >= 0 and (self.aux or self.dummy):
            raise ValueError("aux and dummy notes are never staged")
        if self.token_end < self.token_start:
            raise ValueError(f"token range [{self.token_start}, {self.token_end}) is reversed")


class LayerNote(ChunkNote, frozen=True, kw_only=True, gc=False):
    """A chunk note that may name the layers its WRITE carried (the layer-wise flow: one WRITE
    per reported layer range). ``layer_end == 0``: a whole-chunk note. A subclass, so that every
    other flow's notes encode exactly as before; decode reads every note as one."""

    layer_start: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0
    layer_end: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0

    def __post_init__(self) -> None:
        ChunkNote.__post_init__(self)
        if self.layer_end and (self.aux or self.dummy or self.staged >= 0):
            raise ValueError("aux, dummy and staged notes name no layers")
        if self.layer_end and self.layer_start >= self.layer_end:
            raise ValueError(f"layer range [{self.layer_start}, {self.layer_end}) is empty")


def registration_id(reg: Register) -> int:
    """A 63-bit digest of a Register: equal for a resent Register, different after a restart
    (a new agent brings new metadata)."""
    digest = hashlib.blake2b(_encoder.encode(reg), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(Control)
_note_decoder = msgspec.msgpack.Decoder(ChunkNote)
_layer_note_decoder = msgspec.msgpack.Decoder(LayerNote)


def encode(msg: Control | ChunkNote) -> bytes:  # a LayerNote is a ChunkNote
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, data: object, what: str) -> Any:
    # ``type(...) is bytes`` first: what every transport hands over, and far cheaper than an
    # isinstance test against a union (~150 ns on every message and note).
    if type(data) is not bytes and not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        return decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise WireError(f"{what}: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # Defensive: msgspec wraps validation errors, but nothing from bad bytes may escape untyped.
        raise WireError(f"{what}: {type(exc).__name__}: {exc}") from None


def decode_control(data: bytes) -> Control:
    """Decode and validate one control message; WireError on anything malformed."""
    return _decode(_control_decoder, data, "control message")


def decode_note(data: bytes) -> ChunkNote:
    """Decode and validate one notification payload; WireError on anything malformed."""
    return _decode(_note_decoder, data, "notification")


def decode_layer_note(data: bytes) -> LayerNote:
    """``decode_note`` for decode's engine: the layer range too (0, 0 for a whole-chunk note)."""
    return _decode(_layer_note_decoder, data, "notification")
