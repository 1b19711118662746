"""Re-run docs/fidelity.md's published comparisons on the current NIC profiles (transport-named
posting costs): SGLang PR 18968 (direct against pinned, TP 4 -> 2 and 2 -> 4), SGLang PR 22536 (ring against
direct at 512 and 1024 users) and vLLM PR 35264 (push against pull). Prints one JSON line per point.

Run: ``python bench/fidelity_rerun.py [--nic nic-400g] [--only 002,003,004]`` (minutes on one core).
"""

from __future__ import annotations

import argparse
import json
import time

from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.run import simulate
from kvferry.sim.deploy.spec import DeploySpec


def seed002(nic: str) -> None:
    for ptp, dtp in ((4, 2), (2, 4)):
        for c in (1, 4, 8):
            row = {"seed": "002", "tp": f"{ptp}->{dtp}", "c": c, "nic": nic}
            for flow in ("direct", "pinned"):
                spec = DeploySpec(
                    model="qwen3-8b", prefill_tp=ptp, decode_tp=dtp, gpu="h200", nic=nic, flow=flow
                )
                lengths = wl.random_lengths(320, 256, 128, 0.0, seed=1)
                r = simulate(spec, wl.Arrivals(concurrency=c, total=320), lengths)
                row[f"{flow}_ttft_ms"] = round(r.ttft_ms.mean, 1)
                row[f"{flow}_tpot_ms"] = round(r.tpot_ms.mean, 2)
            row["ratio"] = round(row["direct_ttft_ms"] / row["pinned_ttft_ms"], 2)
            print(json.dumps(row), flush=True)


def seed003(nic: str) -> None:
    for c in (512, 1024):
        row = {"seed": "003", "c": c, "nic": nic}
        for flow in ("ring", "direct"):
            spec = DeploySpec(
                model="qwen3.5-397b-a17b", prefill_tp=4, decode_tp=1, decode_instances=4, decode_ep=4,
                gpu="gb200", nic=nic, weight_bytes=1, flow=flow, max_batch=256, chunk_tokens=8192,
            )  # fmt: skip
            arrivals, lengths = wl.closed_loop(c, max(2 * c, 32), 1000, 1000, seed=1)
            r = simulate(spec, arrivals, lengths)
            row[f"{flow}_ttft_ms"] = round(r.ttft_ms.mean, 1)
        row["ratio"] = round(row["direct_ttft_ms"] / row["ring_ttft_ms"], 2)
        print(json.dumps(row), flush=True)


def seed004(nic: str) -> None:
    for ptp, dtp in ((2, 2), (4, 4), (4, 2)):
        for isl in (1024, 4096):
            for c in (1, 8):
                row = {"seed": "004", "tp": f"{ptp}->{dtp}", "isl": isl, "c": c, "nic": nic}
                for flow in ("push", "pull"):
                    spec = DeploySpec(
                        model="qwen3-8b", prefill_tp=ptp, decode_tp=dtp, gpu="h200", nic=nic, flow=flow
                    )
                    arrivals, lengths = wl.closed_loop(c, max(2 * c, 16), isl, 128, seed=1)
                    r = simulate(spec, arrivals, lengths, label=f"c={c}")
                    row[f"{flow}_ttft_ms"] = round(r.ttft_ms.mean, 1)
                row["ratio"] = round(row["pull_ttft_ms"] / row["push_ttft_ms"], 2)
                print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nic", default="nic-400g")
    ap.add_argument("--only", default="002,003,004")
    args = ap.parse_args()
    t0 = time.perf_counter()
    for part in args.only.split(","):
        {"002": seed002, "003": seed003, "004": seed004}[part](args.nic)
    print(json.dumps({"wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
