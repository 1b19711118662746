"""Request arrivals of a deployment: a Poisson rate, a closed-loop concurrency, or a trace file.

A trace is JSONL (one object per line) or CSV (a header row) with ``arrival_s`` (seconds from the
start), ``input_tokens`` and ``output_tokens``, and optionally ``prefix_hit_tokens`` (input tokens
already cached on prefill: not computed, still transferred).
"""

from __future__ import annotations

import csv
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kvferry.core.errors import KvferryError

__all__ = ["Arrivals", "DeployRequest", "WorkloadError", "load_trace", "poisson", "random_lengths"]

NS = 1_000_000_000


class WorkloadError(KvferryError, ValueError):
    """A workload that cannot be run; the message names the line or field."""


@dataclass(frozen=True, slots=True)
class DeployRequest:
    arrival_ns: int
    input_tokens: int
    output_tokens: int
    prefix_hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Open-loop requests (``requests``), or a closed loop of ``concurrency`` users who each send
    the next request when their previous one finishes, ``total`` requests in all (drawn from
    ``template`` in order)."""

    requests: tuple[DeployRequest, ...] = ()
    concurrency: int = 0
    total: int = 0

    @property
    def count(self) -> int:
        return self.total if self.concurrency else len(self.requests)


def _tokens(rng: random.Random, mean: int, spread: float) -> int:
    if spread <= 0:
        return mean
    return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))


def poisson(
    rate_per_s: float, n: int, isl: int, osl: int, seed: int, spread: float = 0.0
) -> tuple[DeployRequest, ...]:
    """``n`` requests with exponential gaps of mean 1/rate; lengths uniform within +-spread."""
    if rate_per_s <= 0 or n < 1 or isl < 1 or osl < 1 or not 0 <= spread < 1:
        raise WorkloadError(
            "poisson workload: rate, requests, isl and osl must be positive, spread in [0, 1)"
        )
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(DeployRequest(int(t * NS), _tokens(rng, isl, spread), _tokens(rng, osl, spread)))
    return tuple(out)


def closed_loop(
    concurrency: int, n: int, isl: int, osl: int, seed: int, spread: float = 0.0
) -> tuple[Arrivals, tuple[DeployRequest, ...]]:
    """A closed loop and the lengths of its requests (arrival times are set as the run goes)."""
    if concurrency < 1 or n < 1 or isl < 1 or osl < 1 or not 0 <= spread < 1:
        raise WorkloadError("concurrency workload: concurrency, requests, isl and osl must be positive")
    rng = random.Random(seed)
    lengths = tuple(DeployRequest(0, _tokens(rng, isl, spread), _tokens(rng, osl, spread)) for _ in range(n))
    return Arrivals(concurrency=concurrency, total=n), lengths


def random_lengths(n: int, isl: int, osl: int, range_ratio: float, seed: int) -> tuple[DeployRequest, ...]:
    """Lengths as SGLang's ``bench_serving --dataset-name random`` draws them: input tokens uniform
    over the integers [max(int(isl * range_ratio), 1), isl], output over [int(osl * range_ratio),
    osl] (the default ratio, 0, makes that 1..isl and 0..osl: means of about isl/2 and osl/2);
    an output of 0 is taken as 1 (a request here decodes at least its first token)."""
    if n < 1 or isl < 1 or osl < 1 or not 0 <= range_ratio <= 1:
        raise WorkloadError("random lengths: requests, isl and osl must be positive, range_ratio in [0, 1]")
    rng = np.random.default_rng(seed)
    ins = rng.integers(max(int(isl * range_ratio), 1), isl + 1, size=n)
    outs = rng.integers(int(osl * range_ratio), osl + 1, size=n)
    return tuple(DeployRequest(0, int(i), max(1, int(o))) for i, o in zip(ins, outs, strict=True))


def _int_field(row: dict[str, object], key: str, where: str, required: bool = True) -> int:
    v = row.get(key)
    if v is None or v == "":
        if required:
            raise WorkloadError(f"{where}: missing {key}")
        return 0
    try:
        x = float(v) if isinstance(v, str) else v
        if isinstance(x, bool) or not isinstance(x, int | float) or x != int(x) or x < 0:
            raise ValueError
    except ValueError:
        raise WorkloadError(f"{where}: {key} must be a non-negative integer, got {v!r}") from None
    return int(x)


def load_trace(path: str | Path) -> tuple[DeployRequest, ...]:
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise WorkloadError(f"{p}: cannot read the trace: {e}") from None
    rows: list[tuple[str, dict[str, object]]] = []
    if p.suffix.lower() == ".csv":
        for i, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
            rows.append((f"{p}:{i}", dict(row)))
    else:
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{p}:{i}: not JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{p}:{i}: expected a JSON object")
            rows.append((f"{p}:{i}", obj))
    out = []
    for where, row in rows:
        try:
            arrival = float(row.get("arrival_s"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise WorkloadError(
                f"{where}: arrival_s must be a number of seconds, got {row.get('arrival_s')!r}"
            ) from None
        if not arrival >= 0:
            raise WorkloadError(f"{where}: arrival_s must be >= 0, got {arrival}")
        isl = _int_field(row, "input_tokens", where)
        osl = _int_field(row, "output_tokens", where)
        hit = _int_field(row, "prefix_hit_tokens", where, required=False)
        if isl < 1 or osl < 1:
            raise WorkloadError(f"{where}: input_tokens and output_tokens must be >= 1")
        if hit >= isl:
            raise WorkloadError(f"{where}: prefix_hit_tokens {hit} must be below input_tokens {isl}")
        out.append(DeployRequest(int(arrival * NS), isl, osl, hit))
    if not out:
        raise WorkloadError(f"{p}: the trace has no requests")
    return tuple(sorted(out, key=lambda r: r.arrival_ns))
