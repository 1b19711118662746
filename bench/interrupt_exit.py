"""How long a kvferry command takes to exit after Ctrl-C, and whether its workers outlive it.

    python bench/interrupt_exit.py --after 3 'fuzz --seeds 0-100000 --jobs 2 --save-dir /tmp/fz'

starts ``kvferry COMMAND`` in a session of its own (with Python's Ctrl-C handler: a script's
background job inherits SIGINT ignored), sends SIGINT to its process group ``--after`` seconds in
(as a terminal's Ctrl-C does; ``--main-only``: to the command alone, as ``kill -INT`` does) and
prints one JSON line: the exit status, the seconds from the signal to the exit, the command's last
stderr line, and the worker processes (those whose parent is not the command) still running when
it exited. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

CLI = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'kvferry'; from kvferry.cli import main; main()"
)


def _stat(pid: int) -> tuple[str, int]:
    """``pid``'s state letter and parent pid (OSError once it is gone)."""
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return rest[0], int(rest[1])


def _workers(sid: int) -> list[int]:
    """The running processes of session ``sid`` other than its leader and the leader's children."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(proc.name)
            state, ppid = _stat(pid)
            if state != "Z" and os.getsid(pid) == sid and sid not in (pid, ppid):
                found.append(pid)
        except OSError:  # gone meanwhile
            continue
    return sorted(found)


def _running(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--after", type=float, default=3.0, help="seconds before the SIGINT")
    ap.add_argument("--main-only", action="store_true", help="signal the command, not its group")
    ap.add_argument("command", help="the kvferry command line, one argument: 'fuzz --seeds 0-9'")
    a = ap.parse_args()
    argv = [sys.executable, "-c", CLI, *shlex.split(a.command)]
    p = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    time.sleep(a.after)
    workers = _workers(p.pid)
    t0 = time.monotonic()
    (os.kill if a.main_only else os.killpg)(p.pid, signal.SIGINT)
    _, err = p.communicate()
    exit_s = time.monotonic() - t0
    lines = err.strip().splitlines()
    print(
        json.dumps(
            {
                "rc": p.returncode,
                "exit_s": round(exit_s, 2),
                "last_line": lines[-1] if lines else "",
                "traceback": "Traceback" in err,
                "workers_at_sigint": len(workers),
                "workers_left": [pid for pid in workers if _running(pid)],
            }
        )
    )


if __name__ == "__main__":
    main()
