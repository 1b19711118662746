"""Decode's memory budget as SGLang's disaggregated decode server keeps it: the rules (pure
arithmetic, the functions) and ``DecodeMemory``, which keeps each decode instance's budget in a
deployment run by them.

The rules follow ``python/sglang/srt/disaggregation/decode.py`` (``DecodePreallocQueue``) and
the scheduler's ``retract_decode``; the code here is ours:

- **Admission** (``pop_preallocated``, first come first served, the queue's head blocks the
  rest): a request is admitted, its pages allocated and its transfer started, only if its prompt's
  page-rounded tokens plus ``reserved`` tokens (``--num-reserved-decode-tokens``, 512) fit in
  the allocatable tokens: the free tokens less ``reserved`` for every request decode already
  holds (running, receiving or waiting), or less what the running batch's largest request still
  needs beyond everything the batch could give back, whichever is more; less what the retracted
  requests need to come back. The request must also fit whole (input + output) beside what the
  batch could give back. Output lengths count at most ``CLIP_NEW_TOKENS`` here (SGLang's
  ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``, 4096).
- **Retraction** (``retract_decode``): when a step finds fewer free pages than its sequences
  need, requests leave the batch, the fewest generated tokens first (ties: the longest prompt,
  then the latest in the batch), at least one, until the rest fit or one is left. A disaggregated
  decode server cannot recompute a prompt, so it swaps the request's KV out to host memory.
- **Resumption** (``resume_retracted_reqs``, before new admissions): a retracted request comes
  back, first in first out, when its tokens so far plus ``reserved`` fit the allocatable tokens
  (not counting the retracted queue); its KV is swapped back in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from kvferry.sim.deploy import hardware
from kvferry.sim.deploy.spec import DeployError, DeploySpec
from kvferry.sim.pages import PageAllocator
from kvferry.sim.rooms import Request

if TYPE_CHECKING:
    from kvferry.sim.deploy.tracks import Track
    from kvferry.sim.deploy.workload import DeployRequest
    from kvferry.sim.world import World

__all__ = [
    "CLIP_NEW_TOKENS",
    "DecodeMemory",
    "Running",
    "admits",
    "allocatable_tokens",
    "never_fits",
    "retraction_order",
]

CLIP_NEW_TOKENS = 4096

# One running request as the budget sees it: (input tokens, tokens generated so far, output
# tokens it will generate in all: SGLang's max_new_tokens).
Running = tuple[int, int, int]


def allocatable_tokens(
    free_tokens: int, reserved: int, holders: int, running: Sequence[Running], retracted_need: int = 0
) -> int:
    """Tokens decode may still promise. ``holders``: requests holding decode pages (running,
    receiving their KV, or waiting for the batch); ``retracted_need``: what the retracted
    requests need to come back (0 when resuming them: SGLang does not count them then)."""
    retractable = sum(i + g for i, g, _ in running)
    # The largest running request must be able to finish even if every other one is retracted.
    single = max((i + min(o, CLIP_NEW_TOKENS) - retractable for i, _, o in running), default=0)
    return free_tokens - max(reserved * holders, single) - retracted_need


def admits(
    prompt_alloc_tokens: int,
    input_tokens: int,
    output_tokens: int,
    reserved: int,
    allocatable: int,
    running: Sequence[Running],
) -> bool:
    """Whether a new request (its prompt's page-rounded tokens ``prompt_alloc_tokens``) may be
    admitted against ``allocatable`` tokens."""
    retractable = sum(i + g for i, g, _ in running)
    whole = input_tokens + min(output_tokens, CLIP_NEW_TOKENS)
    return max(prompt_alloc_tokens + reserved, whole - retractable) <= allocatable


def never_fits(
    prompt_alloc_tokens: int, input_tokens: int, output_tokens: int, reserved: int, pool_tokens: int
) -> bool:
    """Whether even an empty decode pool of ``pool_tokens`` would never admit the request (SGLang
    would keep it queued until its client gave up)."""
    return not admits(prompt_alloc_tokens, input_tokens, output_tokens, reserved, pool_tokens, ())


def retraction_order(batch: Sequence[tuple[int, int]]) -> list[int]:
    """Indices into ``batch`` ((input tokens, generated tokens) per running request, in batch
    order) in the order SGLang retracts them: fewest generated first, then the longest prompt,
    then the latest in the batch."""
    return sorted(range(len(batch)), key=lambda i: (batch[i][1], -batch[i][0], -i))


class DecodeMemory:
    """Each decode instance's memory by the rules above, with SGLang's allocator (``grows``;
    "lowest-first" keeps none of it): the requests holding decode pages (``holders``: receiving,
    waiting or running; not retracted), the running batch (``running``, changed in place by the
    batch loop; admission reads it), the retracted requests' keys (first in first out), and the
    pages each request took for its generated tokens (``grown``).

    A swap's ns: one decode page's bytes on one rank, and a hybrid model's recurrent state of one
    request on one rank (SGLang's offload_kv_cache copies both), over the GPU's pinned copy rate
    (each rank swaps its own slice at once)."""

    def __init__(self, spec: DeploySpec, world: World, tracks: dict[int, Track], n: int) -> None:
        self.grows = spec.page_allocator == "sglang"
        self.page_size, self.reserved = spec.decode_page_size, spec.decode_reserved_tokens
        self.max_batch = spec.max_batch
        self.world, self.tracks = world, tracks
        self.holders = [0] * n
        self.running: list[list[Track]] = [[] for _ in range(n)]
        self.retracted: list[deque[int]] = [deque() for _ in range(n)]
        self.grown: dict[int, list[np.ndarray]] = {}
        # Per instance: how many more ``grow`` calls will find no sequence at a page boundary
        # (every sequence gains one token a step; one that joins resets it: ``joined``).
        self._calm = [0] * n
        # Generated-token pages a step found no free page for even after retracting every
        # request but one; retractions; simulated ns decode steps waited for swaps out and in.
        self.growth_short = self.retractions = self.swap_ns = 0
        gbps = hardware.gpu(spec.gpu).copy_pinned_gbps
        self.swap_ns_per_page = spec.page_bytes("decode") / gbps
        self.swap_ns_state = spec.geometry().state_bytes // spec.decode_tp / gbps

    def refuse_what_never_fits(self, lengths: tuple[DeployRequest, ...]) -> None:
        ps = self.page_size
        pool = self.world.scenario.topology.decode_pages * ps
        reserved = self.reserved
        for r in {(q.input_tokens, q.output_tokens) for q in lengths}:
            if never_fits(-(-r[0] // ps) * ps, r[0], r[1], reserved, pool):
                raise DeployError(
                    f"a request of {r[0]} input and {r[1]} output tokens never fits decode's "
                    f"{pool:,} tokens a rank with {reserved} reserved (SGLang would never admit it): "
                    "raise the decode TP or lower decode_reserved_tokens"
                )

    def fits(self, req: Request, pages: PageAllocator, n: int) -> bool:
        """Whether decode admits the request (``n`` prompt pages) now."""
        j, ps, reserved = req.dec_inst, self.page_size, self.reserved
        running = self._running_view(j)
        budget = allocatable_tokens(
            self._free_tokens(pages), reserved, self.holders[j], running, self._retracted_need(j)
        )
        r = self.tracks[req.key].req
        return admits(n * ps, r.input_tokens, r.output_tokens, reserved, budget, running)

    def released(self, j: int) -> bool:
        """A holder of instance ``j`` gave its pages back; whether a retracted request waits."""
        self.holders[j] -= 1
        return bool(self.retracted[j])

    def _free_tokens(self, pages: PageAllocator) -> int:
        return (self.world.scenario.topology.decode_pages - pages.used) * self.page_size

    def _running_view(self, j: int) -> list[Running]:
        return [(t.req.input_tokens, t.tokens, t.req.output_tokens) for t in self.running[j]]

    def _pages_for(self, t: Track) -> int:
        """Pages holding a request's tokens so far (its prompt and what it generated)."""
        return -(-(t.req.input_tokens + t.tokens) // self.page_size)

    def _retracted_need(self, j: int) -> int:
        ps, reserved = self.page_size, self.reserved
        return sum(self._pages_for(self.tracks[k]) * ps + reserved for k in self.retracted[j])

    def _pages(self, j: int) -> PageAllocator:
        w = self.world
        return w.allocs[w.instance_nodes["decode"][j][0]][0]

    def _swap_ns(self, pages: int) -> int:
        return round(pages * self.swap_ns_per_page + self.swap_ns_state)

    def retract(self, j: int, t: Track, k: int) -> int:
        """Swap request ``k`` out of decode instance ``j``: its pages go back, it queues to come
        back. Returns the swap's ns."""
        req = self.world.requests[k]
        held = [req.dec_pages, *self.grown.pop(k, [])]
        ids = np.concatenate(held)
        self._pages(j).free(ids, k)
        req.dec_pages = ids[:0]  # until it comes back with new ones
        self.holders[j] -= 1
        self.retracted[j].append(k)
        t.retractions += 1
        self.retractions += 1
        return self._swap_ns(len(ids))

    def joined(self, j: int) -> None:
        """A sequence joined instance ``j``'s batch: its next page boundary is not counted yet."""
        self._calm[j] = 0

    def resume(self, j: int, batch: list[Track], keys: list[int]) -> tuple[int, int]:
        """Bring retracted requests back into the batch while there is room (first in, first
        out). Returns the swaps' ns and the tokens they add to the batch's context (the caller
        marks the joins: ``joined``)."""
        q, pages = self.retracted[j], self._pages(j)
        ps, reserved = self.page_size, self.reserved
        ns = added = 0
        while q and len(batch) < self.max_batch:
            k = q[0]
            t = self.tracks[k]
            n = self._pages_for(t)
            # SGLang resumes against the free tokens less the holders' reservation only.
            room = allocatable_tokens(self._free_tokens(pages), reserved, self.holders[j], ())
            if n * ps + reserved > room:
                break
            got = pages.alloc(n, k)
            if got is None:
                break
            q.popleft()
            self.world.requests[k].dec_pages = got
            self.holders[j] += 1
            batch.append(t)
            keys.append(k)
            ns += self._swap_ns(n)
            added += t.req.input_tokens + t.tokens
        return ns, added

    def grow(self, j: int, batch: list[Track], keys: list[int]) -> tuple[int, int]:
        """Give every sequence of the step a page for the token it writes when its pages are
        full, in batch order from one free list (SGLang's alloc_decode: the new pages of a step
        are consecutive free-list entries, interleaving the requests); first retract requests
        if the free pages do not cover them. Returns the swaps' ns and the tokens the retracted
        requests take out of the batch's context."""
        calm = self._calm[j]
        if calm:  # no sequence reaches a page boundary this step (counted at the last scan)
            self._calm[j] = calm - 1
            return 0, 0
        ps = self.page_size
        needy = 0
        nearest = ps  # steps until the next sequence fills its page after this one
        for t in batch:  # a loop, not a generator: asked at every decode step
            left = (t.req.input_tokens + t.tokens) % ps
            if not left:
                needy += 1
            elif ps - left < nearest:
                nearest = ps - left
        self._calm[j] = nearest - 1  # the steps before then need no page (retractions only help)
        if not needy:
            return 0, 0  # every sequence has room in its last page: nothing to allocate or free
        pages = self._pages(j)
        short = needy - (self.world.scenario.topology.decode_pages - pages.used)
        ns = removed = 0
        if short > 0 and len(batch) > 1:
            ns, removed = self._make_room(j, batch, keys, short)
        for t, k in zip(batch, keys, strict=True):
            pos = t.req.input_tokens + t.tokens  # the token this step writes
            if pos % ps:
                continue  # room left in its last page
            got = pages.alloc(1, k)
            if got is None:
                self.growth_short += 1
                continue
            self.grown.setdefault(k, []).append(got)
        return ns, removed

    def _make_room(self, j: int, batch: list[Track], keys: list[int], short: int) -> tuple[int, int]:
        """Retract requests, in SGLang's order, until ``short`` more pages are free or one is
        left. Returns the swaps' ns and the tokens they take out of the batch's context."""
        ps = self.page_size
        ns = removed = 0
        order = retraction_order([(t.req.input_tokens, t.tokens) for t in batch])
        out: set[int] = set()
        for i in order:
            if short <= 0 or len(out) == len(batch) - 1:
                break
            t = batch[i]
            held = len(self.world.requests[keys[i]].dec_pages) + sum(map(len, self.grown.get(keys[i], [])))
            short -= held + ((t.req.input_tokens + t.tokens) % ps == 0)  # its pages, its need
            ns += self.retract(j, t, keys[i])
            removed += t.req.input_tokens + t.tokens
            out.add(i)
        batch[:] = [t for i, t in enumerate(batch) if i not in out]
        keys[:] = [k for i, k in enumerate(keys) if i not in out]
        self.world.memory_event()
        return ns, removed

    def free_grown(self, req: Request) -> None:
        grown = self.grown.pop(req.key, None)
        if grown:
            self._pages(req.dec_inst).free(np.concatenate(grown), req.key)
            self.world.memory_event()
