"""Hosts on one machine: network namespaces joined by veth pairs through a bridge namespace.

Host ``i`` is the namespace ``<tag>-h<i>`` with one interface, ``eth0``, at ``10.213.0.<i+1>``;
its veth peer ``p<i>`` sits in ``<tag>-b`` on the bridge ``br0``. A partition takes ``p<i>``
down (the host's own end stays up, as when a switch port or cable fails); a slow link puts a
``tbf`` rate limit on both directions of the host's link. Nothing here reaches an address outside
these namespaces. Every ``ip``/``tc`` call is bounded in time; ``close`` removes everything made,
also after a partial ``open``, and namespaces left by a run that was killed outright (its tag
names its pid) are removed by the next run.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence

PREFIX = "kvfc"  # every namespace this tool makes starts with it, then the making process's pid
SUBNET = "10.213.0"
HOST_IF = "eth0"
CALL_TIMEOUT_S = 15.0


class NetError(RuntimeError):
    pass


def _run(args: Sequence[str], check: bool = True) -> str:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetError(f"{' '.join(args)}: {e}") from None
    if check and done.returncode != 0:
        raise NetError(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def why_not_available() -> str:
    """'' when this process can make namespaces, else why not (for a clear error or skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in CI's root container)"
    for tool in ("ip", "tc"):
        try:
            subprocess.run([tool, "-V"], capture_output=True, timeout=CALL_TIMEOUT_S, check=False)
        except OSError:
            return f"the {tool!r} command (iproute2) is not installed"
    return ""


def namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Namespaces of earlier runs whose process is gone (killed before it could clean up)."""
    removed = []
    for name in namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-(b|h\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


class Network:
    """``hosts`` namespaces on one bridge. Use as a context manager, or ``open`` then ``close``."""

    def __init__(self, hosts: int, tag: str = "") -> None:
        if not 2 <= hosts <= 32:
            raise ValueError(f"hosts must be in [2, 32], got {hosts}")
        self.hosts = hosts
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}-b"
        self.made: list[str] = []  # namespaces, in the order made (removed in reverse)
        self.slowed: set[int] = set()

    def host(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> tuple[str, ...]:
        """Run a command inside host ``i`` (``ip netns exec`` execs it: its pid is the command's)."""
        return ("ip", "netns", "exec", self.host(i))

    def ucx_env(self) -> dict[str, str]:
        """UCX on TCP over the host's veth only (no shared memory: the peer is another host)."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": HOST_IF}

    def open(self) -> Network:
        try:
            self._add_ns(self.bridge)
            _run(["ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.bridge, "link", "set", "br0", "up"])
            for i in range(self.hosts):
                h = self.host(i)
                self._add_ns(h)
                peer = f"p{i}"
                _run(["ip", "link", "add", HOST_IF, "netns", h, "type", "veth", "peer", "name", peer,
                      "netns", self.bridge])  # fmt: skip
                _run(["ip", "-n", self.bridge, "link", "set", peer, "master", "br0"])
                _run(["ip", "-n", self.bridge, "link", "set", peer, "up"])
                _run(["ip", "-n", h, "addr", "add", f"{self.address(i)}/24", "dev", HOST_IF])
                _run(["ip", "-n", h, "link", "set", HOST_IF, "up"])
                _run(["ip", "-n", h, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.made.append(name)

    def close(self) -> list[str]:
        """Remove every namespace made (their veths go with them); returns what was left behind."""
        for name in reversed(self.made):
            _run(["ip", "netns", "del", name], check=False)
        left = [n for n in namespaces() if n in self.made]
        self.made = left
        return left

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- faults -------------------------------------------------------------------------------
    def set_link(self, i: int, up: bool) -> None:
        """Host ``i``'s switch port down (a partition of that host) or up again."""
        _run(["ip", "-n", self.bridge, "link", "set", f"p{i}", "up" if up else "down"])

    def slow(self, i: int, rate_kbit: int) -> None:
        """A ``tbf`` rate limit on both directions of host ``i``'s link (no netem: no delay or loss
        beyond what the queue's 200 ms bound drops)."""
        for ns, dev in ((self.host(i), HOST_IF), (self.bridge, f"p{i}")):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_kbit}kbit",
                  "burst", "16kb", "latency", "200ms"])  # fmt: skip
        self.slowed.add(i)

    def fast(self, i: int) -> None:
        for ns, dev in ((self.host(i), HOST_IF), (self.bridge, f"p{i}")):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        self.slowed.discard(i)

    def heal(self) -> None:
        """Every link up and at full speed (after a fault was cut short)."""
        for i in range(self.hosts):
            _run(["ip", "-n", self.bridge, "link", "set", f"p{i}", "up"], check=False)
            if i in self.slowed:
                self.fast(i)
