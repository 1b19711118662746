"""Summarise a py-spy raw profile (``py-spy record --subprocesses --threads --format raw``).

Per process role (the bench's parent, prefill, decode) and thread: on-CPU samples, the functions
with the most self samples, and the kvferry functions with the most inclusive samples. Raw
profiles are too big to bring back from the device; this text is not.

Run: ``python bench/spy_summary.py PROFILE.txt [--top 15]``.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict


def role(process: str) -> str:
    m = re.search(r"bench (prefill|decode)", process)
    return m.group(1) if m else "parent"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    threads: Counter[tuple[str, str]] = Counter()
    self_t: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    incl_t: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    with open(a.profile) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")
            procs = [fr for fr in frames if fr.startswith("process ")]
            thread = next((fr for fr in frames if fr.startswith("thread ")), "thread ?")
            name = thread.split(": ", 1)[1] if ": " in thread else thread
            key = (role(procs[-1] if procs else ""), re.sub(r"\d+", "N", name))
            code = [fr for fr in frames if not fr.startswith(("process ", "thread "))]
            count = int(n)
            threads[key] += count
            if code:
                self_t[key][code[-1]] += count
            for fr in set(code):
                if "kvferry" in fr or "backends/" in fr or "core/" in fr:
                    incl_t[key][fr] += count
    total = sum(threads.values())
    print(f"{total} samples")
    for key, n in threads.most_common():
        if n < total * 0.01:
            continue
        print(f"\n== {key[0]} / {key[1]}: {n} samples ({100 * n / total:.1f}%)")
        print("  self:")
        for fr, c in self_t[key].most_common(a.top):
            print(f"    {c:7d} {100 * c / n:5.1f}%  {fr}")
        print("  inclusive (kvferry):")
        for fr, c in incl_t[key].most_common(a.top):
            print(f"    {c:7d} {100 * c / n:5.1f}%  {fr}")


if __name__ == "__main__":
    main()
