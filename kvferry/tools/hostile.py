"""Hostile input at live endpoints: a bounded, seeded fuzzer of the control plane.

Real endpoints (two prefill ranks, TP 2 -> 1 decode rank, NIXL over UCX on DRAM, the ZMQ control
plane with its HMAC keys) move legitimate rooms while a fuzzer thread sends them frames of these
kinds, each drawn from one seed:

- ``random``: random parts, packed or as separate ZMQ frames or one unpacked frame (no valid
  shape, no tag);
- ``truncated``: a correctly signed frame with its payload or header cut short;
- ``oversized``: a correctly signed 1-4 MB payload of noise;
- ``garbage``: correctly signed msgpack that is no control message;
- ``out_of_range``: correctly signed control messages of every type from a peer that holds the
  key (an insider) but is no registered rank, with values drawn at and past every bound: page,
  region and aux indices, token ranges, chunk indices, staging offsets, registration ids, and the
  room ids of the live legitimate rooms under other transfer ids;
- ``impostor``: the same, naming a legitimate rank as sender from another identity;
- ``replayed``: a signed frame sent again;
- ``stale``: a legitimate rank's identity signed under an older incarnation, or a frame older
  than the plane's age limit.

The insider does not speak as a legitimate rank under a newer incarnation: with the key that is
a restart of that rank, and failing its rooms is then the right answer (docs/security.md).

Checked at the end (``violations``): every endpoint thread still alive and no error recorded
by a thread, every legitimate room Success on both sides with its bytes equal to the source, and
every decode page and aux row no legitimate room was given still holding its canary bytes. The
summary counts what each plane and engine rejected, by reason.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvferry.core import messages as m

__all__ = ["KINDS", "LiveFuzzConfig", "LiveFuzzResult", "run_live_fuzz"]

KINDS = ("random", "truncated", "oversized", "garbage", "out_of_range", "impostor", "replayed", "stale")
CANARY = 0xA5
PAGES, PAGE, AUX_ROWS = 64, 4, 16
LEGIT_PAGES, LEGIT_AUX = 32, 8  # legitimate rooms use only these; the rest must stay canary
WINDOW = 4  # legitimate rooms in flight


@dataclass(frozen=True)
class LiveFuzzConfig:
    seed: int = 0
    frames: int = 2000
    rooms: int = 40
    max_seconds: float = 60.0
    # Self-check of the checker: one stray byte written into a page no room owns, after the run.
    plant_stray_write: bool = False
    engine: str = "python"  # RuntimeConfig.nixl_engine of every endpoint (python or native)

    def problems(self) -> str:
        if not 0 <= self.seed < 1 << 63:
            return f"--seed must be in [0, 2**63), got {self.seed}"
        if not 0 <= self.frames <= 10_000_000:
            return f"--frames must be in [0, 10000000], got {self.frames}"
        if not 1 <= self.rooms <= 1_000_000:
            return f"--rooms must be in [1, 1000000], got {self.rooms}"
        if not 0 < self.max_seconds <= 86_400:
            return f"--max-seconds must be in (0, 86400], got {self.max_seconds}"
        if self.engine not in ("python", "native"):
            return f"engine must be python or native, got {self.engine!r}"
        return ""


@dataclass
class LiveFuzzResult:
    seed: int
    frames_sent: Counter[str] = field(default_factory=Counter)
    rooms_done: int = 0
    rooms_success: int = 0
    violations: list[str] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    stopped_early: bool = False
    executor: str = ""  # what the endpoints really ran (native falls back to python)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.stopped_early

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seed": self.seed,
            "frames_sent": dict(self.frames_sent),
            "frames_total": sum(self.frames_sent.values()),
            "rooms_done": self.rooms_done,
            "rooms_success": self.rooms_success,
            "violations": self.violations,
            "rejected": self.rejected,
            "wall_s": round(self.wall_s, 3),
            "stopped_early": self.stopped_early,
            "executor": self.executor,
        }


# ---- values at and past the bounds ------------------------------------------------------------
_EDGES = (-1, 0, 1, 3, 7, 15, 16, 31, 63, 64, 65, 255, 1 << 20, (1 << 31) - 1, 1 << 40, (1 << 63) - 1)


def _int(rng: random.Random) -> int:
    return rng.choice(_EDGES) if rng.random() < 0.7 else rng.randrange(-(1 << 40), 1 << 40)


def _ints(rng: random.Random) -> list[int]:
    return [_int(rng) for _ in range(rng.choice((0, 1, 2, 5, 64, 300)))]


class _Forger:
    """Builds control messages of every type with hostile values, as raw msgpack (so values past a
    schema's bounds go on the wire too: the receiver's validation must catch them)."""

    def __init__(self, rng: random.Random, live_rooms: Callable[[], list[int]]) -> None:
        self.rng = rng
        self.live_rooms = live_rooms

    def _room(self) -> int:
        live = self.live_rooms()
        return self.rng.choice(live) if live and self.rng.random() < 0.6 else _int(self.rng)

    def message(self, src: m.Endpoint) -> bytes:
        rng = self.rng
        tag = rng.choice(_TAGS)
        body: dict[str, Any] = {
            "t": tag,
            "v": m.PROTOCOL_VERSION,
            "src": {"server": src.server, "rank": src.rank},
        }
        room_fields = {
            "room": self._room(),
            "transfer_id": rng.choice(("", "x", "t0", "fuzz-" + str(rng.randrange(1 << 30)), "é" * 40)),
        }
        if tag not in _ROOMLESS_TAGS:
            body.update(room_fields)
        body.update(_per_tag_fields(rng).get(tag, {}))
        if rng.random() < 0.1:  # a field of the wrong type
            body[rng.choice(list(body))] = rng.choice((None, "s", 1.5, [1, 2], {"a": 1}))
        return msgspec.msgpack.encode(body)


_TAGS = (
    "reg",
    "hb",
    "info",
    "failed",
    "abort",
    "stopped",
    "pull_offer",
    "pulled",
    "stg_req",
    "stg_rsp",
    "wm",
    "info_ack",
    "failed_ack",
    "reads_stopped",
    "reg_ack",
)
_ROOMLESS_TAGS = ("reg", "hb", "wm", "reg_ack")


def _per_tag_fields(rng: random.Random) -> dict[str, dict[str, Any]]:
    """The fields of every tag, drawn on every call whatever the tag: the draws of a seed (and so
    each seed's frames) stay what they were when this was one dict in ``message``."""
    return {
        "reg": _reg_fields(rng),
        "hb": {"rooms": _ints(rng)},
        "info": {
            "reg": _int(rng),
            "dst_pages": _ints(rng),
            "num_tokens": _int(rng),
            "aux_index": _int(rng),
            "send_aux": rng.random() < 0.5,
            "dummy": rng.random() < 0.5,
            "expected_infos": _int(rng),
            "token_start": _int(rng),
        },
        "failed": {"reason": "fuzz"},
        "abort": {"reason": "fuzz"},
        "pulled": {"chunk_index": _int(rng)},
        **_staging_fields(rng),
        "pull_offer": {
            "chunk_index": _int(rng),
            "token_start": _int(rng),
            "token_end": _int(rng),
            "is_last": rng.random() < 0.5,
            "src_pages": _ints(rng),
            "registration": {},
        },
        "failed_ack": {"known": rng.random() < 0.5},
        "reg_ack": {"ok": rng.random() < 0.5},
    }


def _reg_fields(rng: random.Random) -> dict[str, Any]:
    """A registration with hostile geometry, regions and aux bounds."""
    return {
        "agent_name": "fuzz",
        "agent_meta": bytes(rng.randrange(256) for _ in range(rng.choice((0, 8, 64)))),
        "geometry": {
            "model_name": "x",
            "num_layers": _int(rng),
            "num_kv_heads": _int(rng),
            "head_dim": _int(rng),
            "dtype": "bf16",
            "is_mla": False,
            "tp_size": _int(rng),
            "tp_rank": _int(rng),
            "page_size": _int(rng),
            "num_pages": _int(rng),
            "layout": "sglang_nhd",
        },
        "regions": [
            {"region_id": _int(rng), "addr": _int(rng), "nbytes": _int(rng)}
            for _ in range(rng.choice((0, 1, 3)))
        ],
        "aux_addr": _int(rng),
        "aux_row_bytes": _int(rng),
        "aux_rows": _int(rng),
    }


def _staging_fields(rng: random.Random) -> dict[str, dict[str, Any]]:
    """The staging request, its response and the watermark, in that draw order."""
    return {
        "stg_req": {
            "flow": rng.choice(("ring", "pinned", "bogus")),
            "chunk_index": _int(rng),
            "token_start": _int(rng),
            "token_end": _int(rng),
        },
        "stg_rsp": {
            "chunk_index": _int(rng),
            "reg": _int(rng),
            "ok": rng.random() < 0.7,
            "alloc_id": _int(rng),
            "round": _int(rng),
            "start": _int(rng),
            "end": _int(rng),
            "offset": _int(rng),
            "flow": rng.choice(("ring", "pinned")),
        },
        "wm": {
            "reg": _int(rng),
            "round": _int(rng),
            "offset": _int(rng),
            "pool": rng.choice(("ring", "pinned")),
        },
    }


class _Sender:
    """Sends frames to the endpoints' control planes the way a peer's plane does: identity,
    reply address, then (authenticated planes) the HMAC header and the payload."""

    def __init__(self, keys: tuple[bytes, ...], targets: list[tuple[str, str]]) -> None:
        import zmq

        from kvferry.backends.zmqctl.auth import ControlAuth

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._socks = []
        for _identity, address in targets:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 10_000)
            s.connect(address)
            self._socks.append(s)
        self.targets = targets
        self.auth_now = ControlAuth(keys)
        self.auth_old = ControlAuth(keys, incarnation=1)  # older than any live rank's
        self.auth_past = ControlAuth(keys, clock_ns=lambda: time.time_ns() - 3600 * 10**9)
        self.reply = b"tcp://127.0.0.1:9"  # nobody listens: replies to the fuzzer go nowhere

    def raw(self, i: int, frames: list[bytes]) -> None:
        from kvferry.backends.zmqctl.plane import pack_parts

        # An endpoint whose inbox is full pushes back (zmq.Again): that is allowed, the frame drops.
        with contextlib.suppress(self._zmq.Again):
            self._socks[i].send(pack_parts(frames), self._zmq.NOBLOCK)

    def unpacked(self, i: int, frames: list[bytes]) -> None:
        """The parts as separate ZMQ frames, not packed: what an old or foreign peer sends."""
        with contextlib.suppress(self._zmq.Again):
            self._socks[i].send_multipart(frames, self._zmq.NOBLOCK)

    def signed(self, i: int, sender: str, payload: bytes, auth: Any = None) -> list[bytes]:
        auth = auth or self.auth_now
        recipient = self.targets[i][0].encode()
        header = auth.sign(sender.encode(), self.reply, recipient, payload)
        frames = [sender.encode(), self.reply, header, payload]
        self.raw(i, frames)
        return frames

    def close(self) -> None:
        for s in self._socks:
            s.close(0)


def _send_one(
    kind: str,
    rng: random.Random,
    tx: _Sender,
    forge: _Forger,
    legit: list[m.Endpoint],
    last: dict[str, tuple[int, list[bytes]]],
) -> None:
    i = rng.randrange(len(tx.targets))
    fake = m.Endpoint(server=rng.choice(("D", "P", "Z")), rank=rng.randrange(5, 9))
    if kind == "random":
        count = rng.randrange(1, 6)
        parts = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64))) for _ in range(count)]
        shape = rng.random()
        if shape < 0.5 and len(parts) <= 4:
            tx.raw(i, parts)  # well packed, nonsense inside
        elif shape < 0.8:
            tx.unpacked(i, parts)  # separate ZMQ frames
        else:
            tx.unpacked(i, [b"".join(parts)])  # one frame that is not a packed message
    elif kind == "truncated":
        frames = [
            str(fake).encode(),
            tx.reply,
            tx.auth_now.sign(str(fake).encode(), tx.reply, tx.targets[i][0].encode(), b"x"),
            forge.message(fake),
        ]
        cut = rng.randrange(4)
        frames[cut] = frames[cut][: rng.randrange(max(1, len(frames[cut])))]
        tx.raw(i, frames if rng.random() < 0.7 else frames[: rng.randrange(1, 4)])
    elif kind == "oversized":
        tx.signed(i, str(fake), rng.randbytes(rng.randrange(1 << 20, 4 << 20)))
    elif kind == "garbage":
        junk = rng.choice(({"t": "nope"}, [1, 2, 3], "str", {"t": "info", "src": 5}, None))
        tx.signed(i, str(fake), msgspec.msgpack.encode(junk))
    elif kind == "out_of_range":
        last["frame"] = (i, tx.signed(i, str(fake), forge.message(fake)))
    elif kind == "impostor":
        tx.signed(i, str(fake), forge.message(rng.choice(legit)))  # names a real rank: mismatch
    elif kind == "replayed":
        if "frame" in last:
            tx.raw(*last["frame"])
    elif kind == "stale":
        who = rng.choice(legit)
        auth = tx.auth_old if rng.random() < 0.5 else tx.auth_past
        tx.signed(i, str(who), forge.message(who), auth)


def run_live_fuzz(cfg: LiveFuzzConfig, progress: Callable[[str], None] | None = None) -> LiveFuzzResult:
    from kvferry.backends.runtime.security import ephemeral_key
    from kvferry.backends.zmqctl.auth import load_keys

    res = LiveFuzzResult(seed=cfg.seed)
    rng = random.Random(cfg.seed)
    key = ephemeral_key()
    pre, dec = _endpoints(cfg, key)
    eps = [*pre, dec]
    res.executor = ",".join(sorted({ep.transport.executor for ep in eps}))
    _start(pre, dec)
    legit = [ep.endpoint for ep in eps]
    # The forger's and the frame stream's seeds are drawn before the rooms' token counts.
    rooms = _LegitRooms(cfg, rng, pre, dec)
    forge = _Forger(random.Random(rng.random()), lambda: list(rooms.live))
    tx = _Sender(load_keys((key,), None), [(str(ep.endpoint), ep.address) for ep in eps])
    frng = random.Random(rng.random())
    last: dict[str, tuple[int, list[bytes]]] = {}  # the last signed frame and its target
    t0 = time.monotonic()
    deadline = t0 + cfg.max_seconds
    sent = 0
    try:
        while (rooms.pending() or sent < cfg.frames) and time.monotonic() < deadline:
            rooms.open()
            for _ in range(min(50, cfg.frames - sent)):
                kind = frng.choice(KINDS)
                _send_one(kind, frng, tx, forge, legit, last)
                res.frames_sent[kind] += 1
                sent += 1
            rooms.reap(res)
            if progress is not None and sent % 500 == 0:
                progress(f"frames {sent}/{cfg.frames}, rooms {res.rooms_done}/{cfg.rooms}")
            time.sleep(0.001)
        if rooms.pending() or sent < cfg.frames:
            res.stopped_early = True
        time.sleep(0.3)  # let the last hostile frames reach the engines
        _check_threads(eps, res)
        if cfg.plant_stray_write:
            region = dec.transport.region(dec.pool.regions[0].region_id)
            region[region.size - 1] ^= 0xFF
        _check_canaries(dec, res)
        res.rejected = _rejections(eps)
    finally:
        tx.close()
        for ep in eps:
            stuck = ep.close()
            if stuck:
                res.violations.append(f"{ep.endpoint}: threads did not stop: {stuck}")
        res.wall_s = time.monotonic() - t0
    return res


def _endpoints(cfg: LiveFuzzConfig, key: bytes) -> tuple[list[Any], Any]:
    """Two prefill ranks (TP 2) and the decode rank (TP 1) they feed, not started."""
    from kvferry.backends.loopback.plan import timeouts as loopback_timeouts
    from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
    from kvferry.core.geometry import ModelGeometry, PoolGeometry

    timeouts = loopback_timeouts()  # the soak's: generous for a loaded 2-core machine
    rc = RuntimeConfig(
        num_queues=2, aux_rows=AUX_ROWS, timeouts=timeouts, control_keys=(key,), nixl_engine=cfg.engine
    )
    model = ModelGeometry("fuzz-live", num_layers=2, num_kv_heads=4, head_dim=8)
    pre = [PrefillEndpoint("P", PoolGeometry(model, 2, r, PAGE, PAGES), config=rc) for r in range(2)]
    dec = DecodeEndpoint(
        "D",
        PoolGeometry(model, 1, 0, PAGE, PAGES),
        prefill_server="P",
        prefill_addresses=[p.address for p in pre],
        config=rc,
    )
    return pre, dec


def _start(pre: list[Any], dec: Any) -> None:
    """Starts every endpoint, then paints the decode pages and aux rows with the canary."""
    from kvferry.backends.nixl.transport import AUX_REGION_ID

    for ep in [*pre, dec]:
        ep.start()
    for rid in [r.region_id for r in dec.pool.regions] + [AUX_REGION_ID]:
        dec.transport.region(rid)[:] = CANARY


class _LegitRooms:
    """The legitimate rooms: up to WINDOW in flight, each on a slot of 4 pages of the first
    LEGIT_PAGES and an aux row of the first LEGIT_AUX, checked and freed once both sides end."""

    def __init__(self, cfg: LiveFuzzConfig, rng: random.Random, pre: list[Any], dec: Any) -> None:
        self.cfg, self.rng, self.pre, self.dec = cfg, rng, pre, dec
        self.live: dict[int, Any] = {}
        self.next_room = 0
        self.free_slots = list(range(LEGIT_PAGES // 4))  # 4 pages a room (at most 16 tokens)

    def pending(self) -> bool:
        return self.next_room < self.cfg.rooms or bool(self.live)

    def open(self) -> None:
        from kvferry.backends import pattern

        cfg, dec = self.cfg, self.dec
        while self.next_room < cfg.rooms and len(self.live) < WINDOW and self.free_slots:
            slot = self.free_slots.pop(0)
            room, tid = 7000 + self.next_room, f"legit-{cfg.seed}-{self.next_room}"
            tokens = 1 + self.rng.randrange(16)
            pages = np.arange(4, dtype=np.int64) + slot * 4
            aux = slot % LEGIT_AUX
            rv = dec.receiver(room, tid)
            rv.init(pages, tokens, aux)
            senders = []
            for p in self.pre:
                pattern.fill(p.pool, p.transport.region, room, pages, 0, tokens)
                s = p.sender(room, tid)
                s.write_aux(aux, room.to_bytes(8, "little"))
                s.init(aux)
                s.send(pages, tokens, is_last=True)
                senders.append(s)
            self.live[room] = (tid, rv, senders, pages, tokens, aux, slot)
            self.next_room += 1

    def reap(self, res: LiveFuzzResult) -> None:
        """Counts and checks every room whose receiver and senders have all ended."""
        from kvferry.core.kvpoll import KVPoll

        ended = (KVPoll.Success, KVPoll.Failed)
        for room in list(self.live):
            tid, rv, senders, pages, tokens, aux, slot = self.live[room]
            st = rv.poll()
            sts = [s.poll() for s in senders]
            if st not in ended or any(x not in ended for x in sts):
                continue
            res.rooms_done += 1
            if st is KVPoll.Success and all(x is KVPoll.Success for x in sts):
                self._check_bytes(res, room, pages, tokens, aux)
            else:
                why = rv.ep.board.get(room, tid)
                res.violations.append(f"legitimate room {room} failed: {why.reason if why else '?'}")
            rv.clear()
            for s in senders:
                s.clear()
            del self.live[room]
            self.free_slots.append(slot)

    def _check_bytes(self, res: LiveFuzzResult, room: int, pages: np.ndarray, tokens: int, aux: int) -> None:
        from kvferry.backends import pattern

        dec = self.dec
        bad, first = pattern.mismatches(dec.pool, dec.transport.region, room, pages, tokens)
        if bad or dec.transport.read_aux_room(aux) != room:
            res.violations.append(f"room {room}: Success with {bad} wrong bytes ({first}) or a wrong aux row")
        else:
            res.rooms_success += 1


def _check_threads(eps: list[Any], res: LiveFuzzResult) -> None:
    for ep in eps:
        dead = [lp.name for lp in ep._loops if not lp.thread.is_alive()]
        if dead:
            res.violations.append(f"{ep.endpoint}: thread(s) died: {dead}")
        if ep.errors:
            res.violations.append(f"{ep.endpoint}: thread errors: {[repr(e)[:200] for e in ep.errors[:3]]}")


def _check_canaries(dec: Any, res: LiveFuzzResult) -> None:
    from kvferry.backends.nixl.transport import AUX_REGION_ID

    pool = dec.pool
    for r in pool.regions:
        view = dec.transport.region(r.region_id)
        per_page = view.size // pool.num_pages
        outside = view[LEGIT_PAGES * per_page :]
        if (outside != CANARY).any():
            first = int(np.flatnonzero(outside != CANARY)[0]) + LEGIT_PAGES * per_page
            res.violations.append(
                f"region {r.region_id}: byte {first} (page {first // per_page}) written, no room owns it"
            )
    aux = dec.transport.region(AUX_REGION_ID)
    row = aux.size // AUX_ROWS
    if (aux[LEGIT_AUX * row :] != CANARY).any():
        res.violations.append("an aux row no room owns was written")


def _rejections(eps: list[Any]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for ep in eps:
        stats = ep.transport.control.stats
        out["plane.malformed"] += stats.malformed
        for why, n in stats.rejected.items():
            out[f"auth.{why}"] += n
        with ep.lock:
            for k, v in ep.engine.counters.items():
                if v and any(
                    w in k
                    for w in (
                        "remote",
                        "garbage",
                        "unknown",
                        "stale",
                        "bad",
                        "reject",
                        "invalid",
                        "wire",
                        "tomb",
                    )
                ):
                    out[f"engine.{k}"] += v
    return dict(sorted(out.items()))
