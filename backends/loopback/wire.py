"""JSON lines between the soak parent and a side: the side prints events, reads commands on stdin."""

from __future__ import annotations

import json
import select
import sys
from typing import Any


def say(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def heard(timeout_s: float = 0.0) -> dict[str, Any] | None:
    """The parent's next command (a JSON object) if one arrives within ``timeout_s``; a closed
    stdin reads as ``{"cmd": "eof"}`` so a side whose parent died exits instead of lingering."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not ready:
        return None
    line = sys.stdin.readline()
    if not line:
        return {"cmd": "eof"}
    return json.loads(line)


def rss_kb(pid: int | str = "self") -> int:
    """Resident set size of a process in KiB (Linux /proc), 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
