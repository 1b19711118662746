"""Does a NIXL WRITE that was released and whose peer was removed still land after a partition?

Two hosts (network namespaces), one NIXL agent each over UCX/TCP with a 64 KiB DRAM buffer.
Prefill posts a WRITE while decode's link is down, waits, releases the transfer handle and
removes decode's agent (what the driver does when a peer is lost); decode removes prefill's agent
and, with ``--reregister``, deregisters and registers its buffer again. Then the link heals and
both sides only poll. Prints when (if ever) the bytes land in decode's buffer.

    python -m kvferry.tools.chaos.released_write [--reregister]      (root)
    python -m kvferry.tools.chaos.released_write --fenced              (root)

``--fenced``: prefill writes through kvferry's own agent (``backends/nixl/agent.py``) and drops
decode with ``remove_peer``, as the runtime does when decode is lost; it reports when the agent
first said the WRITE ended (DONE or ERR) and when the bytes landed. The agent keeps a lost peer's
transfers until they end, so the end it reports never comes before the bytes (tests/test_chaos.py).

Measured on the 2-core CPU machine (NIXL 1.5.1's UCX): the 64 KiB land about 0.1 s after the heal
in both variants. Over UCX/TCP a released transfer is not cancelled and the target has no
registration check, so only the writer's own end of the transfer (DONE or ERR, not a release)
or its death can fence decode's pages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from kvferry.tools.chaos.netns import Network

SIDE = r"""
import json, sys, threading, time
import numpy as np
from nixl import _api
role, rereg = sys.argv[1], sys.argv[2] == "1"
agent = _api.nixl_agent(role, _api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                     backends=["UCX"]))
buf = np.full(64 << 10, 0xAB if role == "prefill" else 0, dtype=np.uint8)
rows = np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64)
reg = agent.register_memory(rows, "DRAM")
say = lambda **kw: print(json.dumps(kw), flush=True)
say(event="meta", meta=bytes(agent.get_agent_metadata()).hex(), addr=buf.ctypes.data)
t0, handle, peer = time.monotonic(), None, None
def watch():
    while buf[-1] != 0xAB:  # the last byte: the whole write is in
        time.sleep(0.001)
    say(event="landed", at=time.monotonic(), n=int((buf == 0xAB).sum()))
if role == "decode":
    threading.Thread(target=watch, daemon=True).start()
for line in sys.stdin:
    c = json.loads(line)
    if c["cmd"] == "add":
        peer = agent.add_remote_agent(bytes.fromhex(c["meta"]))
    elif c["cmd"] == "write":
        rd = agent.get_xfer_descs(np.array([[c["addr"], buf.nbytes, 0]], dtype=np.uint64), "DRAM")
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(rows, "DRAM"), rd, peer, b"n")
        agent.transfer(handle)
    elif c["cmd"] == "drop":
        if handle is not None:
            say(event="state_at_drop", state=str(agent.check_xfer_state(handle)))
            agent.release_xfer_handle(handle)
        agent.remove_remote_agent(peer)
        if rereg:
            agent.deregister_memory(reg)
            reg = agent.register_memory(rows, "DRAM")
    elif c["cmd"] == "poll":
        end = time.monotonic() + c["s"]
        while time.monotonic() < end:
            agent.get_new_notifs()
            time.sleep(0.01)
    say(event="ok", cmd=c["cmd"])
"""


# Prefill through kvferry's agent: post during the partition, drop the peer, then poll the ticket.
WRITER = r"""
import json, sys, time
import numpy as np
from kvferry.backends.nixl.agent import NixlAgent
from kvferry.backends.nixl.memory import MemRegion
agent = NixlAgent(sync="rw")
buf = np.full(64 << 10, 0xAB, dtype=np.uint8)
agent.register([MemRegion(0, buf.ctypes.data, buf.nbytes, "DRAM", 0)], group="kv")
say = lambda **kw: print(json.dumps(kw), flush=True)
say(event="meta", meta=agent.metadata().hex(), addr=buf.ctypes.data)
draining = getattr(agent, "draining", list)  # an agent that releases at the drop has none
zero, size = np.zeros(1, np.int64), np.array([buf.nbytes], np.int64)
peer = ticket = None
ended = None
def poll():
    global ended
    agent.progress()
    state = agent.poll(ticket)
    if state != "PROC" and ended is None:
        ended = {"at": time.monotonic(), "state": state}
    return state
for line in sys.stdin:
    c = json.loads(line)
    if c["cmd"] == "add":
        remote = MemRegion(0, c["addr"], buf.nbytes, "DRAM", 0)
        peer = agent.add_peer(bytes.fromhex(c["meta"]), {"kv": ([remote], [buf.nbytes])})
    elif c["cmd"] == "write":
        ticket = agent.post("WRITE", peer, ("kv", buf.nbytes), (zero, zero), (zero, zero), size, b"n")
    elif c["cmd"] == "drop":
        agent.remove_peer(peer, settle_s=0.2)
        say(event="dropped", state=poll(), draining=draining())
    elif c["cmd"] == "poll":
        end = time.monotonic() + c["s"]
        while time.monotonic() < end:
            poll()
            # Until the write ended and the agent holds nothing more of the peer: nothing after.
            if c.get("settle") and ended and not (agent.inflight() or draining() or agent.peers()):
                break
            time.sleep(0.01)
        say(event="ended", ended=ended, inflight=agent.inflight(), draining=draining(),
            peers=agent.peers())
    say(event="ok", cmd=c["cmd"])
"""


class _Proc:
    def __init__(
        self, net: Network, host: int, role: str, rereg: bool, env: dict[str, str], script: str = SIDE
    ) -> None:
        self.p = subprocess.Popen(
            [*net.exec_prefix(host), sys.executable, "-c", script, role, "1" if rereg else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.events: list[dict[str, Any]] = []

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def tell(self, **cmd: Any) -> dict[str, Any]:
        """Send a command and read up to its "ok" (the side answers every command)."""
        self.send(**cmd)
        return self.until("ok")

    def until(self, *events: str) -> dict[str, Any]:
        """Read up to the first of ``events``."""
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("{"):
                msg = json.loads(line)
                self.events.append(msg)
                if msg["event"] in events:
                    return msg
        raise RuntimeError(f"side exited before {events!r}")


def probe(rereg: bool, down_s: float = 4.0, after_s: float = 6.0) -> dict[str, Any]:
    with Network(2) as net:
        env = {**os.environ, **net.ucx_env(), "NIXL_LOG_LEVEL": "WARN"}
        pre, dec = _Proc(net, 0, "prefill", rereg, env), _Proc(net, 1, "decode", rereg, env)
        try:
            mp, md = pre.until("meta"), dec.until("meta")
            pre.tell(cmd="add", meta=md["meta"])
            dec.tell(cmd="add", meta=mp["meta"])
            net.set_link(1, up=False)
            pre.tell(cmd="write", addr=md["addr"])
            pre.tell(cmd="poll", s=down_s)  # past any heartbeat timeout
            pre.tell(cmd="drop")
            dec.tell(cmd="drop")
            net.set_link(1, up=True)
            healed = time.monotonic()
            for side in (pre, dec):  # both progress their UCX worker at once, as live endpoints do
                side.send(cmd="poll", s=after_s)
            # Up to the bytes landing, or decode's poll ending without them: nothing after is
            # read (both sides are killed below, mid-poll).
            dec.until("landed", "ok")
            landed = next((e for e in dec.events if e["event"] == "landed"), None)
            state = next(e["state"] for e in pre.events if e["event"] == "state_at_drop")
            return {
                "reregistered": rereg,
                "state_at_release": state,
                "landed_after_heal_s": round(landed["at"] - healed, 2) if landed else None,
                "bytes": landed["n"] if landed else 0,
            }
        finally:
            for s in (pre, dec):
                s.p.kill()
                s.p.wait(10)


def fenced_probe(down_s: float = 4.0, after_s: float = 6.0) -> dict[str, Any]:
    """The same partition, with prefill writing through kvferry's agent and dropping decode with
    ``remove_peer``: when the agent first reported the WRITE ended, and when its bytes landed."""
    with Network(2) as net:
        env = {**os.environ, **net.ucx_env(), "NIXL_LOG_LEVEL": "WARN"}
        pre = _Proc(net, 0, "prefill", False, env, WRITER)
        dec = _Proc(net, 1, "decode", False, env)
        try:
            mp, md = pre.until("meta"), dec.until("meta")
            pre.tell(cmd="add", meta=md["meta"], addr=md["addr"])
            dec.tell(cmd="add", meta=mp["meta"])
            net.set_link(1, up=False)
            pre.tell(cmd="write")
            pre.tell(cmd="poll", s=down_s)  # past any heartbeat timeout
            pre.tell(cmd="drop")
            dec.tell(cmd="drop")
            net.set_link(1, up=True)
            healed = time.monotonic()
            # Prefill polls until its write ended and it holds nothing of decode (or after_s);
            # decode until the bytes landed (or after_s).
            pre.send(cmd="poll", s=after_s, settle=True)
            dec.send(cmd="poll", s=after_s)
            pre.until("ok")
            dec.until("landed", "ok")
            landed = next((e for e in dec.events if e["event"] == "landed"), None)
            dropped = next(e for e in pre.events if e["event"] == "dropped")
            final = [e for e in pre.events if e["event"] == "ended"][-1]
            ended = final["ended"]
            return {
                "state_after_drop": dropped["state"],
                "draining_after_drop": dropped["draining"],
                "ended_state": ended["state"] if ended else None,
                "ended_after_heal_s": round(ended["at"] - healed, 3) if ended else None,
                "landed_after_heal_s": round(landed["at"] - healed, 3) if landed else None,
                "bytes": landed["n"] if landed else 0,
                "left": {k: final[k] for k in ("inflight", "draining", "peers")},
            }
        finally:
            for s in (pre, dec):
                s.p.kill()
                s.p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m kvferry.tools.chaos.released_write")
    ap.add_argument("--reregister", action="store_true", help="decode re-registers its buffer first")
    ap.add_argument("--fenced", action="store_true", help="prefill writes through kvferry's agent")
    args = ap.parse_args()
    print(json.dumps(fenced_probe() if args.fenced else probe(args.reregister)))


if __name__ == "__main__":
    main()
