"""From a traced bench run (``kvferry bench nixl --trace DIR``): per room, the time from prefill's
ChunkReady to the last post of the chunk returning, and to decode's Success, and which threads
posted (medians over the rooms). A room whose chunk arrives before decode's TransferInfo has the
parking in it: use it on ``--handoff`` runs.

    python bench/handoff_span.py DIR/tp1-1.direct [MORE ...]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from kvferry.tools.runtime_bench import trace_rows


def spans(run: Path) -> dict[str, Any]:
    rows = trace_rows(str(run))
    by_room: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        by_room.setdefault(r.get("room"), []).append(r)
    posted_us, success_us, threads = [], [], set()
    for room_rows in by_room.values():
        room_rows.sort(key=lambda r: r["t_ns"])
        ready = [r["t_ns"] for r in room_rows if r["what"] == "in" and r["name"] == "ChunkReady"]
        if not ready:
            continue
        posts = [r for r in room_rows if r["what"] == "posted" and r["t_ns"] >= ready[0]]
        done = [
            r["t_ns"]
            for r in room_rows
            if r["node"].startswith("decode") and r["name"] == "StatusChanged Success"
        ]
        if posts and done:
            posted_us.append((posts[-1]["t_ns"] - ready[0]) / 1e3)
            success_us.append((done[0] - ready[0]) / 1e3)
            threads |= {r["thread"] for r in posts}
    return {
        "rooms": len(posted_us),
        "ready_to_last_post_us": statistics.median(posted_us),
        "ready_to_success_us": statistics.median(success_us),
        "posting_threads": sorted(threads),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    for run in ap.parse_args().runs:
        s = spans(run)
        posted, success = s["ready_to_last_post_us"], s["ready_to_success_us"]
        print(
            f"{run}: {s['rooms']} rooms, ChunkReady -> last post returned {posted:.0f} us, "
            f"-> decode Success {success:.0f} us (medians); posted by {', '.join(s['posting_threads'])}"
        )


if __name__ == "__main__":
    main()
