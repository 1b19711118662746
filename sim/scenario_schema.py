"""The scenario format's schema: one frozen msgspec Struct per TOML table, each key typed (with its
range as a ``Meta`` constraint) and documented in its ``DOC`` (docs/scenarios.md is generated from
them, sim/scenario_docs.py), and the values derived from a scenario alone (its pools, its staging
sizes).

msgspec decodes a file into ``ScenarioFile`` (sim/scenario_read.py), refusing unknown keys and
values of the wrong type or range; ``Scenario`` is what a run takes. Writing one back is
sim/scenario_dump.py; sim/scenario.py gathers the public names.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec
from kvferry.backends.simfabric.spec import FabricSpec
from kvferry.core.errors import KvferryError
from kvferry.core.flows import FLOW_NAMES
from kvferry.core.flows.registry import extra_names
from kvferry.core.geometry import Layout, ModelGeometry, PoolGeometry
from msgspec import Meta
from msgspec.structs import replace

US = 1_000


class ScenarioError(KvferryError, ValueError):
    """A scenario file that cannot be run; the message names the field."""


FaultKind = Literal["crash", "link_down", "slow_link"]
FAULT_EVENT_KINDS: tuple[str, ...] = get_args(FaultKind)
NODE_EVENT_KINDS = ("crash",)
HOOKS = (
    "free_pages_early",
    "chunk_offset_own_length",
    "keep_room_tables",
    "decode_ignores_room_failed",
    # staged flows (sim/planted.py)
    "ring_keeps_old_head",
    "drop_early_staging_req",
    "shared_staging_buffer",
    "free_staging_before_scatter",
    "leak_failed_room_staging",
    # campaign blind spots (sim/planted.py)
    "silent_truncation",
    "last_note_completes",
    "late_info_revives_room",
    # pull flow, failure notices (sim/planted.py)
    "pull_free_early",
    "silent_write_failure",
    "prefix_front_trim",
    "push_lease_never_expires",
    "suffix_strips_too_much",
    # layer-wise flow (sim/planted.py)
    "last_layer_write_only",
    "layers_after_failure",
    # several servers a side (sim/instances.py)
    "links_cache_by_decode",
)
# Servers of one side in a scenario: every rank is a node with its own engine and NIC, so a few
# dozen already make a slow run; the deployment model (sim/deploy) goes further in timing only.
MAX_INSTANCES = 16
FLOW_CHOICES = ("policy", *FLOW_NAMES, "mixed")


def flow_choices() -> tuple[str, ...]:
    """``FLOW_CHOICES`` and any flow registered outside ``Flow`` (core/flows/registry.py)."""
    return (*FLOW_CHOICES, *extra_names())


PushMatch = Literal["transfer_id", "request_id"]
PUSH_MATCH_CHOICES: tuple[str, ...] = get_args(PushMatch)

# Value types of the format; msgspec checks them on decode, and an error names the bound broken.
Count = Annotated[int, Meta(ge=0)]  # a count, a size or a time: never negative
Positive = Annotated[int, Meta(ge=1)]
Share = Annotated[float, Meta(ge=0.0, le=1.0)]  # a probability or a share of rooms


class Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One table of the format: immutable, and refusing a key it does not have."""


class ModelSpec(Table):
    name: str = "sim-tiny"
    num_layers: Positive = 2
    num_kv_heads: Positive = 8
    head_dim: Positive = 8
    dtype: str = "bf16"
    is_mla: bool = False

    DOC: ClassVar[dict[str, str]] = {
        "name": "A label for the model, shown in plans and summaries.",
        "num_layers": "Transformer layers: each has its own K and V buffers (one latent buffer under MLA).",
        "num_kv_heads": "KV heads of the whole model, split or replicated across TP ranks (1 under MLA).",
        "head_dim": "Elements per head per token.",
        "dtype": "Element type of the KV cache.",
        "is_mla": "Multi-head latent attention: one latent buffer per layer instead of K and V.",
    }

    def geometry(self) -> ModelGeometry:
        return ModelGeometry(
            self.name, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.is_mla
        )


class Topology(Table):
    prefill_tp: Annotated[int, Meta(ge=1, le=64)] = 2
    decode_tp: Annotated[int, Meta(ge=1, le=64)] = 1
    prefill_page_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    decode_page_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    prefill_pages: Annotated[int, Meta(ge=1, le=1 << 20)] = 1024
    decode_pages: Annotated[int, Meta(ge=1, le=1 << 20)] = 1024
    prefill_layout: str = "sglang_nhd"
    decode_layout: str = "sglang_nhd"
    workers: Annotated[int, Meta(ge=1, le=64)] = (
        2  # transfer queues (one worker each) per prefill rank, as in SGLang PR 20680
    )
    aux_rows: Annotated[int, Meta(ge=1, le=1 << 16)] = 256
    # Servers of each side on the one fabric, each with the TP above and its own memory; a router
    # sends each room to one of each (sim/instances.py).
    prefill_instances: Annotated[int, Meta(ge=1, le=MAX_INSTANCES)] = 1
    decode_instances: Annotated[int, Meta(ge=1, le=MAX_INSTANCES)] = 1

    DOC: ClassVar[dict[str, str]] = {
        "prefill_tp": "Prefill ranks (tensor-parallel size): nodes prefill0, prefill1, ...",
        "decode_tp": "Decode ranks (tensor-parallel size): nodes decode0, decode1, ...",
        "prefill_page_size": "Tokens per KV page on prefill.",
        "decode_page_size": "Tokens per KV page on decode.",
        "prefill_pages": "KV pages in each prefill rank's pool; arriving rooms wait while it is full.",
        "decode_pages": "KV pages in each decode rank's pool; arriving rooms wait while it is full.",
        "prefill_layout": "Memory layout of prefill's KV buffers.",
        "decode_layout": "Memory layout of decode's KV buffers.",
        "workers": "Transfer queues, one worker each, per prefill rank.",
        "aux_rows": "Aux rows per rank: one per room in flight, so also a bound on rooms in flight.",
        "prefill_instances": "Prefill servers, each of `prefill_tp` ranks with its own pages; rooms go to "
        "them round-robin. With several, instance i's ranks are nodes prefill{i}.0, prefill{i}.1, ...",
        "decode_instances": "Decode servers, each of `decode_tp` ranks with its own pages; each room goes "
        "to the one with the fewest rooms in flight. With several, nodes decode{i}.0, decode{i}.1, ...",
    }

    def servers(self, side: str) -> tuple[str, ...]:
        """Name prefixes of one side's servers: ``prefill`` alone (nodes prefill0, prefill1, ...),
        or ``prefill0.``, ``prefill1.``, ... of several (nodes prefill0.0, ...)."""
        n = self.prefill_instances if side == "prefill" else self.decode_instances
        return (side,) if n == 1 else tuple(f"{side}{i}." for i in range(n))

    def server_nodes(self, side: str) -> tuple[tuple[str, ...], ...]:
        """Per server of ``side``, its ranks' node names, in rank order."""
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        return tuple(tuple(f"{server}{r}" for r in range(tp)) for server in self.servers(side))


class RoomSpec(Table):
    tokens: Positive
    arrival_us: Count = 0
    chunks: tuple[Positive, ...] = ()  # explicit chunk lengths; empty: split by workload.chunk_tokens
    prefill_delay_us: Count = 0  # prefill compute starts this long after decode allocates
    # Decode allocates this long after prefill opened the room (decode short of memory): prefill
    # then asks for staging space before decode knows the room.
    decode_lag_us: Count = 0
    # Decode allocates this many tokens (0: ``tokens``); a different count is a length mismatch
    # between the two servers, which must fail the room on both sides, never truncate or pad it.
    decode_tokens: Count = 0

    @property
    def dec_tokens(self) -> int:
        return self.decode_tokens or self.tokens

    DOC: ClassVar[dict[str, str]] = {
        "tokens": "Prompt tokens of the room.",
        "arrival_us": "When the room arrives, in us from the start.",
        "chunks": "Chunk lengths, summing to tokens (empty: split by `[workload].chunk_tokens`).",
        "prefill_delay_us": "Prefill starts computing this long after decode allocated, in us.",
        "decode_lag_us": "Decode allocates this long after prefill opened the room, in us "
        "(prefill then asks for staging space before decode knows the room).",
        "decode_tokens": "Tokens decode allocates for the room (0: `tokens`); any other count must "
        "fail the room on both sides.",
    }


class Workload(Table):
    rooms: Annotated[int, Meta(ge=0, le=1_000_000)] = 32
    tokens_min: Positive = 16
    tokens_max: Positive = 256
    chunk_tokens: Count = 64
    arrival_mean_us: Count = 100
    # Time to "compute" one chunk on prefill (forward pass), per token.
    compute_ns_per_token: Count = 200
    decode_lag_us_max: Annotated[int, Meta(ge=0, le=10_000_000)] = (
        0  # each drawn room's decode_lag_us is uniform in [0, this]
    )
    length_mismatch: Share = 0.0  # share of drawn rooms whose decode allocates another length
    prefix_hit: Share = 0.0  # share of rooms whose decode already holds a prefix (direct/pull/push)
    explicit: tuple[RoomSpec, ...] = msgspec.field(default=(), name="room")

    DOC: ClassVar[dict[str, str]] = {
        "rooms": "Rooms (requests) in the run, drawn at random; with `[[workload.room]]` entries, "
        "their number (it may be left out).",
        "tokens_min": "Fewest tokens of a drawn room.",
        "tokens_max": "Most tokens of a drawn room.",
        "chunk_tokens": "Tokens per chunk: prefill sends a room in chunks of this size (0: one chunk).",
        "arrival_mean_us": "Mean gap between drawn rooms' arrivals (exponential), in us.",
        "compute_ns_per_token": "Prefill compute per token of a chunk before it can be sent, in ns.",
        "decode_lag_us_max": "Each drawn room's decode allocates a uniform [0, this] us after prefill "
        "opened it (0: decode first).",
        "length_mismatch": "Share of drawn rooms whose decode allocation is shorter or longer than "
        "what prefill sends (each must end Failed on both sides).",
        "prefix_hit": "Share of rooms (of those on the direct, pull or push flow) whose decode already "
        "holds a prefix of uniform length: it asks only for the rest, which must land at its own slots.",
        "explicit": "Rooms given one by one: see `[[workload.room]]`.",
    }


class FaultEvent(Table, kw_only=True):
    at_us: Count = 0
    kind: FaultKind
    node: str
    peer: str = ""
    duration_us: Count = 0  # crash: restart after; link_down: up after; slow_link: restore after
    factor: Annotated[float, Meta(ge=1e-6, le=1.0)] = 1.0  # slow_link bandwidth multiplier

    DOC: ClassVar[dict[str, str]] = {
        "at_us": "When it happens, in us from the start (ignored from `[phases].fault_window_us` on).",
        "kind": "What happens.",
        "node": "The node that crashes, or one end of the link (prefill0, ..., decode0, ...).",
        "peer": "The other end of the link (link_down and slow_link only).",
        "duration_us": "crash: restart after; link_down: up after; slow_link: restore after, in us "
        "(0: until the heal).",
        "factor": "slow_link: bandwidth multiplier, in (0, 1].",
    }


class Faults(Table):
    swarm: bool = False  # draw a fault personality from the seed for everything unset below
    ctrl_drop: Share = 0.0
    ctrl_dup: Share = 0.0
    ctrl_reorder: Share = 0.0
    ctrl_delay: Share = 0.0
    ctrl_delay_max_us: Count = 500
    xfer_err: Share = 0.0
    abort: Share = 0.0  # probability that the scheduler aborts a room, on a random side
    notif_drop: Share = 0.0
    notif_delay: Share = 0.0
    notif_delay_max_us: Count = 500
    clock_skew_max_us: Count = 0
    events: tuple[FaultEvent, ...] = msgspec.field(default=(), name="event")

    DOC: ClassVar[dict[str, str]] = {
        "swarm": "Draw a fault personality from the seed for every rate and event left unset.",
        "ctrl_drop": "Probability that a control message is lost.",
        "ctrl_dup": "Probability that a control message is delivered twice.",
        "ctrl_reorder": "Probability that a control message is held back a while, so later ones overtake it.",
        "ctrl_delay": "Probability that a control message is delayed up to `ctrl_delay_max_us`.",
        "ctrl_delay_max_us": "Longest extra delay of a delayed control message, in us.",
        "xfer_err": "Probability that a write fails (ERR) after placing any prefix of its descriptors.",
        "abort": "Probability that the scheduler aborts a room, on a random side.",
        "notif_drop": "Probability that a write's notification is lost.",
        "notif_delay": "Probability that a notification is delayed up to `notif_delay_max_us`.",
        "notif_delay_max_us": "Longest extra delay of a delayed notification, in us.",
        "clock_skew_max_us": "Each node's clock is off by a uniform [0, this] us.",
        "events": "Timed faults: see `[[faults.event]]`.",
    }

    def injects_nothing(self) -> bool:
        """No fault rate and no timed event (clock skew is not a fault: clocks always differ)."""
        rates = (
            self.ctrl_drop,
            self.ctrl_dup,
            self.ctrl_reorder,
            self.ctrl_delay,
            self.xfer_err,
            self.abort,
            self.notif_drop,
            self.notif_delay,
        )
        return not (self.swarm or any(rates) or self.events)


class FlowSpec(Table):
    """Which flow moves each room (core.flows) and the staging memory each rank registers.

    ``flow``: "policy" (the default policy: direct for equal TP, ring for unequal TP when a ring
    is offered, else pinned, else direct), one flow for every room, or "mixed" (one drawn per room
    from those offered). Sizes in bytes; 0 = not offered. ``auto_size``: a flow named here gets
    room for ``auto_chunks`` of the workload's largest chunk wherever its size is left at 0.
    """

    flow: str = "policy"
    ring_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 0
    pinned_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 0
    worker_buffer_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 0
    prefill_pinned_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 0
    fallback_direct: bool = False
    auto_chunks: Annotated[int, Meta(ge=1, le=1024)] = 4
    push_match: PushMatch = "transfer_id"

    DOC: ClassVar[dict[str, str]] = {
        "flow": "Which flow moves each room: policy (direct for equal TP; for unequal TP ring if "
        "offered, else pinned, else direct), one flow for every room, or mixed (one drawn per room).",
        "ring_bytes": "Decode's staging ring per rank (0: not offered, unless auto-sized).",
        "pinned_bytes": "Decode's pinned host staging pool per rank.",
        "worker_buffer_bytes": "Prefill's staging buffer per transfer worker (ring and pinned flows).",
        "prefill_pinned_bytes": "Prefill's pinned host staging pool per rank (pinned flow).",
        "fallback_direct": "A chunk too large for decode's ring or pinned pool goes direct instead of "
        "failing its room.",
        "auto_chunks": "Staging that the chosen flows need and that is left at 0 is sized to hold this "
        "many of the workload's largest chunk.",
        "push_match": "How push registrations find their request: transfer_id (the router's id), or "
        "request_id (no transfer id: decode names the request with a retry suffix, matched by base id).",
    }


class TimeoutSpec(Table):
    """The core's deadlines, scaled to simulated runs (the real defaults are tens of seconds)."""

    bootstrap_ns: Positive = 50_000_000
    waiting_ns: Positive = 50_000_000
    transfer_ns: Positive = 50_000_000
    heartbeat_interval_ns: Positive = 2_000_000
    heartbeat_timeout_ns: Positive = 10_000_000
    fence_ns: Positive = 200_000_000
    tombstone_ns: Positive = 250_000_000

    DOC: ClassVar[dict[str, str]] = {
        "bootstrap_ns": "Room created until every TransferInfo and registration it needs is in.",
        "waiting_ns": "WaitingForInput until the first chunk (prefill) or first notification (decode).",
        "transfer_ns": "Transferring until done (prefill: from entering it, never renewed; decode: "
        "renewed by every notification).",
        "heartbeat_interval_ns": "Between two heartbeats to a peer.",
        "heartbeat_timeout_ns": "A peer silent this long is lost, and its live rooms fail.",
        "fence_ns": "Decode frees a failed room's pages without the peer's Stopped after this long; "
        "also how long a failure notice is resent.",
        "tombstone_ns": "How long a finished (room, transfer_id) keeps rejecting late messages.",
    }


class Phases(Table):
    fault_window_us: Count = 20_000  # faults injected until then; afterwards the network heals
    # After the heal (and the last arrival), every room must be terminal within this.
    liveness_us: Positive = 300_000

    DOC: ClassVar[dict[str, str]] = {
        "fault_window_us": "Faults are injected until then, in us; then the network heals (links up, "
        "full speed, crashed nodes restarted).",
        "liveness_us": "After the heal and the last arrival, every room must be terminal within this, in us.",
    }


class Checks(Table):
    bytes: bool = True
    ownership: bool = True
    monotone: bool = True
    agreement: bool = True
    liveness: bool = True
    conservation: bool = True
    tables_empty: bool = True
    fault_free: bool = True
    ring_progress: bool = True
    length: bool = True
    success_stable: bool = True
    failure_notice: bool = True
    lease: bool = True
    isolation: bool = True

    DOC: ClassVar[dict[str, str]] = {
        "bytes": "A room Success on every decode rank holds exactly the source bytes (and the room id "
        "in its aux row).",
        "ownership": "Every write into decode memory lands in pages the writing room owns at that moment.",
        "monotone": "Statuses only move forward, and Failed is absorbing.",
        "agreement": "Both sides of a room end alike: Success on all ranks, or Failed on both sides.",
        "liveness": "By the deadline, every room is terminal on every rank that opened it.",
        "conservation": "Rooms submitted = succeeded + failed; transfers posted = DONE + ERR.",
        "tables_empty": "After quiescence all memory is back and every per-room table, handle and "
        "staging allocation is gone.",
        "fault_free": "A run that injects no fault ends with every room Success and no ring request resent.",
        "ring_progress": "A producer waiting on a decode ring's watermark resumes once the ring drains.",
        "length": "A room whose decode allocation differs from what prefill sends ends Failed on "
        "every rank (never truncated or padded into Success).",
        "success_stable": "A room Success on every rank of both sides, once released, stays Success "
        "(no late message revives or fails it).",
        "failure_notice": "A prefill rank whose write failed (refused or in error) tells every decode rank "
        "it serves (RoomFailed) at once.",
        "lease": "Nothing is written under an expired push registration lease.",
        "isolation": "With several servers a side, every write, READ and control message of a room "
        "travels between its own prefill and decode servers, and only their ranks report its status.",
    }


class Shared(msgspec.Struct, frozen=True, kw_only=True):
    """The keys and tables a scenario file and a run take alike."""

    name: str = "unnamed"
    description: str = ""
    seed: Count = 0
    topology: Topology = msgspec.field(default_factory=Topology)
    flows: FlowSpec = msgspec.field(default_factory=FlowSpec)
    workload: Workload = msgspec.field(default_factory=Workload)
    faults: Faults = msgspec.field(default_factory=Faults)
    timeouts: TimeoutSpec = msgspec.field(default_factory=TimeoutSpec)
    phases: Phases = msgspec.field(default_factory=Phases)
    checks: Checks = msgspec.field(default_factory=Checks)
    hooks: tuple[str, ...] = ()  # planted bugs (tests only)
    move_bytes: bool = True


class Scenario(Shared, frozen=True, kw_only=True):
    """What a run takes: the file's tables, with ``[fabric]`` resolved against its profile and
    the deadlines the file left out derived (sim/scenario_read.py)."""

    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    fabric_profile: str = "h100-rdma"
    fabric: FabricSpec = msgspec.field(default_factory=FabricSpec)
    expect_violations: tuple[str, ...] = ()  # invariants a regression file is known to break
    # The [timeouts] keys and "liveness_us" the file set; the others were derived from the
    # largest room's expected time (sim/expected.py). None: all given (built in code). Left out
    # of == and the hash: it records how the values came, not what they are.
    deadlines_set: frozenset[str] | None = None
    # [deploy]: DeploySpec fields for `kvferry select` (sim/scenario_deploy.py); replay ignores
    # them. Left out of the hash (a dict has none), kept in ==.
    deploy: dict[str, Any] = msgspec.field(default_factory=dict)

    # The top-level keys; the other fields are tables, documented by their own Structs.
    DOC: ClassVar[dict[str, str]] = {
        "name": "Scenario name, shown in summaries and in saved fuzz failures.",
        "description": "One line that replay prints under the name.",
        "seed": "Seed of every random choice of the run (replay --seed overrides it).",
        "hooks": "Planted bugs, to test the checker itself.",
        "move_bytes": "Write, copy and verify every KV byte. false: timing only (every cost charged, "
        "no byte copied, the bytes check off), for deployment-sized models.",
    }

    def node_names(self) -> tuple[str, ...]:
        """Every rank of every server, prefill first (what fault events may name)."""
        t = self.topology
        return tuple(n for side in ("prefill", "decode") for nodes in t.server_nodes(side) for n in nodes)

    def _compared(self) -> tuple[Any, ...]:
        return tuple(getattr(self, n) for n in self.__struct_fields__ if n != "deadlines_set")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._compared() == other._compared()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(
            tuple(getattr(self, n) for n in self.__struct_fields__ if n not in ("deadlines_set", "deploy"))
        )


# The [fabric] keys (they map onto backends' FabricSpec, in other units): the parser accepts
# exactly these, and the docs list them with these meanings.
FABRIC_DOC: dict[str, str] = {
    "profile": "Named fabric whose numbers are the defaults of the other keys of this table (a profile "
    "fitted by `kvferry calibrate` into sim/deploy/profiles wins over a built-in one of the same name).",
    "bandwidth_gbps": "NIC bandwidth of a node, in GB/s.",
    "latency_ns": "One-way latency of an RDMA write.",
    "jitter_ns": "Extra delay per transfer, uniform in [0, this).",
    "post_cost_ns": "Fixed cost of posting one transfer.",
    "per_desc_ns": "Cost of posting one descriptor.",
    "read_desc_ns": "Cost of posting one descriptor of a READ (pull's reads, posted by decode), where it "
    "differs from a WRITE's (0: per_desc_ns).",
    "max_inflight": "Transfers a NIC keeps in flight before new posts queue.",
    "error_timeout_ns": "How long a write into a dead peer or over a down link takes to report ERR.",
    "completion_delay_ns": "From a write landing (or a transfer completing) to the runtime handling its "
    "notification (or DONE): the real runtime's next poll of NIXL.",
    "room_handle_ns": "Host work per TransferInfo or PullOffer handled, on the rank that receives it and "
    "plans the room's writes or reads (plan, descriptors, NIXL's post), holding its runtime thread "
    "(0: none).",
    "completion_handle_ns": "Host work per notification handled by its target and per DONE by its "
    "initiator, holding that rank's runtime thread (0: none).",
    "push_handle_ns": "The push flow's host work per registration, on top of room_handle_ns: each "
    "TransferInfo of a push room (decode's PUSH_REG) taken into the lease registry, on the prefill rank "
    "that receives it, holding its runtime thread (0: none).",
    "shared_desc_ns": "Cost of one descriptor on the GPU a rank posts through, shared by the ranks posting "
    "there at once (with one_gpu every rank; else each rank has its own); a post ends when its own "
    "posting and its turn there are through (0: no shared device).",
    "host_bandwidth_gbps": "Wire of a transfer between pinned host buffers, shared by its initiator's host "
    "transfers, in GB/s (0: the NIC bandwidth).",
    "host_shared_bandwidth_gbps": "Host-to-host wire of one host's memory, split among the active host "
    "transfers of that host's ranks (with one_gpu every rank; else a server's), in GB/s (0: none beside "
    "each initiator's own).",
    "control_latency_ns": "One-way latency of a control message.",
    "control_jitter_ns": "Extra delay per control message, uniform in [0, this).",
    "control_handle_ns": "How long a receiver's control thread holds each message: messages arriving "
    "together wait for each other (0: none).",
    "control_send_ns": "The sender's host work per control message, holding its runtime thread: messages "
    "to several peers or for several rooms leave one after another (0: none).",
    "staging_handle_ns": "The staged flows' host work per staging message (decode's grant of a StagingReq, "
    "prefill's StagingRsp and Watermark), held on the receiver's control thread (0: none).",
    "kernel_launch_ns": "Launch cost of one gather or scatter kernel, on the node's copy stream.",
    "kernel_submit_ns": "The runtime's host work per gather or scatter (submit and completion pickup), "
    "holding the rank's runtime thread that control messages also hold (0: none).",
    "kernel_busy_mean_ns": "Mean wait (exponential) for the model step in progress before a kernel runs "
    "(0: an idle GPU).",
    "gpu_copy_gbps": "GPU-to-GPU gather and scatter rate, in GB/s.",
    "pinned_copy_gbps": "Gather to and scatter from pinned host memory rate, in GB/s.",
    "prepped": "Prepared descriptor lists: dense runs merge into one descriptor, as NIXL's prepped "
    "transfers do.",
    "one_gpu": "Every rank on one GPU of one host, as `kvferry bench nixl` runs them: the nodes share "
    "that GPU's descriptor cost (shared_desc_ns) and that host's wire (host_shared_bandwidth_gbps). "
    "false (default): each rank its own GPU, a server's ranks one host.",
}


# The tables a file has but a run does not take as they are: [model] may name a preset, [fabric]
# leaves to its profile every key it does not give (None), [expect] lists violations.
class ModelTable(ModelSpec):
    preset: str = ""  # a known model instead of the keys above (sim/scenario_read.py)


class FabricTable(Table):
    profile: str = "h100-rdma"
    bandwidth_gbps: Annotated[float, Meta(ge=0.001)] | None = None
    latency_ns: Count | None = None
    jitter_ns: Count | None = None
    post_cost_ns: Count | None = None
    per_desc_ns: Count | None = None
    read_desc_ns: Count | None = None
    max_inflight: Positive | None = None
    error_timeout_ns: Count | None = None
    completion_delay_ns: Count | None = None
    room_handle_ns: Count | None = None
    completion_handle_ns: Count | None = None
    push_handle_ns: Count | None = None
    shared_desc_ns: Count | None = None
    host_bandwidth_gbps: Annotated[float, Meta(ge=0)] | None = None
    host_shared_bandwidth_gbps: Annotated[float, Meta(ge=0)] | None = None
    control_latency_ns: Count | None = None
    control_jitter_ns: Count | None = None
    control_handle_ns: Count | None = None
    control_send_ns: Count | None = None
    staging_handle_ns: Count | None = None
    kernel_launch_ns: Count | None = None
    kernel_submit_ns: Count | None = None
    kernel_busy_mean_ns: Count | None = None
    gpu_copy_gbps: Annotated[float, Meta(ge=0.001)] | None = None
    pinned_copy_gbps: Annotated[float, Meta(ge=0.001)] | None = None
    prepped: bool | None = None
    one_gpu: bool | None = None


class Expect(Table):
    violations: tuple[str, ...] = ()


class ScenarioFile(Shared, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A scenario file as msgspec decodes it: every table typed, every key checked on its own.
    Checks across keys, and the deadlines left out, are sim/scenario_read.py's."""

    model: ModelTable = msgspec.field(default_factory=ModelTable)
    fabric: FabricTable = msgspec.field(default_factory=FabricTable)
    expect: Expect = msgspec.field(default_factory=Expect)
    deploy: dict[str, Any] = msgspec.field(default_factory=dict)  # typed by sim/scenario_deploy.py


# Longest a write may take to finish or fail on the simulated fabric, beyond the NIC's error
# timeout: generous room for posts queued behind others (assumption).
WRITE_SLACK_NS = 10_000_000
REORDER_MAX_NS = 200 * US  # sim/faults.py's reorder delay bound


def pools(s: Scenario) -> tuple[tuple[PoolGeometry, ...], tuple[PoolGeometry, ...]]:
    g = s.model.geometry()
    t = s.topology
    pre = tuple(
        PoolGeometry(g, t.prefill_tp, r, t.prefill_page_size, t.prefill_pages, Layout(t.prefill_layout))
        for r in range(t.prefill_tp)
    )
    dec = tuple(
        PoolGeometry(g, t.decode_tp, r, t.decode_page_size, t.decode_pages, Layout(t.decode_layout))
        for r in range(t.decode_tp)
    )
    return pre, dec


def staging_sizes(s: Scenario) -> FlowSpec:
    """The sizes a run registers: those given, and for a flow the scenario names (or "mixed",
    or the policy under unequal TP) the ones left at 0 sized to ``auto_chunks`` of its largest
    chunk, so that naming a flow is enough to run it."""
    f = s.flows
    pre, dec = pools(s)
    w = s.workload
    chunk = max(
        [min(w.chunk_tokens or w.tokens_max, w.tokens_max)]
        + [c for room in w.explicit for c in (room.chunks or (room.tokens,))]
    )
    regions = pre[0].model.num_regions
    dec_chunk = regions * chunk * dec[0].token_bytes
    pre_chunk = regions * chunk * pre[0].token_bytes * max(1, len(dec) // len(pre))
    want_ring = f.flow in ("ring", "mixed") or (f.flow == "policy" and len(pre) != len(dec))
    want_pinned = f.flow in ("pinned", "mixed")
    n = f.auto_chunks

    def size(given: int, wanted: bool, per_chunk: int, chunks: int) -> int:
        return given if given or not wanted else per_chunk * chunks

    return replace(
        f,
        ring_bytes=size(f.ring_bytes, want_ring, dec_chunk, n),
        worker_buffer_bytes=size(f.worker_buffer_bytes, want_ring or want_pinned, pre_chunk, 1),
        pinned_bytes=size(f.pinned_bytes, want_pinned, dec_chunk, n),
        prefill_pinned_bytes=size(f.prefill_pinned_bytes, want_pinned, pre_chunk, n),
    )
