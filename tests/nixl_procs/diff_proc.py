"""One side of the executor differential test (tests/test_native_differential.py).

A real ``Driver`` over a real ``NixlTransport`` (DRAM, UCX) on the executor named by
``KVFERRY_E2E_ENGINE``, with a scripted engine in place of the protocol core: the test sends core
commands (PostWrite, PostRead, PostAuxWrite, SendNotif, CheckAux, AddPeer, DropPeer, and a write
prepared ahead: PrepareWrite, PrepareAuxWrite, PostPrepared, DropPrepared) as JSON
lines, the driver executes them exactly as it does for the real core, and every event the driver
feeds back (WriteDone, WriteFailed, NotificationIn, AuxChecked) is reported, in order.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from kvferry.backends.driver import Driver
from kvferry.backends.nixl.transport import NixlTransport
from kvferry.core.commands import (
    AddPeer,
    CheckAux,
    DropPeer,
    DropPrepared,
    PostAuxWrite,
    PostPrepared,
    PostRead,
    PostWrite,
    PrepareAuxWrite,
    PrepareWrite,
    SendNotif,
)
from kvferry.core.events import AuxChecked, NotificationIn, WriteDone, WriteFailed
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.messages import Endpoint, Register
from wire import heard, say
from workload import engine

# Two regions of 16 MiB each side (one layer, K and V): a whole-region write is a real transfer,
# and several runs of pages fit in them.
MODEL = ModelGeometry("diff", num_layers=1, num_kv_heads=8, head_dim=128)
PAGES = 512
PAGE = 16


class Run(msgspec.Struct, frozen=True):
    """The scripted engine's only input of its own: run these commands."""

    cmds: tuple[Any, ...]


class ScriptEngine:
    """Stands where the protocol core stands: emits the test's commands, records what it hears."""

    def __init__(self) -> None:
        self.heard: list[Any] = []

    def handle(self, event: Any, now: int) -> list[Any]:
        if isinstance(event, Run):
            return list(event.cmds)
        self.heard.append(event)
        return []

    def next_deadline(self) -> None:
        return None


def peer_of(role: str) -> Endpoint:
    return Endpoint(server="decode" if role == "prefill" else "prefill", rank=0)


def build(spec: dict[str, Any], role: str, registrations: dict[str, Register]) -> Any:
    kind = spec["kind"]
    peer = peer_of(role)
    arrays = {
        k: np.asarray(spec[k], dtype=np.int64)
        for k in ("src_region", "src_offset", "dst_region", "dst_offset", "length")
        if k in spec
    }
    notif = bytes.fromhex(spec.get("notif", ""))
    if kind == "write":
        return PostWrite(write_id=spec["id"], peer=peer, room=spec.get("room", 1), notif=notif, **arrays)
    if kind == "prepare":
        return PrepareWrite(prep_id=spec["prep"], peer=peer, room=spec.get("room", 1), notif=notif, **arrays)
    if kind == "prepare_aux":
        return PrepareAuxWrite(
            prep_id=spec["prep"],
            peer=peer,
            room=1,
            src_aux_index=spec["src"],
            dst_aux_index=spec["dst"],
            notif=notif,
        )
    if kind == "post_prepared":
        return PostPrepared(prep_id=spec["prep"], write_id=spec["id"], peer=peer, room=spec.get("room", 1))
    if kind == "drop_prepared":
        return DropPrepared(prep_id=spec["prep"], room=spec.get("room", 1))
    if kind == "read":
        return PostRead(read_id=spec["id"], peer=peer, room=spec.get("room", 1), notif=notif, **arrays)
    if kind == "aux":
        return PostAuxWrite(
            write_id=spec["id"],
            peer=peer,
            room=1,
            src_aux_index=spec["src"],
            dst_aux_index=spec["dst"],
            notif=notif,
        )
    if kind == "notif":
        return SendNotif(peer=peer, room=1, notif=notif)
    if kind == "check_aux":
        return CheckAux(room=spec["room"], transfer_id="t", aux_index=spec["index"])
    if kind == "add_peer":
        return AddPeer(peer=peer, registration=registrations["peer"])
    if kind == "drop_peer":
        return DropPeer(peer=peer, reason="dropped by the test")
    raise ValueError(f"unknown command {kind!r}")


def describe(ev: Any) -> list[Any]:
    if isinstance(ev, WriteDone):
        return ["done", ev.write_id]
    if isinstance(ev, WriteFailed):
        return ["failed", ev.write_id]
    if isinstance(ev, NotificationIn):
        return ["notif", ev.data.hex()]
    if isinstance(ev, AuxChecked):
        return ["aux", ev.found_room]
    return [type(ev).__name__]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    args = ap.parse_args()
    role = args.role
    pool = PoolGeometry(MODEL, 1, 0, PAGE, PAGES)
    rng = np.random.default_rng(3 if role == "prefill" else 4)
    buffers = {r.region_id: rng.integers(0, 256, r.nbytes, dtype=np.uint8) for r in pool.regions}
    transport = NixlTransport(
        Endpoint(server=role, rank=0), pool, role=role, buffers=buffers, engine=engine()
    )
    transport.register_regions(pool.regions, aux_rows=8, aux_row_bytes=64)
    core = ScriptEngine()
    driver = Driver(core, transport)
    say(
        event="ready",
        registration=msgspec.msgpack.encode(transport.registration()).hex(),
        executor=transport.executor,
        region_bytes=pool.regions[0].nbytes,
    )
    registrations: dict[str, Register] = {}
    decoder = msgspec.msgpack.Decoder(Register)
    reported = 0  # events up to here were reported; later ones go with the next "run"
    idle_end = time.monotonic() + 120.0
    while True:
        # Keep NIXL moving between commands, as an endpoint's data thread does: without NIXL's
        # own progress thread, a target that is not polled does not complete writes into it.
        driver.pump(time.monotonic_ns())
        line = heard(0.0005)
        if line is None:
            if time.monotonic() > idle_end:
                break
            continue
        idle_end = time.monotonic() + 120.0
        if line in ("eof", "exit"):
            break
        msg = msgspec.json.decode(line)
        what = msg["do"]
        if what == "peer":
            registrations["peer"] = decoder.decode(bytes.fromhex(msg["registration"]))
            say(event="ok")
        elif what == "aux_row":  # the host fills an aux row (first 8 bytes: the room id)
            transport.write_aux_row(msg["index"], int(msg["room"]).to_bytes(8, "little", signed=True))
            say(event="ok")
        elif what == "run":
            cmds = tuple(build(c, role, registrations) for c in msg["cmds"])
            before = reported
            driver.feed(Run(cmds), time.monotonic_ns())
            # Until every posted transfer settled and the expected notifications came in.
            end = time.monotonic() + msg.get("timeout_s", 20.0)
            want = msg.get("notifs", 0)
            while time.monotonic() < end:
                driver.pump(time.monotonic_ns())
                notes = sum(isinstance(e, NotificationIn) for e in core.heard[before:])
                if not driver.handles and notes >= want:
                    break
                time.sleep(0.0002)
            reported = len(core.heard)
            say(event="events", events=[describe(e) for e in core.heard[before:reported]])
        elif what == "digest":
            view = transport.region(msg["region"])
            say(event="digest", sha=hashlib.sha256(view.tobytes()).hexdigest())
        else:
            say(event="error", what=what)
    transport.close()
    say(event="closed")


if __name__ == "__main__":
    main()
