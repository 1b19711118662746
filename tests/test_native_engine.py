"""The native engine on its own: loading (every C API symbol checked, one line when it cannot run),
the executor choice and its fall-back, and a NixlAgent on the engine in one process (real NIXL,
UCX, DRAM). The two-process runs are tests/test_native_e2e.py and test_native_differential.py."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest
from kvferry.backends.nixl import native
from kvferry.backends.nixl.agent import NixlAgent
from kvferry.backends.nixl.errors import DescriptorError
from kvferry.backends.nixl.memory import regions_from
from typer.testing import CliRunner

from kvferry.cli import _register, app

PROBE = "from kvferry.backends.nixl.native import describe; print(describe())"


def _describe_with(**env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_engine_loads_against_the_installed_nixl() -> None:
    assert native.describe().startswith(f"native (nixl {native.nixl_version()}")


def test_a_c_api_without_the_symbols_is_refused_in_one_line_naming_nixl() -> None:
    # Any library that is not NIXL's C API stands for one whose functions changed.
    libz = next(
        p
        for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1")
        if os.path.exists(p)
    )
    lines = _describe_with(KVFERRY_NIXL_CAPI=libz)
    assert len(lines) == 1, lines
    assert lines[0].startswith("python (native unavailable: NIXL C API of nixl ")
    assert f"nixl {native.nixl_version()}" in lines[0]
    assert "missing 40 of the 40 functions it uses: nixl_capi_create_configured_agent," in lines[0]


def test_a_missing_engine_library_is_refused_in_one_line() -> None:
    lines = _describe_with(KVFERRY_NATIVE_LIB="/nonexistent/kvf_engine.so")
    assert len(lines) == 1 and lines[0].startswith("python (native unavailable: native engine library"), lines


def test_native_asked_but_unavailable_falls_back_to_python_and_says_so() -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from kvferry.backends.nixl.transport import NixlTransport\n"
        "from kvferry.core.geometry import ModelGeometry, PoolGeometry\n"
        "from kvferry.core.messages import Endpoint\n"
        "pool = PoolGeometry(ModelGeometry('t', 1, 1, 8), 1, 0, 4, 4)\n"
        "t = NixlTransport(Endpoint(server='p', rank=0), pool, engine='native')\n"
        "print('executor', t.executor); t.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KVFERRY_NATIVE_LIB": "/nonexistent/kvf_engine.so"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "executor python" in out.stdout, (out.stdout, out.stderr)
    said = [line for line in out.stderr.splitlines() if "executor python (native asked, unavailable" in line]
    assert len(said) == 1, out.stderr


def test_an_unknown_plant_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_NATIVE_PLANT", "sometimes")
    with pytest.raises(ValueError, match="KVFERRY_NATIVE_PLANT"):
        native.NativeNixl("kvferry-test-plant")


@pytest.fixture(scope="module")
def agents():
    rng = np.random.default_rng(11)
    src = {r: rng.integers(0, 256, 1 << 16, dtype=np.uint8) for r in range(2)}
    dst = {r: np.zeros(1 << 16, dtype=np.uint8) for r in range(2)}
    a = NixlAgent(sync="rw", factory=native.make_native_agent)
    b = NixlAgent(sync="rw", factory=native.make_native_agent)
    a.register(regions_from(src))
    b.register(regions_from(dst))
    name_b = a.add_peer(b.metadata(), {"kv": (b.regions(), [256])})
    yield a, b, name_b, src, dst
    a.close()
    b.close()


def _settle(agent: NixlAgent, ticket, timeout_s: float = 10.0) -> str:
    end = time.monotonic() + timeout_s
    while (state := agent.poll(ticket)) == "PROC" and time.monotonic() < end:
        agent.wait_events(0.01)  # the engine's wake-up: no polling of NIXL from here
    return state


def _notifs(agent: NixlAgent, n: int, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    end = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < end:
        agent.wait_events(0.01)
        got += agent.notifs()
    return got


@pytest.mark.parametrize("oneshot", [False, True], ids=["prepped", "oneshot"])
def test_native_write_lands_exact_bytes_and_its_notification(agents, oneshot: bool) -> None:
    a, b, name_b, src, dst = agents
    assert a.executor == b.executor == "native"
    for d in dst.values():
        d[:] = 0
    t = a.post(
        "WRITE",
        name_b,
        ("kv", 256),
        (np.array([0, 1]), np.array([0, 4096])),
        (np.array([1, 0]), np.array([512, 8192])),
        np.array([1024, 2048]),
        b"room-9",
        oneshot=oneshot,
    )
    assert _settle(a, t) == "DONE"
    assert (dst[1][512:1536] == src[0][:1024]).all()
    assert (dst[0][8192 : 8192 + 2048] == src[1][4096 : 4096 + 2048]).all()
    assert _notifs(b, 1) == [(a.name, b"room-9")]
    rec = a.telemetry.records()[-1]
    assert rec.status == "DONE" and rec.nbytes == 3072 and rec.xfer_us >= 0
    assert a.inflight() == 0


def test_native_descriptor_outside_its_region_never_reaches_nixl(agents) -> None:
    a, _, name_b, _, _ = agents
    posts = a._nixl.counters()["posts"]
    one = np.array([0])
    with pytest.raises(DescriptorError):
        a.post("WRITE", name_b, ("kv", 256), (one, one * 0), (one, np.array([1 << 16])), np.array([256]))
    assert a._nixl.counters()["posts"] == posts


def test_native_bare_notification_and_batched_wakeup(agents) -> None:
    a, b, name_b, _, _ = agents
    for i in range(5):
        a.send_notif(name_b, f"n{i}".encode())
    got = _notifs(b, 5)
    assert sorted(p for _, p in got) == [f"n{i}".encode() for i in range(5)]
    assert b._nixl.counters()["notifications"] >= 5


def test_native_wait_sleeps_after_a_wakeup_whose_events_were_drained(agents) -> None:
    """The engine writes its wake-up fd after queueing events; a host that drained those events
    first finds the fd readable with nothing queued. A wait must then reset it and sleep, not
    return at once (it did: every data-thread and worker wait then spun until the next event)."""
    _, b, _, _, _ = agents
    eng = b._nixl
    eng.drain()
    os.write(eng.wake_fd, (1).to_bytes(8, "little"))  # a wake-up whose events are gone
    assert eng.wait(0.02) == 0  # it slept out its timeout: no news
    assert select.select([eng.wake_fd], [], [], 0)[0] == []  # and left the fd reset
    assert eng.wait(0.01) == 0


def test_native_wait_on_a_second_fd(agents) -> None:
    """kvf_wait_fd (the one progress thread's sleep): a readable second fd ends the wait, is
    named in the mask and is reset (the next wait sleeps); a stale engine wake-up with a quiet
    second fd is reset and slept through, as in kvf_wait."""
    _, b, _, _, _ = agents
    eng = b._nixl
    eng.drain()
    other = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        assert eng.wait(0.01, fd=other) == 0
        os.eventfd_write(other, 1)
        assert eng.wait(30.0, fd=other) == native.WOKE_FD  # at once, not after 30 s
        assert select.select([other], [], [], 0)[0] == []  # reset: no spin on it
        assert eng.wait(0.01, fd=other) == 0
        os.write(eng.wake_fd, (1).to_bytes(8, "little"))  # a wake-up whose events are gone
        assert eng.wait(0.02, fd=other) == 0
        assert select.select([eng.wake_fd], [], [], 0)[0] == []
    finally:
        os.close(other)


_register()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["bench", "nixl", "--engine", "rust"], "engine must be one of python, native"),
        (["bench", "interference", "--engine", "rust"], "--engine must be python or native"),
        (["bench", "interference", "--reps", "0"], "--reps must be in [1, 1000]"),
    ],
)
def test_bench_engine_flags_refuse_bad_values(args: list[str], says: str) -> None:
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert says in r.output


def test_peer_dropped_while_its_write_is_queued_or_in_flight() -> None:
    """The prepared lists of a dropped peer are released behind the posts queued before (one queue,
    in order), so a write still queued or moving when its peer goes ends DONE or ERR, never
    touches a released list, and the agent keeps working with the peer loaded again."""
    src = {0: np.full(8 << 20, 7, dtype=np.uint8)}
    dst = {0: np.zeros(8 << 20, dtype=np.uint8)}
    a = NixlAgent(sync="rw", factory=native.make_native_agent)
    b = NixlAgent(sync="rw", factory=native.make_native_agent)
    try:
        a.register(regions_from(src))
        b.register(regions_from(dst))
        one, zero = np.array([0]), np.array([0])
        for _ in range(3):
            name = a.add_peer(b.metadata(), {"kv": (b.regions(), [4096])})
            tickets = [
                a.post("WRITE", name, ("kv", 4096), (one * 0, zero), (one * 0, zero), np.array([8 << 20]))
                for _ in range(4)
            ]
            a.remove_peer(name, settle_s=0.0)  # at once: some writes are still queued or moving
            assert {_settle(a, t) for t in tickets} <= {"DONE", "ERR"}
            assert a.inflight() == 0
        name = a.add_peer(b.metadata(), {"kv": (b.regions(), [4096])})
        t = a.post("WRITE", name, ("kv", 4096), (one * 0, zero), (one * 0, zero), np.array([8 << 20]))
        assert _settle(a, t) == "DONE" and (dst[0] == 7).all()
    finally:
        a.close()
        b.close()
