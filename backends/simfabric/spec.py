"""Fabric parameters and their defaults, with where each number comes from.

Sources are measurements on the H100 and CPU machines (docs/benchmarks.md) and vLLM's published
posting figures (118 descriptors in 460 us, 18,880 in 46 ms: vLLM issue on fragmented KV); a
number with no measurement behind it says so and is a plain assumption a scenario can override.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

NS_PER_S = 1_000_000_000


@dataclass(frozen=True, slots=True)
class NicSpec:
    """One node's RDMA NIC as the simulator charges it."""

    # 50 GB/s: a 400 Gb/s NIC per GPU, the usual H100 deployment (assumption), and just under the
    # pinned D2H copy rate measured on the H100 machine (55.0 GB/s, docs/benchmarks.md, Kernels), which bounds
    # what a GPU can feed a NIC.
    bandwidth_bps: int = 50_000_000_000
    # One-way wire + NIC latency of an RDMA write; a few microseconds on InfiniBand (assumption).
    latency_ns: int = 5_000
    # Uniform extra delay in [0, jitter) per transfer (assumption).
    jitter_ns: int = 2_000
    # Fixed cost and per-descriptor cost of posting one transfer: fitted to vLLM's measurement in
    # vLLM's figures (118 descriptors -> 460 us, 18,880 -> 46 ms): 2.43 us/descriptor + 174 us.
    post_cost_ns: int = 174_000
    per_desc_ns: int = 2_430
    # A READ's cost a descriptor on its initiator (pull: decode posts them), where it differs from a
    # WRITE's; 0: the same as ``per_desc_ns`` (every profile fitted before it existed). `kvferry
    # calibrate --rooms` fits it from pull rows with many descriptors (sim/calibrate/readpost.py).
    read_desc_ns: int = 0
    # Transfers a NIC keeps in flight before new posts queue (assumption; UCX keeps a bounded
    # number of outstanding requests per endpoint).
    max_inflight: int = 64
    # How long a transfer into a dead peer or over a down link takes to report ERR (assumption:
    # a UCX/IB retry timeout, shortened so simulated runs stay small).
    error_timeout_ns: int = 2_000_000
    # From a write landing (or a transfer completing) to the runtime that waits on it handling
    # the notification (or DONE): a real runtime sees them only when its data thread next polls
    # NIXL. 0 here (an ideal runtime); `kvferry calibrate --rooms` fits it from bench rows.
    completion_delay_ns: int = 0
    # Two costs measured on one GPU that hosts every rank (0 by default: off; which nodes share
    # the device or the host is FabricSpec.one_gpu's). ``shared_desc_ns``:
    # a descriptor's cost on the device that the nodes posting through it share (cuda_ipc's
    # copies of all processes on one GPU run on that GPU); a post is done when both its own posting
    # (``per_desc_ns`` a descriptor, its process's CPU) and its turn on the shared device are,
    # so one poster pays max(per_desc, shared_desc) and two concurrent ones 2 * shared_desc each.
    # ``host_bandwidth_bps``: the wire of a transfer between host (pinned) buffers, shared by an
    # initiator's active host transfers (UCX's cma: the initiator's single-threaded copy).
    shared_desc_ns: int = 0
    host_bandwidth_bps: int = 0
    # ``host_shared_bandwidth_bps``: the host-to-host wire every initiator with it shares (one
    # host's memory: the cma copies of all its processes at once; 0: off): k host transfers active
    # on one host each move at most 1/k of it, beside their initiator's own host wire.
    host_shared_bandwidth_bps: int = 0
    # Host work that holds the rank's one runtime thread (``Node.host_busy_until``; 0: off;
    # `kvferry calibrate --rooms` fits both). ``room_handle_ns``: per TransferInfo or PullOffer
    # handled, on its receiver, the rank that plans the room's writes or reads (the plan, its
    # descriptors and NIXL's post under the GIL: 8 rooms in flight cost a rank about 1 ms each,
    # one after another).
    # ``completion_handle_ns``: per notification handled by its target and per DONE by its
    # initiator, after ``completion_delay_ns`` (the NotificationIn, aux check and Success).
    room_handle_ns: int = 0
    completion_handle_ns: int = 0
    # ``push_handle_ns``: per TransferInfo of a push room, on top of ``room_handle_ns``: decode's
    # PUSH_REG taken into the lease registry and matched with the room's finished forward
    # before its first chunk can run (traced on an H200: 150-200 us more than a direct room).
    push_handle_ns: int = 0

    def validate(self) -> None:
        for name in ("bandwidth_bps", "max_inflight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"nic.{name} must be positive")
        for name in (
            "latency_ns",
            "jitter_ns",
            "post_cost_ns",
            "per_desc_ns",
            "read_desc_ns",
            "error_timeout_ns",
            "completion_delay_ns",
            "shared_desc_ns",
            "host_bandwidth_bps",
            "host_shared_bandwidth_bps",
            "room_handle_ns",
            "completion_handle_ns",
            "push_handle_ns",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"nic.{name} must be >= 0")


@dataclass(frozen=True, slots=True)
class ControlSpec:
    """The control channel (ZMQ over TCP in the real backend)."""

    # 50 us one way: a TCP round trip on a datacenter network through ZMQ is ~100 us (assumption).
    latency_ns: int = 50_000
    jitter_ns: int = 10_000
    # A receiving runtime handles its control messages one at a time (one control thread): each
    # holds it this long, so messages arriving together wait for each other (0: off).
    handle_ns: int = 0
    # The staged flows' own host work per staging message, on top of ``handle_ns``: decode's
    # grant of a StagingReq (the ring or pinned allocation and its answer), prefill's handling of
    # the StagingRsp and of each Watermark return. Held on the receiver's control thread like
    # ``handle_ns``, so the requests of several prefill ranks or rooms wait for each other at
    # decode (0: off; `kvferry calibrate --rooms` fits it from staged bench rows).
    staging_handle_ns: int = 0
    # The sender's host work per control message (encoding, signing, the ZMQ send), holding its
    # runtime thread: a rank that sends to several peers, or for several rooms, sends one after
    # another (0: off; `kvferry calibrate --rooms` fits it).
    send_ns: int = 0

    def validate(self) -> None:
        if min(self.latency_ns, self.jitter_ns, self.handle_ns, self.staging_handle_ns, self.send_ns) < 0:
            raise ValueError("control latency, jitter and handling costs must be >= 0")


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """Gather/scatter kernels of the staged flows: a launch cost plus bytes over a copy rate.

    Defaults from the H100 kernel table in docs/benchmarks.md (Kernels, 2026-11-22): host cost
    101-181 us per call (140 taken); GPU<->GPU gather/scatter 1426-1470 GB/s (1440 taken);
    zero-copy gather to / scatter from pinned host memory 50.6-52.5 GB/s (51 taken).
    """

    launch_ns: int = 140_000
    gpu_bps: int = 1_440_000_000_000
    pinned_bps: int = 51_000_000_000
    # Kernels of one node run one after another on its stream; a GPU also runs the model, so a
    # kernel may first wait for the step in progress: an exponential wait of this mean (0: an
    # idle GPU, the assumption of the H100 table; a decode step is tens of ms in practice).
    busy_mean_ns: int = 0
    # The runtime's host work per gather or scatter: the copy executor's submit (validation, the
    # page-id upload, the launcher) and the pickup of its completion. It holds the rank's one
    # runtime thread, the one that also handles control messages (``ControlSpec.handle_ns``,
    # ``staging_handle_ns``), before the kernel reaches the stream (0: off; `kvferry calibrate
    # --rooms` fits it; ``launch_ns`` is then the bare launch on the stream).
    submit_ns: int = 0

    def validate(self) -> None:
        if min(self.launch_ns, self.busy_mean_ns, self.submit_ns) < 0:
            raise ValueError("kernel.launch_ns, kernel.busy_mean_ns and kernel.submit_ns must be >= 0")
        if self.gpu_bps <= 0 or self.pinned_bps <= 0:
            raise ValueError("kernel copy rates must be positive")

    def cost_ns(self, nbytes: int, pinned: bool) -> int:
        rate = self.pinned_bps if pinned else self.gpu_bps
        return self.launch_ns + nbytes * NS_PER_S // rate


@dataclass(frozen=True, slots=True)
class FabricSpec:
    nic: NicSpec = field(default_factory=NicSpec)
    control: ControlSpec = field(default_factory=ControlSpec)
    kernel: KernelSpec = field(default_factory=KernelSpec)
    # Prepared descriptor lists (make_prepped_xfer) merge dense runs; one-shot posts never do
    # (docs/design.md section 2).
    prepped: bool = True
    # Where the ranks run, for the two shared costs of NicSpec (shared_desc_ns and
    # host_shared_bandwidth_bps). True: every rank on one GPU of one host, as `kvferry bench nixl`
    # runs them and as those costs were measured (bench predict and calibrate simulate rows so).
    # False: each rank has its own GPU, and a server's ranks share their host's memory wire (a
    # deployment; the world names each node's server, Fabric.add_node's ``host``).
    one_gpu: bool = False

    def validate(self) -> None:
        self.nic.validate()
        self.control.validate()
        self.kernel.validate()


# The CPU machine (docs/benchmarks.md, NIXL): NIXL UCX DRAM->DRAM across two processes on loopback.
CPU_LOOPBACK = FabricSpec(nic=replace(NicSpec(), bandwidth_bps=560_000_000, latency_ns=20_000))
# The same in one process (3.7-3.9 GB/s measured).
CPU_IN_PROCESS = FabricSpec(nic=replace(NicSpec(), bandwidth_bps=3_800_000_000, latency_ns=2_000))
PROFILES: dict[str, FabricSpec] = {
    "h100-rdma": FabricSpec(),
    "cpu-loopback": CPU_LOOPBACK,
    "cpu-in-process": CPU_IN_PROCESS,
}
