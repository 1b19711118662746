"""The threads busiest over one second, machine-wide, as one line (bench/gpu_crowd_probe.sh)."""

from __future__ import annotations

import os
import time


def ticks() -> dict[tuple[str, str], tuple[str, int]]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    head, _, rest = f.read().rpartition(")")
                fields = rest.split()  # from the state on: utime and stime are the 12th and 13th
                out[(pid, tid)] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return out


def main() -> None:
    a = ticks()
    time.sleep(1.0)
    b = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = sorted(((b[k][1] - a[k][1]) * 100 // hz, k, b[k][0]) for k in b if k in a)[::-1]
    top = ", ".join(f"{name}[{pid}/{tid}] {pct}%" for pct, (pid, tid), name in busy[:14] if pct > 0)
    total = sum(x[0] for x in busy)
    print(f"--- {time.strftime('%T')} threads over 1 s (% of a core): total {total}%: {top}")
    for pid in dict.fromkeys(pid for pct, (pid, _), _ in busy[:14] if pct > 0):
        print(f"    {pid}: {_cmdline(pid)}")


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "(gone)"


if __name__ == "__main__":
    main()
