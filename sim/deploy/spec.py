"""What a deployment is: the model, P prefill and D decode instances (TP sizes, page sizes, a
GPU and a per-GPU NIC profile), the flow that moves KV between them and its knobs, and the SLOs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kvferry.core.errors import GeometryError, KvferryError
from kvferry.core.flows import FLOW_NAMES
from kvferry.core.geometry import ModelGeometry, validate_tp
from kvferry.sim.deploy import hardware
from kvferry.sim.deploy.compute import Roofline
from kvferry.sim.deploy.router import ROUTERS
from kvferry.sim.pages import ALLOCATORS

__all__ = ["FLOWS", "MAX_INSTANCES", "PULL_ORCHESTRATIONS", "DeployError", "DeploySpec"]

FLOWS = FLOW_NAMES
MS = 1_000_000
MAX_INSTANCES = 64  # per side: a simulated deployment's ranks all live in one process
# When decode starts a pull: "overlapped" (this project's pull: decode opens the room and
# allocates its pages at arrival, its READs overlap prefill's compute) or "serial" (vLLM's
# NixlConnector behind its proxy: decode hears of the request only once prefill has finished it).
PULL_ORCHESTRATIONS = ("overlapped", "serial")
MAX_PROXY_HOP_MS = 10_000.0
MAX_RESERVED_TOKENS = 1 << 20


class DeployError(KvferryError, ValueError):
    """A deployment that cannot be simulated; the message says which input."""


@dataclass(frozen=True, slots=True)
class DeploySpec:
    model: str = "qwen3-8b"
    prefill_tp: int = 4
    decode_tp: int = 2
    prefill_page_size: int = 16
    decode_page_size: int = 16
    gpu: str = "h100"
    nic: str = "nic-400g"
    flow: str = "direct"
    chunk_tokens: int = 2048  # chunked prefill: tokens per chunk (each chunk's KV goes as it is ready)
    workers: int = 2  # transfer queues (one worker each) per prefill rank
    staging_chunks: int = 4  # ring / pinned pools hold this many of the largest chunk
    max_batch: int = 256  # decode's largest batch
    weight_bytes: int = 2  # bytes per weight (2: BF16, 1: FP8)
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 100.0
    seed: int = 1
    # P prefill and D decode instances (each of the TP above, a NIC per GPU) in one simulated
    # deployment: a router sends each request to a prefill instance (round-robin) and a decode
    # instance (the least loaded), sim/deploy/router.py.
    prefill_instances: int = 1
    decode_instances: int = 1
    # Expert parallelism across decode instances (DEP: each instance an attention data-parallel
    # rank with its own batch and KV, the experts spread over ``decode_ep`` of them): each holds
    # and reads 1/decode_ep of the experts. 1: every decode instance holds every expert.
    decode_ep: int = 1
    # A fitted profile (``kvferry calibrate --rooms``) whose per-room control path (one control
    # message's latency, the delay before a completion is handled) the serving runtime pays on
    # top of the NIC's wire and posting; "" for an ideal runtime (the fabric's 50 us messages).
    control_path: str = ""
    # Only for flow "pull" (other flows ignore it, so one spec can compare every flow). "serial":
    # a request's decode side (room open, its READs) starts after prefill computed its last chunk,
    # then ``proxy_hop_ms`` (prefill's response back to the proxy and the proxy's request to
    # decode), then the end of decode's running step (its scheduler takes new requests between
    # steps). No hop time is published: 5 ms is a guess to be swept (docs/fidelity.md, vLLM PR 35264).
    pull_orchestration: str = "overlapped"
    proxy_hop_ms: float = 5.0
    # How each server hands out KV pages (sim/pages.py): "sglang", SGLang's disaggregated servers'
    # sorted free list, decode also taking a page per page of generated tokens; "lowest-first",
    # the original model (lowest free ids, no pages for generated tokens).
    page_allocator: str = "sglang"
    # SGLang's --num-reserved-decode-tokens (default 512): with the "sglang" allocator, decode
    # admits a request only if its prompt's pages plus this many tokens fit beside the same
    # reservation for every request it already holds, and when a step still finds no page for a
    # generated token it retracts requests (their KV swapped out to host memory and back when
    # room returns). 0: admit on the prompt's pages alone (retraction still applies).
    decode_reserved_tokens: int = 512
    # How requests are spread over several instances a side (sim/deploy/router.py): least-requests
    # (prefill round-robin, decode fewest in flight), round-robin, or least-tokens.
    router: str = "least-requests"
    # False: each instance pair's transfers run on one of its TP groups (``rank_groups``), which
    # are identical and share nothing but their instances' compute, so one stands for all: the
    # same timings with the fabric's jitter off (tests/test_deploy_groups.py), 2-3.4x faster.
    # With jitter, one group draws one a hop where every rank waits for the latest of several,
    # a few microseconds earlier a hop, which can move a request to a neighbouring decode step.
    # True: every rank runs.
    every_rank: bool = False

    @property
    def serial_pull(self) -> bool:
        return self.flow == "pull" and self.pull_orchestration == "serial"

    def runs_as(self) -> str:
        """The flow whose runs this spec's flow's runs are, event for event: its own, except push
        where a push registration costs its receiver no host work (``push_handle_us`` of the
        control path's profile, else the NIC's, unset or 0). Push is the direct flow's writes under
        leases (core/flows/push.py): decode's PUSH_REG is its TransferInfo, and the leases and the
        match watchdog are bookkeeping that takes no simulated time. Without faults a lease never
        ends (decode's heartbeats renew it every second), and a registration unmatched for the
        watchdog's 119 s is a room far past any TTFT SLO. So a run of one is a run of the other,
        request for request, but for a room that waits that long for its first chunk: push fails
        it where direct finishes it late, a miss under both (tests/test_push_twin.py)."""
        if self.flow == "push" and not self._push_handle_us():
            return "direct"
        return self.flow

    def _push_handle_us(self) -> float:
        return self._nic().push_handle_us or 0.0

    def _nic(self) -> hardware.NicProfile:
        """The NIC's profile with the control path's per-room costs in place, where one is given."""
        nic = hardware.nic(self.nic)
        ctl = self._control()
        if ctl is None:
            return nic
        return replace(
            nic,
            control_latency_us=ctl.control_latency_us,
            completion_delay_us=ctl.completion_delay_us,
            staging_handle_us=ctl.staging_handle_us,
            copy_submit_us=ctl.copy_submit_us,
            control_send_us=ctl.control_send_us,
            room_handle_us=ctl.room_handle_us,
            completion_handle_us=ctl.completion_handle_us,
            push_handle_us=ctl.push_handle_us,
        )

    def geometry(self) -> ModelGeometry:
        try:
            return ModelGeometry.preset(self.model)
        except GeometryError as e:
            raise DeployError(str(e)) from None

    def rank_groups(self) -> int:
        """Into how many identical, independent groups a prefill and a decode instance's ranks
        split: heads sharded (not replicated) on both sides, the KV of heads k*H/g..(k+1)*H/g moving
        only between group k's ranks, gcd(prefill TP, decode TP) of them. 1 under MLA (every
        rank holds the latent) or replicated heads."""
        g = self.geometry()
        heads, ptp, dtp = g.num_kv_heads, self.prefill_tp, self.decode_tp
        if g.is_mla or heads % ptp or heads % dtp:
            return 1
        return math.gcd(ptp, dtp)

    def check(self) -> None:
        g = self.geometry()
        for side in ("prefill_tp", "decode_tp"):
            try:
                validate_tp(g, getattr(self, side))
            except GeometryError as e:
                raise DeployError(f"{side}: {e}") from None
        if self.flow not in FLOWS:
            raise DeployError(f"flow: expected one of {', '.join(FLOWS)}, got {self.flow!r}")
        for name in ("prefill_page_size", "decode_page_size", "workers", "staging_chunks", "max_batch"):
            if getattr(self, name) < 1:
                raise DeployError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_tokens < 1:
            raise DeployError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.weight_bytes not in (1, 2):
            raise DeployError(f"weight_bytes must be 1 (FP8) or 2 (BF16), got {self.weight_bytes}")
        for name in ("prefill_instances", "decode_instances"):
            n = getattr(self, name)
            if type(n) is not int or not 1 <= n <= MAX_INSTANCES:
                raise DeployError(f"{name} must be in [1, {MAX_INSTANCES}], got {n!r}")
        ep = self.decode_ep
        if type(ep) is not int or ep < 1 or self.decode_instances % ep:
            raise DeployError(f"decode_ep must divide decode_instances ({self.decode_instances}), got {ep!r}")
        routed = g.num_experts - g.shared_experts
        if ep > 1 and (not routed or routed % ep):
            raise DeployError(
                f"decode_ep {ep} needs a MoE model whose routed experts it divides ({self.model})"
            )
        if self.ttft_slo_ms <= 0 or self.tpot_slo_ms <= 0:
            raise DeployError("SLOs must be positive")
        self._check_orchestration()
        r = self.decode_reserved_tokens
        if type(r) is not int or not 0 <= r <= MAX_RESERVED_TOKENS:
            raise DeployError(f"decode_reserved_tokens must be in [0, {MAX_RESERVED_TOKENS}], got {r!r}")
        if self.page_allocator not in ALLOCATORS:
            raise DeployError(
                f"page_allocator: expected one of {', '.join(ALLOCATORS)}, got {self.page_allocator!r}"
            )
        if self.router not in ROUTERS:
            raise DeployError(f"router: expected one of {', '.join(ROUTERS)}, got {self.router!r}")
        hardware.gpu(self.gpu)
        hardware.nic(self.nic)
        self._control()

    def _check_orchestration(self) -> None:
        if self.pull_orchestration not in PULL_ORCHESTRATIONS:
            raise DeployError(
                f"pull_orchestration: expected one of {', '.join(PULL_ORCHESTRATIONS)}, "
                f"got {self.pull_orchestration!r}"
            )
        hop = self.proxy_hop_ms
        # ``not 0 <= hop`` also refuses NaN.
        if isinstance(hop, bool) or not isinstance(hop, int | float) or not 0 <= hop <= MAX_PROXY_HOP_MS:
            raise DeployError(f"proxy_hop_ms must be in [0, {MAX_PROXY_HOP_MS:g}], got {hop!r}")

    def _control(self) -> hardware.NicProfile | None:
        if not self.control_path:
            return None
        try:
            p = hardware.fitted(self.control_path)
        except hardware.ProfileError as e:
            raise DeployError(f"control_path: {e}") from None
        if p.control_latency_us is None or p.completion_delay_us is None:
            raise DeployError(
                f"control_path: profile {self.control_path} has no per-room control path "
                "(refit it with `kvferry calibrate --rooms BENCH.jsonl`)"
            )
        return p

    def roofline(self, side: str) -> Roofline:
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        ep = self.decode_ep if side == "decode" else 1
        return Roofline(self.geometry(), hardware.gpu(self.gpu), tp, self.weight_bytes, ep)

    def state_bytes_per_rank(self, side: str) -> int:
        """HBM a rank sets aside for hybrid models' recurrent state: one slot per request of the
        largest batch (SGLang sizes its mamba pool by the running-request cap), the state's heads
        split by TP like the KV heads."""
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        return self.max_batch * self.geometry().state_bytes // tp

    def page_bytes(self, side: str) -> int:
        """One KV page's bytes on one rank of ``side`` (every region, the rank's heads)."""
        g = self.geometry()
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        page_size = self.prefill_page_size if side == "prefill" else self.decode_page_size
        heads = g.num_kv_heads // tp if tp <= g.num_kv_heads else 1
        return page_size * g.num_regions * heads * g.head_bytes

    def pages(self, side: str) -> int:
        """KV pages per rank: the HBM the server gives away, less the rank's weights and the
        recurrent-state slots of a hybrid model."""
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        gpu = hardware.gpu(self.gpu)
        free = (
            gpu.hbm_gb * 1e9 * gpu.memory_fraction
            - self.roofline(side).weight_bytes_per_rank()
            - self.state_bytes_per_rank(side)
        )
        n = int(free // self.page_bytes(side))
        if n < 1:
            hint = "raise the TP" + (", or use FP8 weights: --fp8-weights" if self.weight_bytes == 2 else "")
            state = self.state_bytes_per_rank(side)
            if state:
                hint += (
                    f", or lower max_batch (the recurrent state of {self.max_batch} requests "
                    f"takes {state / 1e9:.0f} GB)"
                )
            raise DeployError(
                f"{self.model} at TP {tp} does not fit a {gpu.name}: its weights take "
                f"{self.roofline(side).weight_bytes_per_rank() / 1e9:.0f} GB of a rank's "
                f"{gpu.hbm_gb * gpu.memory_fraction:.0f} GB ({hint})"
            )
        return n

    def scenario_dict(self, max_input: int, max_chunk: int) -> dict[str, Any]:
        """The scenario (sim/scenario.py) of one prefill and one decode instance running this flow
        (the world repeats it for each instance)."""
        fab = hardware.fabric_spec(hardware.gpu(self.gpu), self._nic())
        groups = 1 if self.every_rank else self.rank_groups()
        model: dict[str, Any] = {"preset": self.model}
        if groups > 1:
            geo = self.geometry()
            model = {
                "name": f"{geo.name} (1 of {groups} TP groups)",
                "num_layers": geo.num_layers,
                "num_kv_heads": geo.num_kv_heads // groups,
                "head_dim": geo.head_dim,
                "dtype": geo.dtype.value,
            }
        return {
            "name": f"deploy-{self.model}-tp{self.prefill_tp}-tp{self.decode_tp}-{self.flow}",
            "seed": self.seed,
            "move_bytes": False,
            "model": model,
            "topology": {
                "prefill_tp": self.prefill_tp // groups,
                "decode_tp": self.decode_tp // groups,
                "prefill_page_size": self.prefill_page_size,
                "decode_page_size": self.decode_page_size,
                "prefill_pages": min(self.pages("prefill"), 1 << 20),
                "decode_pages": min(self.pages("decode"), 1 << 20),
                "workers": self.workers,
                "aux_rows": 1 << 16,
            },
            "fabric": {
                "bandwidth_gbps": fab.nic.bandwidth_bps / 1e9,
                "latency_ns": fab.nic.latency_ns,
                "post_cost_ns": fab.nic.post_cost_ns,
                "per_desc_ns": fab.nic.per_desc_ns,
                "read_desc_ns": fab.nic.read_desc_ns,
                "error_timeout_ns": fab.nic.error_timeout_ns,
                "completion_delay_ns": fab.nic.completion_delay_ns,
                "room_handle_ns": fab.nic.room_handle_ns,
                "completion_handle_ns": fab.nic.completion_handle_ns,
                "push_handle_ns": fab.nic.push_handle_ns,
                "control_latency_ns": fab.control.latency_ns,
                "staging_handle_ns": fab.control.staging_handle_ns,
                "control_send_ns": fab.control.send_ns,
                "kernel_launch_ns": fab.kernel.launch_ns,
                "kernel_submit_ns": fab.kernel.submit_ns,
                "gpu_copy_gbps": fab.kernel.gpu_bps / 1e9,
                "pinned_copy_gbps": fab.kernel.pinned_bps / 1e9,
            },
            "flows": {"flow": self.flow, "auto_chunks": self.staging_chunks},
            "workload": {
                "rooms": 1,  # sizes staging and deadlines for the largest room; rooms come later
                "tokens_min": max_input,
                "tokens_max": max_input,
                "chunk_tokens": max_chunk,
                "compute_ns_per_token": 0,
            },
            # The real servers' deadlines (core defaults are tens of seconds), longer under load.
            "timeouts": {
                "bootstrap_ns": 30_000 * MS,
                "waiting_ns": 120_000 * MS,
                "transfer_ns": 120_000 * MS,
                "heartbeat_interval_ns": 1_000 * MS,
                "heartbeat_timeout_ns": 10_000 * MS,
                "fence_ns": 400_000 * MS,
                "tombstone_ns": 500_000 * MS,
            },
            "phases": {"fault_window_us": 0},
            # A request that times out under overload is an outcome of the load (reported as
            # failed), not a protocol bug; every other invariant is still checked.
            "checks": {"fault_free": False},
        }
