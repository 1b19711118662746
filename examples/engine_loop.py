"""A fake serving engine driving the SGLang-shaped adapter (examples/adapters/sglang_like.py)
over real NIXL on host memory, the decode server in a second process.

This process is the prefill server (TP 2: one ``KVManager`` per rank) and its scheduler loop:
requests arrive over the steps, are admitted when their prompt's pages fit, and are computed by
chunked prefill under a token budget per forward pass; each chunk's full pages go to every
rank's ``KVSender.send`` as soon as they are computed, and a finished request's pages are freed
once its transfer is Success. One request is cancelled by its client mid-prefill (prefill aborts
it) and one is dropped by decode mid-transfer (decode aborts it); both must end Failed on both
sides. The decode process (TP 1) opens a ``KVReceiver`` per request when the router hands it the
request, checks every byte of a Success room against what prefill computed (a pattern both sides
can recompute) and reads the first output token from the aux row.

    python examples/engine_loop.py [--requests 8] [--seed 0]   # exit 0 when every room ended right
    python examples/engine_loop.py --layerwise   # the layer-wise flow: each layer's KV leaves as
                                                 # soon as that layer is computed (layers_ready)

The two processes talk JSON lines over the child's stdin/stdout (the router's messages); the KV
bytes and the control messages go through kvferry (NIXL over UCX, ZMQ on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvferry.commands.extras import require_for_script

require_for_script("real", "examples/engine_loop.py")  # one line and exit 2 without NIXL/pyzmq
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs each agent's start to stdout at INFO

sys.path.insert(0, str(Path(__file__).resolve().parent / "adapters"))
import sglang_like as sg  # noqa: E402
from kvferry.backends.runtime import RuntimeConfig  # noqa: E402
from kvferry.backends.runtime.security import ephemeral_key  # noqa: E402
from kvferry.backends.runtime.staging import StagingConfig  # noqa: E402
from kvferry.core.geometry import KVKind, ModelGeometry, PoolGeometry  # noqa: E402
from kvferry.core.kvpoll import KVPoll, min_status  # noqa: E402

MODEL = ModelGeometry("engine-loop", num_layers=2, num_kv_heads=4, head_dim=8)  # bf16: 16 B a head
PAGE, PAGES, PREFILL_TP = 4, 64, 2
BUDGET = 16  # tokens per prefill forward pass (chunked prefill shares it among running requests)
STEP_S = 0.002  # a forward pass's time
PREFILL, DECODE = "prefill-engine", "decode-engine"
TERMINAL = (KVPoll.Success, KVPoll.Failed)
KINDS = (KVKind.K, KVKind.V)


# ---- the KV both sides can recompute: prefill writes it, decode checks it ----------------------
def pattern(room: int, start: int, end: int, layer: int, kind: int, h0: int, h1: int) -> np.ndarray:
    """[token, head, byte] of tokens [start, end) and global heads [h0, h1) of one layer's K or V."""
    t = np.arange(start, end, dtype=np.int64)[:, None, None]
    h = np.arange(h0, h1, dtype=np.int64)[None, :, None]
    b = np.arange(MODEL.head_dim * 2, dtype=np.int64)[None, None, :]
    return ((room % 9973) * 131 + t * 31 + layer * 17 + kind * 7 + h * 5 + b) % 255 + 1


def slots(pool: PoolGeometry, pages: np.ndarray, start: int, end: int) -> np.ndarray:
    t = np.arange(start, end)
    return np.asarray(pages)[t // pool.page_size] * pool.page_size + t % pool.page_size


def heads(pool: PoolGeometry, buf: np.ndarray) -> np.ndarray:
    return buf.reshape(pool.num_slots, pool.heads_per_rank, pool.head_bytes)  # SGLang's NHD


def regions(pool: PoolGeometry) -> dict[int, np.ndarray]:
    return {s.region_id: np.zeros(s.nbytes, np.uint8) for s in pool.regions}


def kv_args(pool: PoolGeometry, regs: dict[int, np.ndarray], aux_rows: int) -> sg.KVArgs:
    order = [pool.region_id(layer, k) for k in KINDS for layer in range(MODEL.num_layers)]  # K..., V...
    return sg.KVArgs(
        engine_rank=pool.tp_rank,
        kv_data_ptrs=[regs[r].ctypes.data for r in order],
        kv_data_lens=[regs[r].nbytes for r in order],
        aux_rows=aux_rows,
    )


def first_token(room: int) -> int:
    return room % 50_000  # what prefill's sampler "produced"; decode reads it from the aux row


def room_bytes(tokens: int) -> int:
    return tokens * MODEL.num_layers * 2 * MODEL.num_kv_heads * MODEL.head_dim * 2


# ---- the prefill server: this process ------------------------------------------------------------
@dataclass
class Request:
    room: int
    tokens: int
    arrival_step: int
    aux: int
    cancel_after_chunks: int = 0  # > 0: the client cancels after this many chunks (prefill aborts)
    decode_drops_after_chunks: int = 0  # > 0: decode aborts after this many chunks were sent
    held: bool = False  # waiting for decode's abort to reach every prefill rank
    expect_failed: bool = False  # cancelled or dropped on purpose: must end Failed on both sides
    src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    senders: list[sg.KVSender] = field(default_factory=list)
    computed: int = 0
    sent_pages: int = 0
    chunks: int = 0
    aborted_by: str = ""
    prefill_status: KVPoll | None = None
    decode_report: dict[str, Any] | None = None


def draw_requests(n: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = [
        Request(
            room=int(rng.integers(1, 2**62)),
            tokens=int(rng.integers(5, 61)),
            arrival_step=int(rng.integers(0, 8)),
            aux=i,
        )
        for i in range(n)
    ]
    long = sorted(out, key=lambda r: -r.tokens)[:2]
    for r in long:  # long enough that the first forward pass cannot finish them
        r.tokens = max(r.tokens, 2 * BUDGET + 1)
    long[0].cancel_after_chunks = long[0].expect_failed = 1
    long[1].decode_drops_after_chunks = long[1].expect_failed = 1
    return out


class Decode:
    """The router's line to the decode process: requests out, its reports in."""

    def __init__(self, addresses: list[str], aux_rows: int, key: str) -> None:
        env = dict(os.environ, KVFERRY_CONTROL_KEY=key)
        argv = [sys.executable, __file__, "--decode-side", ",".join(addresses), "--aux-rows", str(aux_rows)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                print(f"  decode says: {line.rstrip()}")  # a library's own log line
        self.events.put({"event": "exited"})

    def send(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # the decode process is gone; its exit shows up as an event
            pass

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


def run_prefill(n: int, seed: int, layerwise: bool = False) -> int:
    staging = StagingConfig(flow="layerwise") if layerwise else StagingConfig()
    config = RuntimeConfig(num_queues=2, control_keys=(key := ephemeral_key(),), staging=staging)
    pools = [PoolGeometry(MODEL, PREFILL_TP, r, PAGE, PAGES) for r in range(PREFILL_TP)]
    regs = [regions(p) for p in pools]  # kept alive until the managers close (NIXL registered them)
    mgrs = [
        sg.KVManager(kv_args(p, r, n), sg.DisaggregationMode.PREFILL, p, server=PREFILL, config=config)
        for p, r in zip(pools, regs, strict=True)
    ]
    decode = Decode([m.address for m in mgrs], n, key)
    print(
        f"engine_loop: prefill TP{PREFILL_TP} (this process) -> decode TP1 (process {decode.proc.pid}), "
        f"real NIXL over UCX on host memory; {BUDGET} prefill tokens a forward pass, pages of {PAGE} tokens"
    )
    requests = draw_requests(n, seed)
    try:
        ok = _schedule(requests, mgrs, pools, regs, decode, layerwise)
        if layerwise:
            streamed = 0
            for m in mgrs:
                with m.endpoint.lock:  # the engine only under its endpoint's lock
                    streamed += m.endpoint.engine.counters["layer_ranges_posted"]
            print(f"layer-wise: {streamed} layer writes posted as their layers were computed")
        decode.send(op="end")
        closed = _wait_for(decode, "closed", 30.0)
    finally:
        stuck = [name for m in mgrs for name in m.close()]
        if decode.proc.poll() is None:
            decode.proc.kill()
    leaks = {f"prefill{i}.{k}": v for i, m in enumerate(mgrs) for k, v in m.endpoint.leaks().items() if v}
    leaks.update(closed.get("leaks", {}) if closed else {"decode": "no report"})
    stuck += closed.get("stuck", []) if closed else []
    success = [r for r in requests if r.prefill_status is KVPoll.Success]
    moved = sum(room_bytes(r.tokens) for r in success)
    print(
        f"summary: {len(requests)} requests, {len(success)} Success with every byte checked by decode "
        f"({moved:,} KV bytes moved), {sum(r.expect_failed for r in requests)} aborted on purpose; "
        f"{'every room ended as it should' if ok else 'SOME ROOMS ENDED WRONG'}; "
        f"leaks {leaks or 'none'}, stuck threads {stuck or 'none'}"
    )
    return 0 if ok and not leaks and not stuck else 1


def _wait_for(decode: Decode, event: str, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = decode.next_event(0.1)
        if ev is not None and ev["event"] == event:
            return ev
        if ev is not None and ev["event"] == "exited":
            return None
    return None


def _schedule(
    requests: list[Request],
    mgrs: list[sg.KVManager],
    pools: list[PoolGeometry],
    regs: list[dict[int, np.ndarray]],
    decode: Decode,
    layerwise: bool,
) -> bool:
    """The scheduler loop: arrivals, admission, one chunked-prefill forward pass, aborts, polls."""
    free = list(range(PAGES))
    waiting: list[Request] = []
    running: list[Request] = []
    by_room = {r.room: r for r in requests}
    step, deadline = 0, time.monotonic() + 60
    if _wait_for(decode, "ready", 30.0) is None:
        print("decode process did not start")
        return False
    while time.monotonic() < deadline:
        for r in requests:
            if r.arrival_step == step:  # the router hands the request to both servers
                waiting.append(r)
                decode.send(op="open", room=r.room, tokens=r.tokens, aux=r.aux)
        while waiting and len(free) >= -(-waiting[0].tokens // PAGE):  # admit in arrival order
            r = waiting.pop(0)
            r.src = np.asarray([free.pop(0) for _ in range(-(-r.tokens // PAGE))], np.int64)
            r.senders = [sg.KVSender(m, PREFILL, r.room) for m in mgrs]  # one per TP rank
            for s in r.senders:
                s.init(len(r.src), aux_index=r.aux, num_tokens=r.tokens)
            running.append(r)
            print(f"step {step:>3}: admit room {r.room} ({r.tokens} tokens, {len(r.src)} pages)")
        _forward(step, running, pools, regs, decode, layerwise)
        for r in list(running):  # poll every rank; the room's status is the minimum
            status = min_status([s.poll() for s in r.senders])
            if status in TERMINAL:
                r.prefill_status = status
                why = f" ({r.aborted_by or 'dropped by decode'})" if r.expect_failed else ""
                print(f"step {step:>3}: room {r.room} {status.name} on every prefill rank{why}; pages freed")
                for s in r.senders:
                    s.clear()
                free.extend(int(p) for p in r.src)
                running.remove(r)
        while (ev := decode.next_event(0)) is not None:
            if ev["event"] == "done":
                r = by_room[ev["room"]]
                r.decode_report = ev
                print(f"  decode: {_describe(ev)}")
                if ev["status"] == "Failed" and r in running and not r.aborted_by:
                    # Decode dropped it before opening it: no Abort reaches prefill, the router's
                    # word does (an opened room's Abort arrives through kvferry itself).
                    for s in r.senders:
                        s.abort()
                    r.aborted_by = "dropped by decode"
            elif ev["event"] == "exited":
                print("decode process exited early")
                return False
        if all(r.prefill_status is not None and r.decode_report is not None for r in requests):
            return _verdict(requests)
        step += 1
        time.sleep(STEP_S)
    print("timed out: " + ", ".join(f"{r.room}" for r in requests if r.decode_report is None))
    return False


def _forward(
    step: int,
    running: list[Request],
    pools: list[PoolGeometry],
    regs: list[dict[int, np.ndarray]],
    decode: Decode,
    layerwise: bool,
) -> None:
    """One forward pass: up to BUDGET tokens of the running requests' prompts, oldest first."""
    budget = BUDGET
    for r in running:
        if budget == 0 or r.computed == r.tokens or r.aborted_by:
            continue
        if min_status([s.poll() for s in r.senders]) is KVPoll.Failed:  # decode dropped it
            r.aborted_by = "aborted by decode"
            continue
        if r.held:
            # Held until decode's abort reaches prefill, so that this example ends the same way on
            # every run. An engine does not wait: an abort arriving after the last write landed
            # may leave prefill Success and decode Failed, which is what decode asked for.
            continue
        start, end = r.computed, min(r.tokens, r.computed + budget)
        budget -= end - start
        last = end == r.tokens
        # SGLang's send_kv_chunk: full pages only until the last chunk; an empty one is skipped.
        end_page = len(r.src) if last else end // PAGE
        pages, r.sent_pages = r.src[r.sent_pages : end_page], end_page
        if layerwise and len(pages):
            _send(r, pages, last)  # layer-wise: the chunk is handed over as its forward starts
        for layer in range(MODEL.num_layers):
            for pool, rr in zip(pools, regs, strict=True):  # every rank computes its heads
                for kind in KINDS:
                    view = heads(pool, rr[pool.region_id(layer, kind)])
                    view[slots(pool, r.src, start, end)] = pattern(
                        r.room, start, end, layer, KINDS.index(kind), pool.head_start, pool.head_end
                    )
            if layerwise and len(pages):
                for s in r.senders:
                    s.layers_ready(layer, layer + 1)  # this layer's KV leaves now
        r.computed = end
        if not layerwise and len(pages):
            _send(r, pages, last)
        print(
            f"step {step:>3}: room {r.room} prefill tokens [{start}, {end}) of {r.tokens}: "
            f"sent {len(pages)} page(s)" + (" (last chunk, aux row with the first token)" if last else "")
        )
        if r.cancel_after_chunks and r.chunks == r.cancel_after_chunks and not last:
            for s in r.senders:
                s.abort()
            r.aborted_by = "cancelled by its client: prefill aborted it"
            print(f"step {step:>3}: room {r.room}'s client cancelled: abort on every prefill rank")
        if r.decode_drops_after_chunks and r.chunks == r.decode_drops_after_chunks and not last:
            decode.send(op="abort", room=r.room)
            r.decode_drops_after_chunks, r.held = 0, True
            print(f"step {step:>3}: decode drops room {r.room} (its client went away there)")


def _send(r: Request, pages: np.ndarray, last: bool) -> None:
    for s in r.senders:
        if last:
            s.aux_payload = first_token(r.room).to_bytes(4, "little")
        s.send(pages)
    r.chunks += 1


def _describe(ev: dict[str, Any]) -> str:
    if ev["status"] == "Success":
        return (
            f"room {ev['room']} Success, {ev['tokens']} tokens in {ev['pages']} pages, "
            f"{ev['wrong_bytes']} wrong bytes, first token {ev['first_token']}"
        )
    return f"room {ev['room']} Failed ({ev['reason']}); pages reusable: {ev['pages_freed']}"


def _verdict(requests: list[Request]) -> bool:
    ok = True
    for r in requests:
        d = r.decode_report or {}
        if r.expect_failed:
            right = r.prefill_status is KVPoll.Failed and d.get("status") == "Failed" and d["pages_freed"]
        else:
            right = (
                r.prefill_status is KVPoll.Success
                and d.get("status") == "Success"
                and d["wrong_bytes"] == 0
                and d["first_token"] == first_token(r.room)
            )
        if not right:
            print(f"WRONG: room {r.room}: prefill {r.prefill_status}, decode {d}")
            ok = False
    return ok


# ---- the decode server: the second process -------------------------------------------------------
def run_decode(addresses: list[str], aux_rows: int) -> int:
    pool = PoolGeometry(MODEL, 1, 0, PAGE, PAGES)
    regs = regions(pool)
    mgr = sg.KVManager(
        kv_args(pool, regs, aux_rows),
        sg.DisaggregationMode.DECODE,
        pool,
        server=DECODE,
        prefill_server=PREFILL,
        prefill_addresses=addresses,
        config=RuntimeConfig(num_queues=2),  # the key: $KVFERRY_CONTROL_KEY, from the parent
    )
    out = sys.stdout

    def say(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    inbox: queue.Queue[dict[str, Any]] = queue.Queue()
    threading.Thread(target=lambda: [inbox.put(json.loads(line)) for line in sys.stdin], daemon=True).start()
    free = list(range(PAGES))
    rooms: dict[int, tuple[sg.KVReceiver, np.ndarray, int]] = {}
    waiting: list[dict[str, Any]] = []  # requests whose pages do not fit yet (decode's prealloc queue)
    ending = False
    say(event="ready")
    while not (ending and not rooms and not waiting):
        try:
            msg = inbox.get(timeout=0.001)
        except queue.Empty:
            msg = None
        if msg is not None and msg["op"] == "open":
            waiting.append(msg)
        elif msg is not None and msg["op"] == "abort":
            if msg["room"] in rooms:
                rooms[msg["room"]][0].abort()
            else:  # not admitted yet: nothing opened, nothing to undo
                waiting[:] = [w for w in waiting if w["room"] != msg["room"]]
                say(event="done", room=msg["room"], status="Failed", reason="dropped before admission",
                    pages_freed=True)  # fmt: skip
        elif msg is not None and msg["op"] == "end":
            ending = True
        while waiting and len(free) >= -(-waiting[0]["tokens"] // PAGE):  # admit: pages, receiver
            w = waiting.pop(0)
            dst = np.asarray([free.pop() for _ in range(-(-w["tokens"] // PAGE))], np.int64)
            rx = sg.KVReceiver(mgr, PREFILL, w["room"])
            rx.init(dst, aux_index=w["aux"], num_tokens=w["tokens"])
            rooms[w["room"]] = (rx, dst, w["tokens"])
        for room, (rx, dst, tokens) in list(rooms.items()):
            status = rx.poll()
            if status is KVPoll.Success:
                wrong = 0
                for layer in range(MODEL.num_layers):
                    for kind in KINDS:
                        got = heads(pool, regs[pool.region_id(layer, kind)])[slots(pool, dst, 0, tokens)]
                        want = pattern(room, 0, tokens, layer, KINDS.index(kind), 0, MODEL.num_kv_heads)
                        wrong += int((got != want).sum())
                token = int.from_bytes(rx.aux_payload()[:4], "little")
                say(event="done", room=room, status="Success", tokens=tokens, pages=len(dst),
                    wrong_bytes=wrong, first_token=token)  # fmt: skip
            elif status is KVPoll.Failed and rx.pages_freed():  # fenced: the pages may be reused
                try:
                    rx.failure_exception()
                    reason = "no reason given"
                except Exception as e:
                    reason = f"{type(e).__name__}: {e}"[:160]
                say(event="done", room=room, status="Failed", reason=reason, pages_freed=True)
            else:
                continue
            rx.clear()
            free.extend(int(p) for p in dst)
            del rooms[room]
    deadline = time.monotonic() + 10  # the core drops cleared rooms as their last acks land
    while any(mgr.endpoint.leaks().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    leaks = {f"decode.{k}": v for k, v in mgr.endpoint.leaks().items() if v}
    stuck = mgr.close()
    say(event="closed", leaks=leaks, stuck=stuck)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="requests to serve (3 to 32)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the requests' lengths and arrivals")
    ap.add_argument("--layerwise", action="store_true", help="stream each layer's KV as it is computed")
    ap.add_argument("--decode-side", metavar="ADDRESSES", help=argparse.SUPPRESS)
    ap.add_argument("--aux-rows", type=int, default=32, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.decode_side:
        return run_decode(a.decode_side.split(","), a.aux_rows)
    if not 3 <= a.requests <= 32:
        print(f"error: --requests must be in [3, 32], got {a.requests}", file=sys.stderr)
        return 2
    if a.seed < 0:
        print(f"error: --seed must be >= 0, got {a.seed}", file=sys.stderr)
        return 2
    return run_prefill(a.requests, a.seed, a.layerwise)


if __name__ == "__main__":
    sys.exit(main())
