"""How long a hand-off between Python threads and processes takes on this machine.

A room's control path is a chain of such hand-offs (a ZMQ message between the processes, a queue
between threads, a worker's Event), so the per-room cost the runtime can reach is bounded by them.
Each is timed as a ping-pong (round trip / 2), in four ways:

- ``event``: two threads, threading.Event set / wait (how a worker is woken);
- ``queue``: two threads, queue.Queue put / get (the control plane's inbox);
- ``zmq``: two processes, PUSH/PULL over TCP loopback, blocking recv (the control plane's wire);
- ``zmq_spin``: the same, the receiver polling with NOBLOCK and ``time.sleep(0)`` between polls
  (what a spinning receiver would gain: no sleep/wake of the OS scheduler on the path);
- ``plane``: two processes, kvferry's own ControlPlane with HMAC authentication (send on the
  caller's thread, the IO thread, the inbox), as the runtime's control threads use it;
- ``plane_busy``: the same with one more thread per process waking every 200 us to run a little
  Python, as a data thread with a room in flight does (what GIL contention adds to a hop).

    python bench/wake_probe.py [--n 2000] [--json]

Prints the median and p90 one-way time of each, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import threading
import time

import numpy as np


def _stats(one_way_ns: list[float]) -> dict[str, float]:
    a = np.asarray(one_way_ns) / 1e3
    return {"p50_us": float(np.median(a)), "p90_us": float(np.percentile(a, 90))}


def thread_event(n: int) -> dict[str, float]:
    ping, pong = threading.Event(), threading.Event()

    def echo() -> None:
        for _ in range(n):
            ping.wait()
            ping.clear()
            pong.set()

    t = threading.Thread(target=echo)
    t.start()
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        ping.set()
        pong.wait()
        pong.clear()
        out.append((time.perf_counter_ns() - t0) / 2)
        time.sleep(50e-6)  # let both threads go idle, as between a room's hops
    t.join()
    return _stats(out)


def thread_queue(n: int) -> dict[str, float]:
    ping: queue.Queue[int] = queue.Queue()
    pong: queue.Queue[int] = queue.Queue()

    def echo() -> None:
        for _ in range(n):
            pong.put(ping.get())

    t = threading.Thread(target=echo)
    t.start()
    out = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        ping.put(i)
        pong.get()
        out.append((time.perf_counter_ns() - t0) / 2)
        time.sleep(50e-6)
    t.join()
    return _stats(out)


def _zmq_echo(port_in: int, port_out: int, n: int, spin: bool) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"tcp://127.0.0.1:{port_in}")
    push.connect(f"tcp://127.0.0.1:{port_out}")
    for _ in range(n + 1):
        push.send(_recv(pull, spin))
    ctx.destroy(linger=0)


def _recv(sock, spin: bool) -> bytes:  # type: ignore[no-untyped-def]
    import zmq

    if not spin:
        return sock.recv()
    while True:
        try:
            return sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0)


def zmq_pingpong(n: int, spin: bool) -> dict[str, float]:
    import zmq

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port_out = push.bind_to_random_port("tcp://127.0.0.1")
    port_in = pull.bind_to_random_port("tcp://127.0.0.1")
    p = mp.get_context("spawn").Process(target=_zmq_echo, args=(port_out, port_in, n, spin))
    p.start()
    push.send(b"warm")
    _recv(pull, spin)
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        push.send(b"x" * 200)  # about a TransferInfo's size
        _recv(pull, spin)
        out.append((time.perf_counter_ns() - t0) / 2)
        time.sleep(50e-6)
    p.join(10)
    ctx.destroy(linger=0)
    return _stats(out)


def _busy(stop: threading.Event) -> None:
    while not stop.wait(200e-6):
        sum(range(200))  # a short poll's worth of Python


def _plane(name: str, busy: bool):  # type: ignore[no-untyped-def]
    from kvferry.backends.zmqctl import ControlPlane
    from kvferry.backends.zmqctl.auth import ControlAuth

    stop = threading.Event()
    if busy:
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    return ControlPlane(name, auth=ControlAuth((b"k" * 32,))), stop


def _plane_echo(conn, n: int, busy: bool) -> None:  # type: ignore[no-untyped-def]
    plane, stop = _plane("echo", busy)
    conn.send(plane.address)
    plane.connect("probe", conn.recv())
    for _ in range(n + 1):
        msg = None
        while msg is None:
            msg = plane.recv(1.0)
        plane.send("probe", msg.payload)
    time.sleep(0.2)
    stop.set()
    plane.close()


def plane_pingpong(n: int, busy: bool) -> dict[str, float]:
    plane, stop = _plane("probe", busy)
    ours, theirs = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=_plane_echo, args=(theirs, n, busy))
    p.start()
    plane.connect("echo", ours.recv())
    ours.send(plane.address)
    out = []
    for i in range(n + 1):
        t0 = time.perf_counter_ns()
        plane.send("echo", b"x" * 200)
        msg = None
        while msg is None:
            msg = plane.recv(1.0)
        if i:  # the first round trip connects
            out.append((time.perf_counter_ns() - t0) / 2)
        time.sleep(50e-6)
    p.join(10)
    stop.set()
    plane.close()
    return _stats(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="round trips per probe")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.n < 10:
        ap.error("--n must be >= 10")
    rows = {
        "event": thread_event(args.n),
        "queue": thread_queue(args.n),
        "zmq": zmq_pingpong(args.n, spin=False),
        "zmq_spin": zmq_pingpong(args.n, spin=True),
        "plane": plane_pingpong(args.n, busy=False),
        "plane_busy": plane_pingpong(args.n, busy=True),
    }
    if args.json:
        print(json.dumps(rows))
        return
    for name, s in rows.items():
        print(f"{name:9s} one-way p50 {s['p50_us']:8.1f} us   p90 {s['p90_us']:8.1f} us")


if __name__ == "__main__":
    main()
