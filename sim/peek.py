"""A control message's tag and room, decoded without the rest (``World._on_control`` reads every
message twice, sent and delivered; a pull offer carries a whole registration).

A module of its own, outside sim/world.py: a msgspec Struct declared in a module compiled by
mypyc (bench/mypyc_build.py) gets mypyc's run-time annotations, which msgspec misreads
(``int | None`` as ``type``), so the struct stays in a module that is always interpreted.
"""

from __future__ import annotations

import msgspec
from kvferry.core.messages import Abort, RoomFailed

__all__ = ["NOTICE_TAGS", "peek_decoder"]


# Its name shows in isolation violations (sim/instances.py names the message's type): kept.
class _Peek(msgspec.Struct):
    """A control message's tag and room, its other fields skipped."""

    t: str = ""
    room: int | None = None
    transfer_id: str | None = None


peek_decoder = msgspec.msgpack.Decoder(_Peek)
# The failure notices (RoomFailed, Abort), whose copies the world logs per room.
NOTICE_TAGS = frozenset({RoomFailed.__struct_config__.tag, Abort.__struct_config__.tag})
