"""Summarise a PART=close device run (bench/gpu_native.sh): each bench nixl row's ratio, times and
byte check, the traced rows' hops, the interference medians and spreads, the tests' and the fuzz
campaign's last lines. ``python bench/close_summary.py /tmp/r``"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(d: Path) -> None:
    for f in sorted(d.glob("x*.out")) + sorted(d.glob("handoff*.out")):
        for line in f.read_text().splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            print(
                f"{f.stem:16} {r['flow']:7} inflight {r['inflight']:>2} ratio {r['ratio']:.3f} "
                f"kvferry {r['kvferry_s'] * 1e3:.2f} ms raw {r['raw_s'] * 1e3:.2f} ms ok {r['bytes_ok']}"
            )
            for h in r.get("hops", ()):
                print(f"    {h['median_us']:>9.1f} us  {h['label']}  ({h['count']} rooms)")


def interference(d: Path) -> None:
    keys = ("rooms_per_s", "idle_ratio_median", "idle_ratio_min", "idle_ratio_max", "busy_ratio_median",
            "busy_ratio_min", "busy_ratio_max")  # fmt: skip
    for f in sorted(d.glob("interference-*.out")):
        text = f.read_text()
        if "{" not in text:
            print(f.stem, "no JSON")
            continue
        j = json.loads(text[text.index("{") :])
        rest = {k: v for k, v in j.items() if "cpu" in k or "per_room" in k}
        print(f.stem, {k: round(j[k], 3) for k in keys if k in j}, rest)


def main() -> None:
    d = Path(sys.argv[1])
    rows(d)
    interference(d)
    for name in ("vram-tests", "fuzz"):
        f = d / f"{name}.out"
        if f.exists():
            print(name, f.read_text()[-300:].strip())


if __name__ == "__main__":
    main()
