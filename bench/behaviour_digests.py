"""Behaviour digests: what a restructuring of the core must leave unchanged.

Three families, each one JSON line per case in the output file:
- ``replay``: ``kvferry replay --json`` of every scenario (scenarios/, its presets, tests/scenarios/)
  at two seeds, and of every scenario of scenarios/ under each flow override at one seed. Stored:
  the trace digest, event count, outcomes, violations and a hash of the whole report (wall_s out).
- ``fuzz``: ``kvferry fuzz`` per-seed outcomes (the same fields) for a seed range.
- ``engine``: every engine call of the in-memory harness (tests/harness.py: real engines behind the
  real driver) for each flow and several TP pairs, hashed with the commands each call returned.

Run: ``python bench/behaviour_digests.py record OUT.jsonl [--fuzz 0-1999]`` once before a change,
then ``python bench/behaviour_digests.py check OUT.jsonl`` after it: it prints every case whose
digest moved and exits 1 if any did.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

REPLAY_SEEDS = (1, 2)
FLOWS = ("direct", "ring", "pinned", "pull", "push", "mixed")


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    d = {k: v for k, v in d.items() if k != "wall_s"}
    return {
        "digest": d["digest"],
        "events": d["events"],
        "succeeded": d["succeeded"],
        "failed": d["failed"],
        "violated": sorted({v["invariant"] for v in d["violations"]}),
        "report": _hash(d),
    }


def scenario_files() -> list[Path]:
    return (
        sorted(ROOT.glob("scenarios/*.toml"))
        + sorted(ROOT.glob("scenarios/presets/*.toml"))
        + sorted(ROOT.glob("tests/scenarios/*.toml"))
    )


def replay_cases() -> Iterator[dict[str, Any]]:
    from kvferry.sim import scenario as sc
    from kvferry.sim.campaign import run_one

    for path in scenario_files():
        base = sc.load(path)
        flows: tuple[str | None, ...] = (None,)
        if path.parent == ROOT / "scenarios":
            flows += FLOWS
        for flow in flows:
            s = base if flow is None else sc.with_flow(base, flow)
            for seed in REPLAY_SEEDS if flow is None else REPLAY_SEEDS[:1]:
                res, _ = run_one(s, seed=seed, detail=True)
                key = f"replay {path.relative_to(ROOT)} seed={seed} flow={flow or '-'}"
                yield {"case": key, **_summary(res.as_dict(detail=True))}


def fuzz_cases(seeds: list[int]) -> Iterator[dict[str, Any]]:
    from kvferry.sim import campaign as cp

    for res in cp.campaign(seeds):
        yield {"case": f"fuzz seed={res.seed}", **_summary(res.as_dict())}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return [str(obj.dtype), obj.shape, obj.tobytes().hex()]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    return repr(obj)


_enc = msgspec.json.Encoder(enc_hook=_enc_hook)


def engine_cases() -> Iterator[dict[str, Any]]:
    import harness as H
    from kvferry.core.geometry import ModelGeometry

    tiny4 = ModelGeometry("tiny4", num_layers=2, num_kv_heads=4, head_dim=4)
    for flow in ("direct", "ring", "pinned", "pull", "push", "mixed"):
        for p, d in ((1, 1), (2, 1), (1, 2), (4, 2)):
            w = H.World(
                tiny4,
                p,
                d,
                flow=flow,
                ring_bytes=512,
                pinned_bytes=512,
                worker_buffer_bytes=512,
                prefill_pinned_bytes=512,
                seed=p * 10 + d,
            )
            h = hashlib.sha256()
            calls = [0]

            def wrap(name: str, fn: Any, h: Any = h, calls: list[int] = calls) -> Any:
                def recorded(ev: Any, now: int) -> Any:
                    out = fn(ev, now)
                    calls[0] += 1
                    h.update(name.encode() + _enc.encode(ev) + _enc.encode(out) + str(now).encode())
                    return out

                return recorded

            for r in w.ranks:
                tag = f"{r.side}{r.index}"
                r.engine.handle = wrap(tag, r.engine.handle)
                if r.side == "prefill":
                    r.engine.run_chunk = wrap(tag + ".run", r.engine.run_chunk)
            cuts = [3, 6, 9, 10]
            reqs = [w.open_room(100 + i, f"t{i}", 10, cuts) for i in range(4)]
            w.flush()
            for n in range(len(cuts)):
                for req in reqs:
                    for q in range(w.P):
                        w.chunk_ready(req, q)  # type: ignore[arg-type]
                    if n == 1 and req is reqs[1]:
                        w.abort(req, "decode", 0)  # one room fails mid-transfer
                    if n == 2 and req is reqs[2]:
                        w.abort(req, "prefill", 0)
                w.flush()
            w.heal_and_settle()
            yield {
                "case": f"engine flow={flow} tp={p}->{d}",
                "calls": calls[0],
                "hash": h.hexdigest()[:16],
                "violations": len(w.violations),
            }


def parse_seeds(text: str) -> list[int]:
    a, _, b = text.partition("-")
    return list(range(int(a), int(b or a) + 1))


def collect(fuzz: str) -> Iterator[dict[str, Any]]:
    yield from engine_cases()
    yield from replay_cases()
    if fuzz:
        yield from fuzz_cases(parse_seeds(fuzz))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("file", type=Path)
    ap.add_argument("--fuzz", default="0-1999", help="fuzz seeds (a-b), empty for none")
    a = ap.parse_args()
    if a.mode == "record":
        with a.file.open("w") as f:
            for row in collect(a.fuzz):
                f.write(json.dumps(row, sort_keys=True) + "\n")
                f.flush()
        return
    want = {row["case"]: row for row in map(json.loads, a.file.read_text().splitlines())}
    fuzz = [int(k.split("=")[1]) for k in want if k.startswith("fuzz ")]
    seeds = f"{min(fuzz)}-{max(fuzz)}" if fuzz else ""
    moved = 0
    seen = set()
    for row in collect(seeds):
        seen.add(row["case"])
        old = want.get(row["case"])
        if old != row:
            moved += 1
            print(f"MOVED {row['case']}\n  was {old}\n  now {row}")
    for case in sorted(set(want) - seen):
        moved += 1
        print(f"MISSING {case}")
    print(f"{len(seen)} cases, {moved} moved")
    sys.exit(1 if moved else 0)


if __name__ == "__main__":
    main()
