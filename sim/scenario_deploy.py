"""A scenario's optional ``[deploy]`` table: knobs of ``kvferry select``'s deployment
(sim/deploy/spec.py ``DeploySpec``) that the file's other tables do not already set.

Its keys are DeploySpec's own fields, read off the dataclass, so a field added there is accepted
here with no change (with the type its annotation gives). Replay ignores the table; ``kvferry
select --scenario`` lays it over the spec it builds from its options, so the file's values win.
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import fields
from typing import Any

import msgspec
from kvferry.core.errors import KvferryError
from kvferry.core.geometry import PRESETS
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.scenario_errors import at, scenario_error
from kvferry.sim.scenario_schema import Scenario, ScenarioError

__all__ = ["DOC", "REFUSED", "keys", "read", "spec_fields"]

# DeploySpec fields refused in [deploy], each with where it belongs instead. The first seven are
# what select already reads from the other tables (spec_fields): a second place for them would
# be a second answer. Select ignores the file's seed (--seed sets it), and it sets the flow of
# each run itself, since it compares every applicable flow: a [deploy] flow would do nothing.
REFUSED: dict[str, str] = {
    "model": "it belongs in [model] (preset = ...)",
    "prefill_tp": "it belongs in [topology].prefill_tp",
    "decode_tp": "it belongs in [topology].decode_tp",
    "prefill_page_size": "it belongs in [topology].prefill_page_size",
    "decode_page_size": "it belongs in [topology].decode_page_size",
    "workers": "it belongs in [topology].workers",
    "chunk_tokens": "it belongs in [workload].chunk_tokens",
    "seed": "it belongs at the top level (seed = N), and kvferry select takes --seed",
    "flow": "kvferry select runs and compares every applicable flow (pick them with --flows); "
    "replay's flow belongs in [flows].flow",
}

# What docs/scenarios.md says of each key; a field added to DeploySpec without a line here is
# still accepted, and documented by a pointer to spec.py.
DOC: dict[str, str] = {
    "gpu": "GPU profile of every rank (sim/deploy/profiles: h100, h200, gb200).",
    "nic": "NIC profile of every GPU: nic-100g, nic-200g, nic-400g, or one fitted by `kvferry calibrate`.",
    "staging_chunks": "Ring and pinned staging pools hold this many of the largest chunk "
    "(select: at most 1024).",
    "max_batch": "Decode's largest batch (select: at most 65536).",
    "weight_bytes": "Bytes per weight: 2 (BF16) or 1 (FP8, select's `--fp8-weights`).",
    "ttft_slo_ms": "TTFT SLO for goodput, in ms.",
    "tpot_slo_ms": "TPOT SLO for goodput, in ms.",
    "prefill_instances": "Prefill instances of select's deployment (up to 64; `[topology]`'s are "
    "replay's servers); requests go round-robin.",
    "decode_instances": "Decode instances of select's deployment (up to 64); each request goes to "
    "the least loaded.",
    "decode_ep": "Expert parallelism over the decode instances: a MoE model's routed experts "
    "spread over this many of them (it divides `decode_instances`).",
    "control_path": "Fitted profile (`kvferry calibrate --rooms`) whose per-room control path the "
    'runtime pays over the NIC\'s wire ("": an ideal runtime).',
    "pull_orchestration": "When the pull flow's decode side starts: overlapped (at arrival) or "
    "serial (vLLM's proxy order: after prefill, `proxy_hop_ms` and decode's running step).",
    "proxy_hop_ms": "Serial pull: prefill's response to the proxy plus the proxy's request to decode, in ms.",
    "page_allocator": "How servers hand out KV pages: sglang (SGLang's sorted free list, decode "
    "taking pages for generated tokens) or lowest-first (the original model).",
    "every_rank": "Simulate every TP rank of each instance; false (the default) runs one of the "
    "identical TP groups an instance pair's ranks split into, the same timings several times faster.",
    "decode_reserved_tokens": "SGLang's `--num-reserved-decode-tokens` (sglang allocator): decode "
    "admits a request only with this many tokens to spare for it and each request it holds.",
}
_SCALARS = (bool, int, float, str)  # what a TOML value maps onto without conversion rules


def keys() -> dict[str, type]:
    """The keys [deploy] accepts, in DeploySpec's order, each with its Python type: every field
    of a scalar type that is not in REFUSED (a field of another type has no TOML spelling yet)."""
    hints = typing.get_type_hints(DeploySpec)
    return {
        f.name: hints[f.name]
        for f in fields(DeploySpec)
        if f.name not in REFUSED and hints[f.name] in _SCALARS
    }


def spec_fields(s: Scenario) -> dict[str, Any]:
    """The DeploySpec fields the scenario's other tables set (``kvferry select`` takes them)."""
    t, w = s.topology, s.workload
    return {
        "model": s.model.name,
        "prefill_tp": t.prefill_tp,
        "decode_tp": t.decode_tp,
        "prefill_page_size": t.prefill_page_size,
        "decode_page_size": t.decode_page_size,
        "workers": t.workers,
        "chunk_tokens": w.chunk_tokens or w.tokens_max,
    }


def _table(known: dict[str, type]) -> type:
    """The [deploy] table as a Struct: every key optional (UNSET: select's option decides)."""
    return msgspec.defstruct(
        "DeployTable",
        [(k, kind | msgspec.UnsetType, msgspec.UNSET) for k, kind in known.items()],
        frozen=True,
        forbid_unknown_fields=True,
    )


def read(file: str, table: Any, s: Scenario) -> dict[str, Any]:
    """The [deploy] table of the file ``where``, checked: known keys of the right types, and, as
    a whole, a deployment DeploySpec.check() accepts (with ``s``'s model, TP, page sizes, workers
    and chunk size, and DeploySpec's defaults for the keys left out)."""
    where = f"{file}: [deploy]"
    known = keys()
    if isinstance(table, dict):
        for key in table:
            if key in REFUSED:
                raise ScenarioError(f"{at(where, key)}: not a [deploy] key: {REFUSED[key]}")
            if key not in known:
                # The accepted keys always listed: they come from DeploySpec, not from a fixed list.
                hint = difflib.get_close_matches(key, list(known), n=1)
                mean = f"did you mean {hint[0]!r}? " if hint else ""
                raise ScenarioError(f"{at(where, key)}: unknown field ({mean}known: {', '.join(known)})")
    kind = _table(known)
    try:
        decoded = msgspec.convert(table, kind)
    except msgspec.ValidationError as e:
        raise scenario_error(e, table, kind, file, base=("deploy",)) from None
    out = {k: getattr(decoded, k) for k in known if getattr(decoded, k) is not msgspec.UNSET}
    for k, v in out.items():
        if isinstance(v, float) and not math.isfinite(
            v
        ):  # TOML has nan and inf; the spec's checks let NaN through
            raise ScenarioError(f"{at(where, k)}: expected a finite number, got {v}")
    if not out:
        return out
    if s.model.name not in PRESETS:
        raise ScenarioError(
            f"{where}: needs a model preset ([model] preset = ...): select times a known model's "
            f"compute, and {s.model.name!r} is not one"
        )
    try:
        DeploySpec(**spec_fields(s), **out).check()
    except KvferryError as e:  # DeployError, or ProfileError for an unknown gpu / nic
        raise ScenarioError(f"{where}: {e}") from None
    return out
