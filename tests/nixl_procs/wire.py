"""JSON lines between the test and a helper process: the child prints, the test writes stdin."""

from __future__ import annotations

import json
import select
import sys
from typing import Any


def say(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def heard(timeout_s: float = 0.0) -> str | None:
    """A line from the test on stdin, if one is there within ``timeout_s``."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not ready:
        return None
    line = sys.stdin.readline()
    return line.strip() if line else "eof"
