"""Keeps the original exception of a failed write for the poller.

The shared driver turns a transport exception (or an ERR state) into ``WriteFailed`` with a text
reason, which fails the room through the core and tells decode; the exception object itself does
not travel through the core's events. This tap sits between the driver and the transport: when a
post raises, or a write ends in ERR, it records the exception on the status board for the write's
room (read from the notification the write carries), so ``failure_exception()`` raises it with
its original type. It decides nothing and changes no outcome.

Ownership: ``_rooms`` (ticket -> the write's notification, decoded to its room only on failure)
gets a key from the worker that posted the ticket, outside the driver lock but before the handle
is published to the driver, and loses it in ``check_xfer``, under the driver lock; single-key
dict operations are atomic under the GIL, and no poller sees a ticket before its key is in.
"""

from __future__ import annotations

from typing import Any

from kvferry.backends.nixl.errors import NixlXferError
from kvferry.backends.runtime.board import StatusBoard
from kvferry.backends.transport import XferState
from kvferry.core.errors import WireError
from kvferry.core.messages import decode_note


class ErrorTap:
    def __init__(self, inner: Any, board: StatusBoard) -> None:
        self._inner = inner
        self._board = board
        self._rooms: dict[int, bytes] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _room_of(self, notif: bytes) -> tuple[int, str] | None:
        try:
            note = decode_note(notif)
        except WireError:
            return None
        return note.room, note.transfer_id

    def _post(self, fn: Any, notif: bytes, *args: Any) -> Any:
        # The notification is decoded only if the write fails: most never do.
        try:
            handle = fn(*args)
        except Exception as exc:
            self._fail(notif, exc)
            raise
        self._rooms[id(handle)] = notif
        return handle

    def _fail(self, notif: bytes, exc: BaseException) -> None:
        key = self._room_of(notif)
        if key is not None:
            self._board.fail(key[0], key[1], exc)

    def post_write(self, peer: Any, *args: Any) -> Any:
        return self._post(self._inner.post_write, args[-1], peer, *args)

    def post_aux_write(self, peer: Any, src: int, dst: int, notif: bytes) -> Any:
        return self._post(self._inner.post_aux_write, notif, peer, src, dst, notif)

    def check_xfer(self, handle: Any) -> XferState:
        state = self._inner.check_xfer(handle)
        if state is not XferState.PROC:
            notif = self._rooms.pop(id(handle), None)
            if state is XferState.ERR and notif is not None:
                self._fail(notif, NixlXferError(f"write to {handle.peer} ended in ERR"))
        return state
