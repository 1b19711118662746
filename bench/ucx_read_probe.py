"""Which UCX transport a NIXL READ and a NIXL WRITE take between two processes, and how fast.

Two processes (an initiator and a target), each with one NIXL agent (the Python API, UCX backend)
and one buffer of ``--mb`` MiB, on the GPUs given (``--gpus 0,0``: both on one GPU; ``0,1``: one
each) or in DRAM (``--mem DRAM``: a CPU dry run). The initiator READs the target's buffer into its
own and WRITEs its own into the target's, one descriptor each, ``--reps`` times, and prints
one JSON line: GB/s of each op (best and median) and whether the bytes arrived.

Run it with UCX's own reporting on and keep stderr: with ``UCX_PROTO_INFO=y`` UCX prints, per
endpoint, the protocol and transport it selected for each operation and size range (rndv/get_zcopy
over cuda_ipc, or a fallback such as cuda_copy through host bounce buffers, or tcp/sm); with
``UCX_LOG_LEVEL=info`` it also says which transports the context opened. bench/gpu_native.sh
(PART=ucx) runs it for one GPU and two, and ``kvferry bench nixl --flow pull`` beside it.

    UCX_PROTO_INFO=y UCX_LOG_LEVEL=info python bench/ucx_read_probe.py --gpus 0,0
    python bench/ucx_read_probe.py --mem DRAM --mb 64     # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np


def _buffer(mem: str, gpu: str, nbytes: int, fill: int) -> tuple[Any, np.ndarray]:
    """(the object kept alive, its (addr, len, dev) row)."""
    if mem == "DRAM":
        buf = np.full(nbytes, fill, dtype=np.uint8)
        return buf, np.array([[buf.ctypes.data, nbytes, 0]], dtype=np.uint64)
    import torch

    buf = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda:0")  # CUDA_VISIBLE_DEVICES picks it
    torch.cuda.synchronize()
    return buf, np.array([[buf.data_ptr(), nbytes, 0]], dtype=np.uint64)


def _checksum(buf: Any) -> int:
    if isinstance(buf, np.ndarray):
        return int(buf[:: 1 << 16].astype(np.int64).sum())
    return int(buf[:: 1 << 16].to(dtype=__import__("torch").int64).sum().item())


def _agent(name: str) -> Any:
    from kvferry.backends.nixl.agent import make_nixl_agent

    return make_nixl_agent(name, "none", telemetry=False, ucx_threads=0)


def _target(conn: Any, gpu: str, mem: str, nbytes: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    agent = _agent("target")
    buf, row = _buffer(mem, gpu, nbytes, 7)
    agent.register_memory(row, mem)
    conn.send((agent.get_agent_metadata(), row.tolist(), _checksum(buf)))
    peer_md = conn.recv()
    agent.add_remote_agent(peer_md)
    while True:  # keep progressing UCX (a target must poll) until the initiator is done
        agent.get_new_notifs()
        if conn.poll(0.0005):
            conn.recv()
            break
    conn.send(_checksum(buf))


def _timed(agent: Any, op: str, local: Any, remote: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps + 1):  # the first one warms the endpoint and the registration caches
        h = agent.initialize_xfer(op, local, remote, "target", b"")
        t0 = time.perf_counter()
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        if st != "DONE":
            raise RuntimeError(f"{op} ended {st}")
        out.append(dt)
    return out[1:]


def run(gpus: tuple[str, str], mem: str, mb: int, reps: int) -> dict[str, Any]:
    nbytes = mb << 20
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(theirs, gpus[1], mem, nbytes), daemon=True)
    proc.start()
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    agent = _agent("initiator")
    buf, row = _buffer(mem, gpus[0], nbytes, 3)
    agent.register_memory(row, mem)
    md, remote_row, target_sum = mine.recv()
    mine.send(agent.get_agent_metadata())
    agent.add_remote_agent(md)
    local = agent.get_xfer_descs(row, mem)
    remote = agent.get_xfer_descs(np.array(remote_row, dtype=np.uint64), mem)
    result: dict[str, Any] = {"gpus": ",".join(gpus), "mem": mem, "mb": mb, "reps": reps}
    own_sum = _checksum(buf)
    read = _timed(agent, "READ", local, remote, reps)
    read_ok = _checksum(buf) == target_sum != own_sum  # the target's bytes arrived here
    write = _timed(agent, "WRITE", local, remote, reps)
    mine.send("done")
    landed = mine.recv()
    proc.join(30)
    for op, times in (("write", write), ("read", read)):
        result[f"{op}_gbps_best"] = nbytes / min(times) / 1e9
        result[f"{op}_gbps_median"] = nbytes / statistics.median(times) / 1e9
    result["read_over_write"] = result["read_gbps_median"] / result["write_gbps_median"]
    # The READ brought the target's bytes over ours; the WRITE then put them back there.
    result["bytes_ok"] = read_ok and landed == target_sum
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="0,0", help="CUDA_VISIBLE_DEVICES of initiator,target")
    ap.add_argument("--mem", default="VRAM", choices=("VRAM", "DRAM"))
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    pair = tuple(a.gpus.split(","))
    if len(pair) != 2:
        ap.error("--gpus takes two ids, initiator,target")
    print(json.dumps(run((pair[0], pair[1]), a.mem, a.mb, a.reps)), flush=True)


if __name__ == "__main__":
    main()
