"""Decode's memory budget as SGLang's disaggregated decode server keeps it (pure arithmetic).

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

from collections.abc import Sequence

__all__ = ["CLIP_NEW_TOKENS", "Running", "admits", "allocatable_tokens", "never_fits", "retraction_order"]

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
