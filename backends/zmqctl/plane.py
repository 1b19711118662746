"""ZMQ control plane of one endpoint: a PULL socket for inbound, one PUSH socket per peer.

Every message on the wire is the parts ``[sender_id, reply_address, payload]`` packed into one ZMQ
frame (``pack_parts``): one frame is one GIL release per send and per receive, where pyzmq's
multipart calls release and retake the GIL once per part, about 40 us a part in a runtime
process whose other threads want the GIL (172 us p50 for a four-part send). The payload is a
msgspec-encoded core message (no pickle anywhere); decoding and validation belong to the caller,
this layer only checks the frame shape and counts what it drops. The reply address lets a
receiver answer a peer it was never configured with (a decode rank registering with prefill) and
follow a peer that restarted on a new port: with ``learn=True`` an inbound message from an
unknown peer, or from a known one at a new address, (re)connects to that address.

Threading. ZMQ sockets are not thread-safe: every use of a socket is serialised. The PULL socket
belongs to the IO thread alone. The PUSH sockets, the ``_addrs`` peer address table, the per-peer
backlog ``_waiting`` and the send-side ``stats`` are guarded by ``_lock``, taken by the IO thread
and by ``send()``. ``send()`` transmits on the caller's thread when it can (the peer's socket
exists, nothing of ours is queued before it, ZMQ takes it without blocking): a thread hop through
the IO thread cost about 200 us per message on a loaded host, a third of a small room's control
path. Otherwise it puts into the bounded outbox and wakes the IO thread through a pipe, which
sends in order and retries until ``send_timeout_s``. ``recv()`` takes from the inbox, which the IO
thread fills. ``connect()`` and ``disconnect()`` replace the peer's socket under ``_lock`` on the
caller's thread before they return, so a ``send()`` after them goes to the new address: applied
later by the IO thread, a send on the caller's thread could still reach the old socket, whose
connection to a closed peer ZMQ had not yet torn down, and the message was lost.

Bounds and timeouts. Nothing blocks without a limit: the outbox put and the inbox get take a
timeout; the IO thread polls with a timeout; a message the peer does not accept within
``send_timeout_s`` (its HWM is full, or it is not connected: IMMEDIATE is set so nothing queues
towards a dead peer) is given up and reported as a SendFailure through the inbox, so the runtime
can fail the rooms waiting on it instead of hanging. When the inbox is full the IO thread stops
reading, so backpressure reaches the senders through ZMQ's own high-water marks.

Authentication (``auth``, backends/zmqctl/auth.py): with a ``ControlAuth`` every message carries a
fourth part, a header with an HMAC-SHA256 tag, between the reply address and the payload, and
every inbound frame is checked on the IO thread before it reaches the inbox: a rejected frame is
only counted (``stats.rejected`` by reason), and never teaches the plane a reply address. Without
one (``auth=None``) the plane is unauthenticated and says so in the log.

Reconnects. A PUSH socket reconnects by itself when a peer restarts at the same address; when it
comes back at a new address, ``connect(peer, new_address)`` replaces the socket.
"""

from __future__ import annotations

import contextlib
import os
import queue
import struct
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import zmq
from kvferry.backends.zmqctl.auth import ControlAuth, warn_insecure
from kvferry.core.errors import KvferryError

MAX_ID_BYTES = 256
_MAGIC = b"kf"  # a packed message; anything else on the socket is malformed
_MAX_PARTS = 4
_COUNT = struct.Struct("!2sB")
_LENGTHS = [struct.Struct(f"!{n}I") for n in range(_MAX_PARTS + 1)]


def pack_parts(parts: list[bytes]) -> bytes:
    """One wire frame holding ``parts`` (at most four): magic, count, lengths, then the parts."""
    if len(parts) > _MAX_PARTS:
        raise ValueError(f"at most {_MAX_PARTS} parts, got {len(parts)}")
    return b"".join([_COUNT.pack(_MAGIC, len(parts)), _LENGTHS[len(parts)].pack(*map(len, parts)), *parts])


def unpack_parts(frame: bytes) -> list[bytes] | None:
    """The parts of a packed frame, or None if it is not one (wrong magic, count or lengths)."""
    if len(frame) < _COUNT.size:
        return None
    magic, n = _COUNT.unpack_from(frame)
    if magic != _MAGIC or n > _MAX_PARTS:
        return None
    head = _COUNT.size + _LENGTHS[n].size
    if len(frame) < head:
        return None
    lengths = _LENGTHS[n].unpack_from(frame, _COUNT.size)
    if head + sum(lengths) != len(frame):
        return None
    parts, at = [], head
    for k in lengths:
        parts.append(frame[at : at + k])
        at += k
    return parts


class ControlPlaneError(KvferryError):
    """The control plane is closed, or a bounded queue stayed full past its timeout."""


@dataclass(frozen=True)
class Inbound:
    """A message from a peer, or (failed=True) one of ours the peer never accepted."""

    peer: str
    payload: bytes
    failed: bool = False


@dataclass
class Stats:
    received: int = 0
    sent: int = 0
    malformed: int = 0
    send_failed: int = 0
    unknown_peer: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # authentication, by reason


@dataclass
class _Out:
    peer: str
    payload: bytes
    deadline: float = field(default=0.0)
    header: bytes = b""


class ControlPlane:
    def __init__(
        self,
        identity: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        inbox_max: int = 8192,
        outbox_max: int = 8192,
        hwm: int = 4096,
        send_timeout_s: float = 2.0,
        poll_ms: int = 50,
        learn: bool = True,
        auth: ControlAuth | None = None,
    ) -> None:
        if not identity or len(identity.encode()) > MAX_ID_BYTES:
            raise ValueError("identity must be 1..256 bytes")
        self.identity = identity
        self._id = identity.encode()
        self._ctx = zmq.Context.instance()
        self._hwm = hwm
        self._send_timeout = send_timeout_s
        self._poll_ms = poll_ms
        self._learn = learn
        self._auth = auth
        if auth is None:
            warn_insecure(identity)
        self._inbox: queue.Queue[Inbound] = queue.Queue(maxsize=inbox_max)
        self._outbox: queue.Queue[_Out] = queue.Queue(maxsize=outbox_max)
        # Guarded by _lock (the IO thread and senders): PUSH sockets, their addresses, and the
        # messages that could not go yet, per peer, in order (bounded by the outbox size).
        self._lock = threading.Lock()
        self._socks: dict[str, zmq.Socket] = {}
        self._addrs: dict[str, str] = {}
        self._waiting: dict[str, deque[_Out]] = {}
        self._dropped: deque[_Out] = deque()  # waiting for a peer that disconnect() forgot
        self.stats = Stats()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, hwm)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # a malformed giant frame cannot eat memory
        if port:
            self._pull.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._addr = self.address.encode()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        # The inbox's wake-up (``inbox_fd``): -1 until a consumer asks for it. The IO thread
        # writes it after a pass that put messages (one write per batch, not per message).
        self._inbox_fd = -1
        self._inbox_puts = 0  # IO thread only: messages put in the inbox
        self._inbox_told = 0  # IO thread only: _inbox_puts at the last write of the wake-up
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"zmqctl-{identity}", daemon=True)
        self._thread.start()

    # ---- API for any thread -------------------------------------------------------------
    def connect(self, peer: str, address: str) -> None:
        """Route messages for ``peer`` to ``address`` (replacing an older address) from now on:
        a message still waiting for the peer goes to the new address."""
        self._check()
        with self._lock:
            self._open(peer, address)
        self._wake()  # the IO thread retries the peer's backlog on the new socket

    def disconnect(self, peer: str) -> None:
        """Forget ``peer``: its socket closes and the messages waiting for it are reported failed."""
        self._check()
        with self._lock:
            old = self._socks.pop(peer, None)
            if old is not None:
                old.close(0)
            self._addrs.pop(peer, None)
            # Reported failed by the IO thread, the inbox's one writer (it counts its puts).
            self._dropped.extend(self._waiting.pop(peer, ()))
        self._wake()

    def send(self, peer: str, payload: bytes, timeout_s: float = 1.0) -> None:
        """Send now if the peer takes it at once, else queue it; raises ControlPlaneError if the
        outbox stays full for timeout_s. Order per peer is kept either way."""
        self._check()
        out = _Out(peer, bytes(payload))
        with self._lock:
            # In order only if nothing of ours waits before it: not in the outbox nor in the
            # peer's backlog. (The outbox is filled under this lock, except by a sender waiting
            # for room in a full one below; a thread's own sends stay in order either way.)
            sock = self._socks.get(peer)
            if sock is not None and self._outbox.empty() and not self._waiting.get(peer):
                try:
                    sock.send(self._frames(peer, out), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet, or its HWM is full: the IO thread retries it
                else:
                    self.stats.sent += 1
                    return
            try:
                self._outbox.put_nowait(out)
                queued = True
            except queue.Full:
                queued = False
        if not queued:  # wait for room without holding the lock the IO thread needs to drain
            try:
                self._outbox.put(out, timeout=timeout_s)
            except queue.Full:
                raise ControlPlaneError(f"outbox full for {timeout_s}s (sending to {peer})") from None
        self._wake()

    def recv(self, timeout_s: float) -> Inbound | None:
        """Next inbound message, or None after timeout_s."""
        self._check()
        if timeout_s <= 0 and not self._inbox.queue:
            # Empty (a deque's truth is one atomic read): no lock and no raised queue.Empty, 1.4 us
            # a call, on the progress thread's every pass. A message put meanwhile is taken on the
            # next pass (its inbox_fd write ends the sleep).
            return None
        try:
            return self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def inbox_fd(self) -> int:
        """A non-blocking eventfd the IO thread writes after a pass that put messages in the
        inbox: a consumer that also sleeps on other fds (a native-engine rank's one progress
        thread, through kvf_wait_fd) polls it instead of blocking in ``recv``. The consumer
        resets it (reads it) when it wakes on it and then takes the inbox with ``recv(0)``; a
        message put after that take writes it again, so none is missed and a stale write costs
        one empty pass, not a spin. Created on the first call; closed by close()."""
        if self._inbox_fd < 0:
            self._inbox_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return self._inbox_fd

    def nudge(self) -> None:
        """Make ``inbox_fd`` readable with nothing new: its consumer's sleep ends (it is being
        stopped). No-op before ``inbox_fd`` was asked for."""
        if self._inbox_fd >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                os.eventfd_write(self._inbox_fd, 1)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout_s)
        for fd in (self._wake_r, self._wake_w, self._inbox_fd):
            if fd < 0:
                continue
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- internals ----------------------------------------------------------------------
    def _check(self) -> None:
        if self._error is not None:
            raise ControlPlaneError(f"control plane IO thread died: {self._error!r}") from self._error
        if self._stop.is_set():
            raise ControlPlaneError("control plane is closed")

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _frames(self, peer: str, out: _Out) -> bytes:
        """The wire frame of one message (``_lock`` held: signing advances the sequence, and a
        peer must see its sequence numbers in send order)."""
        if self._auth is None:
            return pack_parts([self._id, self._addr, out.payload])
        if not out.header:  # signed once: a retry after zmq.Again resends the same frame
            out.header = self._auth.sign(self._id, self._addr, peer.encode(), out.payload)
        return pack_parts([self._id, self._addr, out.header, out.payload])

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        reading = True
        poller.register(self._pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    backlog = any(self._waiting.values())
                events = dict(poller.poll(5 if backlog else self._poll_ms))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
                if reading and self._pull in events:
                    self._drain_inbound()
                    self._tell_inbox()
                # Stop reading while the inbox is full: ZMQ's HWM then pushes back on senders.
                full = self._inbox.full()
                if full and reading:
                    poller.unregister(self._pull)
                    reading = False
                elif not full and not reading:
                    poller.register(self._pull, zmq.POLLIN)
                    reading = True
                self._flush_outbound()
                self._tell_inbox()  # send failures reported into the inbox
        except BaseException as exc:  # surfaced to callers by _check()
            self._error = exc
        finally:
            with self._lock:
                for s in self._socks.values():
                    s.close(0)
                self._socks.clear()
            self._pull.close(0)

    def _tell_inbox(self) -> None:
        """Write the inbox's wake-up if messages were put since the last write (IO thread)."""
        if self._inbox_puts != self._inbox_told and self._inbox_fd >= 0:
            self._inbox_told = self._inbox_puts
            with contextlib.suppress(BlockingIOError, OSError):
                os.eventfd_write(self._inbox_fd, 1)

    def _open(self, peer: str, address: str) -> None:
        """(Re)connect ``peer`` at ``address`` (``_lock`` held)."""
        old = self._socks.pop(peer, None)
        if old is not None:
            old.close(0)
        s = self._ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self._hwm)
        s.setsockopt(zmq.IMMEDIATE, 1)
        s.setsockopt(zmq.RECONNECT_IVL, 50)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        s.connect(address)
        self._socks[peer] = s
        self._addrs[peer] = address

    def _drain_inbound(self) -> None:
        for _ in range(1024):
            if self._inbox.full():
                return
            try:
                wire = self._pull.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            frames = unpack_parts(wire[0]) if len(wire) == 1 else None
            if frames is None:  # several ZMQ frames, or one that is not a packed message
                self.stats.malformed += 1
                continue
            want = 3 if self._auth is None else 4
            if len(frames) != want or not 0 < len(frames[0]) <= MAX_ID_BYTES or len(frames[1]) > MAX_ID_BYTES:
                if self._auth is not None and len(frames) == 3:
                    self.stats.rejected["untagged"] += 1
                    self._auth.reject("untagged")
                else:
                    self.stats.malformed += 1
                continue
            try:
                sender, reply = frames[0].decode(), frames[1].decode()
            except UnicodeDecodeError:
                self.stats.malformed += 1
                continue
            if reply and not reply.startswith("tcp://"):
                self.stats.malformed += 1
                continue
            if self._auth is not None:
                why = self._auth.check(frames[0], frames[1], self._id, frames[2], frames[3])
                if why:
                    self.stats.rejected[why] += 1
                    continue
            if self._learn and reply:
                with self._lock:
                    if self._addrs.get(sender) != reply:
                        self._open(sender, reply)
            self.stats.received += 1
            self._inbox.put_nowait(Inbound(sender, frames[-1]))
            self._inbox_puts += 1

    def _flush_outbound(self) -> None:
        now = time.monotonic()
        failed: deque[_Out] = deque()
        with self._lock:
            failed.extend(self._dropped)
            self._dropped.clear()
            waiting = self._waiting
            # Take from the outbox only while fewer than outbox_max messages wait here, so the
            # bound on the outbox is a real bound and a dead peer pushes back on send().
            held = sum(len(q) for q in waiting.values())
            while held < self._outbox.maxsize:
                try:
                    out = self._outbox.get_nowait()
                except queue.Empty:
                    break
                out.deadline = now + self._send_timeout
                waiting.setdefault(out.peer, deque()).append(out)
                held += 1
            for peer, pending in waiting.items():
                sock = self._socks.get(peer)
                while pending:
                    out = pending[0]
                    if sock is None:
                        self.stats.unknown_peer += 1
                        failed.append(pending.popleft())
                        continue
                    try:
                        sock.send(self._frames(peer, out), zmq.NOBLOCK)
                    except zmq.Again:
                        if now >= out.deadline:
                            failed.append(pending.popleft())
                            continue
                        break  # keep order: retry this peer on the next round
                    pending.popleft()
                    self.stats.sent += 1
            self.stats.send_failed += len(failed)
        self._report_failed(failed)

    def _report_failed(self, failed: deque[_Out]) -> None:
        """Tell the reader which messages never went (outside ``_lock``: this may block)."""
        for out in failed:
            # A failure report must not be lost to a full inbox: block briefly, the reader drains it.
            with contextlib.suppress(queue.Full):
                self._inbox.put(Inbound(out.peer, out.payload, failed=True), timeout=1.0)
                self._inbox_puts += 1
