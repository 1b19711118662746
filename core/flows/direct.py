"""The direct flow, both halves: prefill WRITEs the planner's descriptors straight into decode's
pages; decode records each chunk's note and checks that the chunks tile its allocation.

Push (core/flows/push.py) is direct's writes under registration leases: the same prefill half
with ``leased`` on, which asks the room's lease before each post. Decode's half serves every flow
whose data notes name no staging allocation (direct, push, and flows registered outside
``Flow``): a note carries no flow on the wire, so decode tells the flows apart only by that.
"""

from __future__ import annotations

from typing import Any

from kvferry.core import messages as m
from kvferry.core.commands import DropPrepared, PostPrepared, PostWrite, PrepareWrite, SendNotif
from kvferry.core.events import ChunkReady
from kvferry.core.flows import registry
from kvferry.core.flows.policy import Flow
from kvferry.core.machine import RoomError
from kvferry.core.worker import ChunkWrite, plan_chunk

__all__ = ["DirectReceiver", "DirectSender", "prepare_command", "write_command"]


class DirectSender:
    """Prefill half: plan the chunk against every decode rank, one PostWrite per descriptor set
    (the chunk's note rides on each), a bare note to a rank with nothing to receive."""

    __slots__ = ("leased",)

    def __init__(self, *, leased: bool = False) -> None:
        self.leased = leased  # push: every post goes through the room's lease (ctx.push)

    @property
    def plans_ahead(self) -> bool:
        """A chunk named ahead (core/flows/ahead.py) can be planned and prepared now: not under
        leases, whose post is decided only when the chunk runs."""
        return not self.leased

    def run_chunk(self, ctx: Any, r: Any, c: ChunkReady) -> str:
        start, end = ctx.chunk_bounds(r, c)
        ahead = None if self.leased else ctx.take_ahead(r, c, start, end)
        if ahead is not None:
            return self._post_ahead(ctx, r, c, start, end, ahead)
        writes = plan_chunk(ctx.planner, ctx.pool, c.src_pages, ctx.destinations(r), start, end)
        push = ctx.push if self.leased else None
        now = ctx.now()
        if push is not None and c.chunk_index == 0:
            push.finish(r.key, now)
        ctx.advance(r, c, end)
        posted: list[int] = []
        note = ctx.chunk_note(r, c, start, end)  # identical for every data write: encode once
        emit = ctx.emit
        for w in writes:
            if not len(w.length):
                emit(SendNotif(peer=w.peer, room=r.room, notif=note))
                continue
            if push is not None:
                push.post(r.key, w.peer, now)
            wid = ctx.new_write(r)
            if push is not None:
                push.posted(wid, r.key, w.peer)
            posted.append(wid)
            emit(write_command(wid, r.room, w, note))
        return ctx.finish_run(r, c, start, end, posted, lease=push)

    @staticmethod
    def _post_ahead(ctx: Any, r: Any, c: ChunkReady, start: int, end: int, ahead: Any) -> str:
        """The chunk was planned ahead (core/flows/ahead.py) and matches: post what was prepared.
        A step that fails midway gives every prepared write back (its commands are withdrawn; a
        DropPrepared leaves anyway, and one of an id already given back is a no-op)."""
        ctx.advance(r, c, end)
        posted: list[int] = []
        emit = ctx.emit
        try:
            for peer, prep_id in ahead.writes:
                if not prep_id:
                    emit(SendNotif(peer=peer, room=r.room, notif=ahead.note))
                    continue
                wid = ctx.new_write(r)
                posted.append(wid)
                emit(PostPrepared(prep_id=prep_id, write_id=wid, peer=peer, room=r.room))
            return ctx.finish_run(r, c, start, end, posted, prepared_aux=ahead.aux)
        except Exception:
            for prep_id in ahead.prep_ids():
                emit(DropPrepared(prep_id=prep_id, room=r.room))
            raise


def write_command(write_id: int, room: int, w: ChunkWrite, note: bytes) -> PostWrite:
    """The WRITE of one planned descriptor set (``core.worker.ChunkWrite``), the note riding on it."""
    return PostWrite(write_id=write_id, **_write_fields(room, w, note))


def prepare_command(prep_id: int, room: int, w: ChunkWrite, note: bytes) -> PrepareWrite:
    """The same WRITE made ready ahead of its chunk (core/flows/ahead.py), posted later by id."""
    return PrepareWrite(prep_id=prep_id, **_write_fields(room, w, note))


def _write_fields(room: int, w: ChunkWrite, note: bytes) -> dict[str, Any]:
    return {
        "peer": w.peer,
        "room": room,
        "src_region": w.src_region,
        "src_offset": w.src_offset,
        "dst_region": w.dst_region,
        "dst_offset": w.dst_offset,
        "length": w.length,
        "notif": note,
    }


class DirectReceiver:
    """Decode half: one sender's chunk ledger. Chunks count as a set (whatever the order); once
    the last is in, their token ranges must tile [token_start, num_tokens) exactly."""

    __slots__ = ()

    def on_note(self, ctx: Any, r: Any, prog: Any, note: m.ChunkNote) -> bool:
        idx, rng = note.chunk_index, (note.token_start, note.token_end)
        seen = prog.chunks.get(idx)
        if seen is not None:
            if seen != rng:
                raise RoomError(f"chunk {idx} from {note.src} arrived twice with ranges {seen} and {rng}")
            ctx.count("duplicate_notification")
            return False
        if note.token_end > r.num_tokens:
            raise RoomError(
                f"chunk {idx} from {note.src} ends at token {note.token_end}, "
                f"past the {r.num_tokens} allocated"
            )
        if prog.last_index >= 0 and idx > prog.last_index:
            raise RoomError(f"chunk {idx} from {note.src} after its last chunk {prog.last_index}")
        if note.is_last:
            if prog.last_index >= 0:
                raise RoomError(f"two last chunks from {note.src}")
            if any(i > idx for i in prog.chunks):
                raise RoomError(f"last chunk {idx} from {note.src} but a later chunk already arrived")
            prog.last_index = idx
        prog.chunks[idx] = rng
        if prog.last_index >= 0 and len(prog.chunks) == prog.last_index + 1:
            # Every chunk is in: the ranges must tile [token_start, num_tokens) (a prefix hit
            # starts later; nothing is shifted to the front).
            pos = r.token_start
            for i in range(prog.last_index + 1):
                start, end = prog.chunks[i]
                if start != pos:
                    raise RoomError(f"chunk {i} from {note.src} starts at token {start}, expected {pos}")
                pos = end
            if pos != r.num_tokens:
                raise RoomError(f"{note.src} delivered {pos} tokens but decode allocated {r.num_tokens}")
            prog.done = True
        return True


DIRECT = DirectReceiver()
registry.register(Flow.DIRECT, DirectSender(), DIRECT)
registry.register(Flow.PUSH, DirectSender(leased=True), DIRECT)
