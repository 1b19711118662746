"""Scenario files: TOML describing topology, geometry, fabric, workload, faults, phases and checks.

``load(path)`` parses and validates; every error names the file and the offending field
(``[faults].ctrl_drop: expected a probability in [0, 1], got 1.5``). ``dump(scenario)`` writes a
scenario back as TOML, which is how a failing fuzz seed becomes a regression file.

Each table's keys are documented next to its dataclass (``DOC``, one line per key);
``schema_markdown()`` turns them, the types and the defaults the parser applies into
docs/scenarios.md: ``python -m kvferry.sim.scenario --markdown > docs/scenarios.md``.
"""

from __future__ import annotations

import difflib
import sys
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from kvferry.backends.simfabric.spec import PROFILES, ControlSpec, FabricSpec, KernelSpec, NicSpec
from kvferry.core.errors import GeometryError, KvferryError
from kvferry.core.flows import FLOW_NAMES
from kvferry.core.flows.registry import extra_names
from kvferry.core.geometry import PRESETS, Layout, ModelGeometry, PoolGeometry, validate_tp

US = 1_000


class ScenarioError(KvferryError, ValueError):
    """A scenario file that cannot be run; the message names the field."""


FAULT_EVENT_KINDS = ("crash", "link_down", "slow_link")
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


PUSH_MATCH_CHOICES = ("transfer_id", "request_id")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str = "sim-tiny"
    num_layers: int = 2
    num_kv_heads: int = 8
    head_dim: int = 8
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


@dataclass(frozen=True, slots=True)
class Topology:
    prefill_tp: int = 2
    decode_tp: int = 1
    prefill_page_size: int = 16
    decode_page_size: int = 16
    prefill_pages: int = 1024
    decode_pages: int = 1024
    prefill_layout: str = "sglang_nhd"
    decode_layout: str = "sglang_nhd"
    workers: int = 2  # transfer queues (one worker each) per prefill rank, as in SGLang PR 20680
    aux_rows: int = 256
    # Servers of each side on the one fabric, each with the TP above and its own memory; a router
    # sends each room to one of each (sim/instances.py).
    prefill_instances: int = 1
    decode_instances: int = 1

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


@dataclass(frozen=True, slots=True)
class RoomSpec:
    tokens: int
    arrival_us: int
    chunks: tuple[int, ...] = ()  # explicit chunk lengths; empty: split by workload.chunk_tokens
    prefill_delay_us: int = 0  # prefill compute starts this long after decode allocates
    # Decode allocates this long after prefill opened the room (decode short of memory): prefill
    # then asks for staging space before decode knows the room.
    decode_lag_us: int = 0
    # Decode allocates this many tokens (0: ``tokens``); a different count is a length mismatch
    # between the two servers, which must fail the room on both sides, never truncate or pad it.
    decode_tokens: int = 0

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


@dataclass(frozen=True, slots=True)
class Workload:
    rooms: int = 32
    tokens_min: int = 16
    tokens_max: int = 256
    chunk_tokens: int = 64
    arrival_mean_us: int = 100
    # Time to "compute" one chunk on prefill (forward pass), per token.
    compute_ns_per_token: int = 200
    decode_lag_us_max: int = 0  # each drawn room's decode_lag_us is uniform in [0, this]
    length_mismatch: float = 0.0  # share of drawn rooms whose decode allocates another length
    prefix_hit: float = 0.0  # share of rooms whose decode already holds a prefix (direct/pull/push)
    explicit: tuple[RoomSpec, ...] = ()

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


@dataclass(frozen=True, slots=True)
class FaultEvent:
    at_us: int
    kind: str
    node: str
    peer: str = ""
    duration_us: int = 0  # crash: restart after; link_down: up after; slow_link: restore after
    factor: float = 1.0  # slow_link bandwidth multiplier

    DOC: ClassVar[dict[str, str]] = {
        "at_us": "When it happens, in us from the start (ignored from `[phases].fault_window_us` on).",
        "kind": "What happens.",
        "node": "The node that crashes, or one end of the link (prefill0, ..., decode0, ...).",
        "peer": "The other end of the link (link_down and slow_link only).",
        "duration_us": "crash: restart after; link_down: up after; slow_link: restore after, in us "
        "(0: until the heal).",
        "factor": "slow_link: bandwidth multiplier, in (0, 1].",
    }


@dataclass(frozen=True, slots=True)
class Faults:
    swarm: bool = False  # draw a fault personality from the seed for everything unset below
    ctrl_drop: float = 0.0
    ctrl_dup: float = 0.0
    ctrl_reorder: float = 0.0
    ctrl_delay: float = 0.0
    ctrl_delay_max_us: int = 500
    xfer_err: float = 0.0
    abort: float = 0.0  # probability that the scheduler aborts a room, on a random side
    notif_drop: float = 0.0
    notif_delay: float = 0.0
    notif_delay_max_us: int = 500
    clock_skew_max_us: int = 0
    events: tuple[FaultEvent, ...] = ()

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


@dataclass(frozen=True, slots=True)
class FlowSpec:
    """Which flow moves each room (core.flows) and the staging memory each rank registers.

    ``flow``: "policy" (the default policy: direct for equal TP, ring for unequal TP when a ring
    is offered, else pinned, else direct), one flow for every room, or "mixed" (one drawn per room
    from those offered). Sizes in bytes; 0 = not offered. ``auto_size``: a flow named here gets
    room for ``auto_chunks`` of the workload's largest chunk wherever its size is left at 0.
    """

    flow: str = "policy"
    ring_bytes: int = 0
    pinned_bytes: int = 0
    worker_buffer_bytes: int = 0
    prefill_pinned_bytes: int = 0
    fallback_direct: bool = False
    auto_chunks: int = 4
    push_match: str = "transfer_id"

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


@dataclass(frozen=True, slots=True)
class TimeoutSpec:
    """The core's deadlines, scaled to simulated runs (the real defaults are tens of seconds)."""

    bootstrap_ns: int = 50_000_000
    waiting_ns: int = 50_000_000
    transfer_ns: int = 50_000_000
    heartbeat_interval_ns: int = 2_000_000
    heartbeat_timeout_ns: int = 10_000_000
    fence_ns: int = 200_000_000
    tombstone_ns: int = 250_000_000

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


@dataclass(frozen=True, slots=True)
class Phases:
    fault_window_us: int = 20_000  # faults injected until then; afterwards the network heals
    # After the heal (and the last arrival), every room must be terminal within this.
    liveness_us: int = 300_000

    DOC: ClassVar[dict[str, str]] = {
        "fault_window_us": "Faults are injected until then, in us; then the network heals (links up, "
        "full speed, crashed nodes restarted).",
        "liveness_us": "After the heal and the last arrival, every room must be terminal within this, in us.",
    }


@dataclass(frozen=True, slots=True)
class Checks:
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


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str = "unnamed"
    description: str = ""
    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)
    topology: Topology = field(default_factory=Topology)
    fabric_profile: str = "h100-rdma"
    fabric: FabricSpec = field(default_factory=FabricSpec)
    flows: FlowSpec = field(default_factory=FlowSpec)
    workload: Workload = field(default_factory=Workload)
    faults: Faults = field(default_factory=Faults)
    timeouts: TimeoutSpec = field(default_factory=TimeoutSpec)
    phases: Phases = field(default_factory=Phases)
    checks: Checks = field(default_factory=Checks)
    hooks: tuple[str, ...] = ()  # planted bugs (tests only)
    move_bytes: bool = True
    expect_violations: tuple[str, ...] = ()  # invariants a regression file is known to break
    # The [timeouts] keys and "liveness_us" the file set; the others were derived from the
    # largest room's expected time (sim/expected.py). None: all given (built in code).
    deadlines_set: frozenset[str] | None = field(default=None, compare=False)
    # [deploy]: DeploySpec fields for `kvferry select` (sim/scenario_deploy.py); replay ignores
    # them. Left out of the hash (a dict has none), kept in ==.
    deploy: dict[str, Any] = field(default_factory=dict, hash=False)

    # The top-level keys; the other fields are tables, documented by their own dataclasses.
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


# ---------------------------------------------------------------------------------------- parsing


def _at(where: str, key: str) -> str:
    """One error path format: ``FILE: key`` at the top level, ``FILE: [table].key`` in a table
    (``where`` is ``FILE`` or ``FILE: [table]``, or deeper: ``FILE: [workload].room[0]``)."""
    return f"{where}.{key}" if ": [" in where else f"{where}: {key}"


class _Reader:
    """Pulls typed fields out of one TOML table, naming the field in every error."""

    def __init__(self, where: str, table: Any, known: tuple[str, ...]) -> None:
        if not isinstance(table, dict):
            raise ScenarioError(f"{where}: expected a table, got {type(table).__name__}")
        self.where = where
        self.table = table
        self.known = known
        for key in table:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                extra = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(known)})"
                raise ScenarioError(f"{_at(where, key)}: unknown field{extra}")

    def _err(self, key: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{_at(self.where, key)}: {msg}")

    def int(self, key: str, default: int, lo: int | None = 0, hi: int | None = None) -> int:
        v = self.table.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self._err(key, f"expected an integer, got {v!r}")
        if lo is not None and v < lo:
            raise self._err(key, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise self._err(key, f"must be <= {hi}, got {v}")
        return v

    def float(self, key: str, default: float, lo: float = 0.0, hi: float | None = None) -> float:
        v = self.table.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self._err(key, f"expected a number, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise self._err(key, f"expected a number in {rng}, got {v}")
        return float(v)

    def prob(self, key: str, default: float) -> float:
        v = self.table.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
            raise self._err(key, f"expected a probability in [0, 1], got {v!r}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.table.get(key, default)
        if not isinstance(v, bool):
            raise self._err(key, f"expected true or false, got {v!r}")
        return v

    def str(self, key: str, default: str, choices: tuple[str, ...] | None = None) -> str:
        v = self.table.get(key, default)
        if not isinstance(v, str):
            raise self._err(key, f"expected a string, got {v!r}")
        if choices is not None and v not in choices:
            raise self._err(key, f"expected one of {', '.join(choices)}, got {v!r}")
        return v

    def list(self, key: str) -> list[Any]:
        v = self.table.get(key, [])
        if not isinstance(v, list):
            # `room = 24` is a plain value under an array's name: most likely a near key misspelt.
            near = difflib.get_close_matches(key, [k for k in self.known if k != key], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise self._err(key, f"expected an array, got {v!r}{hint}")
        return v


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _model(r: _Reader) -> ModelSpec:
    if "preset" in r.table:
        name = r.str("preset", "")
        extra = [k for k in r.table if k != "preset"]
        if extra:
            raise ScenarioError(f"{r.where}.{extra[0]}: give either preset or explicit fields, not both")
        try:
            g = ModelGeometry.preset(name)
        except GeometryError as e:
            raise ScenarioError(f"{r.where}.preset: {e}") from None
        return ModelSpec(g.name, g.num_layers, g.num_kv_heads, g.head_dim, g.dtype.value, g.is_mla)
    d = ModelSpec()
    spec = ModelSpec(
        name=r.str("name", d.name),
        num_layers=r.int("num_layers", d.num_layers, lo=1),
        num_kv_heads=r.int("num_kv_heads", d.num_kv_heads, lo=1),
        head_dim=r.int("head_dim", d.head_dim, lo=1),
        dtype=r.str("dtype", d.dtype),
        is_mla=r.bool("is_mla", d.is_mla),
    )
    try:
        g = spec.geometry()
    except GeometryError as e:
        raise ScenarioError(f"{r.where}: {e}") from None
    if spec.name in PRESETS and PRESETS[spec.name].same_kv_shape(g) is not None:
        # A preset's name alone used to run the tiny default geometry under that name (the
        # preset's own fields written out, as dump() does, are fine).
        raise ScenarioError(
            f"{_at(r.where, 'name')}: {spec.name!r} is a preset: write preset = {spec.name!r} (a name "
            "alone does not set the geometry; give another name for a custom model)"
        )
    return spec


def _topology(r: _Reader, model: ModelSpec) -> Topology:
    d = Topology()
    layouts = tuple(x.value for x in Layout)
    t = Topology(
        prefill_tp=r.int("prefill_tp", d.prefill_tp, lo=1, hi=64),
        decode_tp=r.int("decode_tp", d.decode_tp, lo=1, hi=64),
        prefill_page_size=r.int("prefill_page_size", d.prefill_page_size, lo=1, hi=1024),
        decode_page_size=r.int("decode_page_size", d.decode_page_size, lo=1, hi=1024),
        prefill_pages=r.int("prefill_pages", d.prefill_pages, lo=1, hi=1 << 20),
        decode_pages=r.int("decode_pages", d.decode_pages, lo=1, hi=1 << 20),
        prefill_layout=r.str("prefill_layout", d.prefill_layout, layouts),
        decode_layout=r.str("decode_layout", d.decode_layout, layouts),
        workers=r.int("workers", d.workers, lo=1, hi=64),
        aux_rows=r.int("aux_rows", d.aux_rows, lo=1, hi=1 << 16),
        prefill_instances=r.int("prefill_instances", d.prefill_instances, lo=1, hi=MAX_INSTANCES),
        decode_instances=r.int("decode_instances", d.decode_instances, lo=1, hi=MAX_INSTANCES),
    )
    g = model.geometry()
    for key in ("prefill_tp", "decode_tp"):
        try:
            validate_tp(g, getattr(t, key))
        except GeometryError as e:
            raise ScenarioError(f"{r.where}.{key}: {e}") from None
    return t


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
    "max_inflight": "Transfers a NIC keeps in flight before new posts queue.",
    "error_timeout_ns": "How long a write into a dead peer or over a down link takes to report ERR.",
    "completion_delay_ns": "From a write landing (or a transfer completing) to the runtime handling its "
    "notification (or DONE): the real runtime's next poll of NIXL.",
    "control_latency_ns": "One-way latency of a control message.",
    "control_jitter_ns": "Extra delay per control message, uniform in [0, this).",
    "kernel_launch_ns": "Host cost of one gather or scatter kernel call.",
    "kernel_busy_mean_ns": "Mean wait (exponential) for the model step in progress before a kernel runs "
    "(0: an idle GPU).",
    "gpu_copy_gbps": "GPU-to-GPU gather and scatter rate, in GB/s.",
    "pinned_copy_gbps": "Gather to and scatter from pinned host memory rate, in GB/s.",
    "prepped": "Prepared descriptor lists: dense runs merge into one descriptor, as NIXL's prepped "
    "transfers do.",
}


def fabric_profiles() -> tuple[str, ...]:
    """Names ``[fabric] profile`` accepts: the built-in fabrics, then the fitted profiles
    (``kvferry calibrate``, sim/deploy/profiles) that are not also built in."""
    from kvferry.sim.deploy import hardware

    return tuple(PROFILES) + tuple(n for n in hardware.names("fabric") if n not in PROFILES)


def profile_fabric(name: str) -> FabricSpec:
    """The fabric a profile name gives: a fitted profile's numbers over the built-in fabric of the
    same name (or h100-rdma's), so a fitted profile wins over a built-in one of its name."""
    from kvferry.sim.deploy import hardware

    base = PROFILES.get(name, FabricSpec())
    if name not in hardware.names("fabric"):
        return base
    fit = hardware.fitted(name)
    k, n, c = base.kernel, base.nic, base.control
    return replace(
        base,
        nic=replace(
            base.nic,
            bandwidth_bps=int(fit.bandwidth_gbps * 1e9),
            latency_ns=round(fit.latency_us * 1000),
            post_cost_ns=round(fit.post_cost_us * 1000),
            per_desc_ns=round(fit.per_desc_us * 1000),
            completion_delay_ns=n.completion_delay_ns
            if fit.completion_delay_us is None
            else round(fit.completion_delay_us * 1000),
        ),
        control=c
        if fit.control_latency_us is None
        else replace(c, latency_ns=round(fit.control_latency_us * 1000)),
        kernel=replace(
            k,
            launch_ns=k.launch_ns if fit.kernel_launch_us is None else round(fit.kernel_launch_us * 1000),
            gpu_bps=k.gpu_bps if fit.copy_gpu_gbps is None else int(fit.copy_gpu_gbps * 1e9),
            pinned_bps=k.pinned_bps if fit.copy_pinned_gbps is None else int(fit.copy_pinned_gbps * 1e9),
        ),
    )


def _fabric(r: _Reader) -> tuple[str, FabricSpec]:
    profile = r.str("profile", "h100-rdma", fabric_profiles())
    base = profile_fabric(profile)
    n, c = base.nic, base.control
    nic = NicSpec(
        bandwidth_bps=int(r.float("bandwidth_gbps", n.bandwidth_bps / 1e9, lo=0.001) * 1e9),
        latency_ns=r.int("latency_ns", n.latency_ns),
        jitter_ns=r.int("jitter_ns", n.jitter_ns),
        post_cost_ns=r.int("post_cost_ns", n.post_cost_ns),
        per_desc_ns=r.int("per_desc_ns", n.per_desc_ns),
        max_inflight=r.int("max_inflight", n.max_inflight, lo=1),
        error_timeout_ns=r.int("error_timeout_ns", n.error_timeout_ns),
        completion_delay_ns=r.int("completion_delay_ns", n.completion_delay_ns),
    )
    control = ControlSpec(
        latency_ns=r.int("control_latency_ns", c.latency_ns),
        jitter_ns=r.int("control_jitter_ns", c.jitter_ns),
    )
    k = base.kernel
    kernel = KernelSpec(
        launch_ns=r.int("kernel_launch_ns", k.launch_ns),
        gpu_bps=int(r.float("gpu_copy_gbps", k.gpu_bps / 1e9, lo=0.001) * 1e9),
        pinned_bps=int(r.float("pinned_copy_gbps", k.pinned_bps / 1e9, lo=0.001) * 1e9),
        busy_mean_ns=r.int("kernel_busy_mean_ns", k.busy_mean_ns),
    )
    return profile, FabricSpec(
        nic=nic, control=control, kernel=kernel, prepped=r.bool("prepped", base.prepped)
    )


def _flows(r: _Reader) -> FlowSpec:
    d = FlowSpec()
    sizes = {
        n: r.int(n, getattr(d, n), hi=1 << 40)
        for n in ("ring_bytes", "pinned_bytes", "worker_buffer_bytes", "prefill_pinned_bytes")
    }
    return FlowSpec(
        flow=r.str("flow", d.flow, flow_choices()),
        fallback_direct=r.bool("fallback_direct", d.fallback_direct),
        auto_chunks=r.int("auto_chunks", d.auto_chunks, lo=1, hi=1024),
        push_match=r.str("push_match", d.push_match, PUSH_MATCH_CHOICES),
        **sizes,
    )


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


def _workload(r: _Reader, topo: Topology) -> Workload:
    d = Workload()
    rooms: list[RoomSpec] = []
    for i, raw in enumerate(r.list("room")):
        rr = _Reader(f"{r.where}.room[{i}]", raw, _names(RoomSpec))
        tokens = rr.int("tokens", 0, lo=1)
        chunks = rr.list("chunks")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in chunks):
            raise ScenarioError(f"{rr.where}.chunks: expected positive integers, got {chunks!r}")
        if chunks and sum(chunks) != tokens:
            raise ScenarioError(f"{rr.where}.chunks: lengths sum to {sum(chunks)}, room has {tokens} tokens")
        rooms.append(
            RoomSpec(
                tokens,
                rr.int("arrival_us", 0),
                tuple(chunks),
                rr.int("prefill_delay_us", 0),
                rr.int("decode_lag_us", 0),
                rr.int("decode_tokens", 0),
            )
        )
    w = Workload(
        rooms=r.int("rooms", len(rooms) if rooms else d.rooms, lo=0, hi=1_000_000),
        tokens_min=r.int("tokens_min", d.tokens_min, lo=1),
        tokens_max=r.int("tokens_max", d.tokens_max, lo=1),
        chunk_tokens=r.int("chunk_tokens", d.chunk_tokens, lo=0),
        arrival_mean_us=r.int("arrival_mean_us", d.arrival_mean_us),
        compute_ns_per_token=r.int("compute_ns_per_token", d.compute_ns_per_token),
        decode_lag_us_max=r.int("decode_lag_us_max", d.decode_lag_us_max, hi=10_000_000),
        length_mismatch=r.prob("length_mismatch", d.length_mismatch),
        prefix_hit=r.float("prefix_hit", d.prefix_hit, hi=1.0),
        explicit=tuple(rooms),
    )
    if rooms and w.rooms != len(rooms):
        raise ScenarioError(f"{r.where}.rooms: {w.rooms} but {len(rooms)} [[workload.room]] entries")
    if w.tokens_min > w.tokens_max:
        raise ScenarioError(f"{r.where}.tokens_min: {w.tokens_min} > tokens_max {w.tokens_max}")
    for side in ("prefill", "decode"):
        # A drawn mismatched room's decode length is capped at the pool (sim/world.py).
        longest = max([x.dec_tokens if side == "decode" else x.tokens for x in rooms] or [w.tokens_max])
        cap = getattr(topo, f"{side}_pages") * getattr(topo, f"{side}_page_size")
        if longest > cap:
            raise ScenarioError(
                f"{r.where}: a room of {longest} tokens does not fit the {side} pool ({cap} tokens)"
            )
    return w


def _node(r: _Reader, key: str, nodes: tuple[str, ...]) -> str:
    """A node name of the topology; with many, the error shows the pattern, not every name."""
    if len(nodes) <= 12:
        return r.str(key, "", nodes)
    v = r.str(key, "")
    if v not in nodes:
        named = [n for n in nodes if n]
        raise r._err(
            key,
            f"expected a node of the topology ({named[0]} ... {named[-1]}: server, then rank), got {v!r}",
        )
    return v


def _faults(r: _Reader, nodes: tuple[str, ...]) -> Faults:
    d = Faults()
    events: list[FaultEvent] = []
    for i, raw in enumerate(r.list("event")):
        er = _Reader(f"{r.where}.event[{i}]", raw, _names(FaultEvent))
        kind = er.str("kind", "", FAULT_EVENT_KINDS)
        node = _node(er, "node", nodes)
        peer = _node(er, "peer", ("", *nodes))
        if kind != "crash" and not peer:
            raise ScenarioError(f"{er.where}.peer: a {kind} event needs the other end of the link")
        if peer == node:
            raise ScenarioError(f"{er.where}.peer: a link joins two different nodes")
        events.append(
            FaultEvent(
                at_us=er.int("at_us", 0),
                kind=kind,
                node=node,
                peer=peer,
                duration_us=er.int("duration_us", 0),
                factor=er.float("factor", 1.0, lo=1e-6, hi=1.0),
            )
        )
    return Faults(
        swarm=r.bool("swarm", d.swarm),
        ctrl_drop=r.prob("ctrl_drop", d.ctrl_drop),
        ctrl_dup=r.prob("ctrl_dup", d.ctrl_dup),
        ctrl_reorder=r.prob("ctrl_reorder", d.ctrl_reorder),
        ctrl_delay=r.prob("ctrl_delay", d.ctrl_delay),
        ctrl_delay_max_us=r.int("ctrl_delay_max_us", d.ctrl_delay_max_us),
        xfer_err=r.prob("xfer_err", d.xfer_err),
        abort=r.prob("abort", d.abort),
        notif_drop=r.prob("notif_drop", d.notif_drop),
        notif_delay=r.prob("notif_delay", d.notif_delay),
        notif_delay_max_us=r.int("notif_delay_max_us", d.notif_delay_max_us),
        clock_skew_max_us=r.int("clock_skew_max_us", d.clock_skew_max_us),
        events=tuple(sorted(events, key=lambda e: (e.at_us, e.kind, e.node, e.peer))),
    )


# Longest a write may take to finish or fail on the simulated fabric, beyond the NIC's error
# timeout: generous room for posts queued behind others (assumption).
WRITE_SLACK_NS = 10_000_000
REORDER_MAX_NS = 200 * US  # sim/faults.py's reorder delay bound


def _check_timeouts(where: str, s: Scenario) -> None:
    """Refuse deadlines the core itself calls unsafe for this fabric (a fence shorter than a
    peer may still write would let the checker blame the core for the scenario's settings), or
    shorter than the scenario's own largest room takes to move."""
    from kvferry.core.deadlines import Timeouts
    from kvferry.sim.expected import worst

    fabric, t = s.fabric, s.timeouts
    max_msg = (
        fabric.control.latency_ns
        + fabric.control.jitter_ns
        + s.faults.ctrl_delay_max_us * US
        + REORDER_MAX_NS
    )
    est = worst(s)
    max_write = fabric.nic.error_timeout_ns + WRITE_SLACK_NS + est.total_ns
    probs = Timeouts(**{n: getattr(t, n) for n in _names(TimeoutSpec)}).problems(
        max_msg, max_write, expected_transfer_ns=est.total_ns, transfer_what=est.describe()
    )
    if probs:
        raise ScenarioError(f"{where}: {'; '.join(probs)}")


def with_derived_deadlines(s: Scenario) -> Scenario:
    """``s`` with the deadlines it does not set derived for its flows (sim/expected.py)."""
    if s.deadlines_set is None:
        return s
    from kvferry.sim.expected import derive

    given = s.deadlines_set
    out = derive(
        s,
        frozenset(n for n in given if n != "liveness_us"),
        frozenset(n for n in given if n == "liveness_us"),
    )
    return replace(out, deadlines_set=given)


def parse(data: dict[str, Any], where: str = "scenario") -> Scenario:
    top = _Reader(
        where,
        data,
        (
            "name",
            "description",
            "seed",
            "model",
            "topology",
            "fabric",
            "flows",
            "workload",
            "faults",
            "timeouts",
            "phases",
            "checks",
            "hooks",
            "move_bytes",
            "expect",
            "deploy",
        ),
    )
    model = _model(_Reader(f"{where}: [model]", data.get("model", {}), (*_names(ModelSpec), "preset")))
    topo = _topology(_Reader(f"{where}: [topology]", data.get("topology", {}), _names(Topology)), model)
    profile, fabric = _fabric(_Reader(f"{where}: [fabric]", data.get("fabric", {}), tuple(FABRIC_DOC)))
    flows = _flows(_Reader(f"{where}: [flows]", data.get("flows", {}), _names(FlowSpec)))
    work = _workload(
        _Reader(
            f"{where}: [workload]",
            data.get("workload", {}),
            (*(n for n in _names(Workload) if n != "explicit"), "room"),
        ),
        topo,
    )
    from kvferry.sim import scenario_deploy  # it builds on this module

    deploy = scenario_deploy.read(
        where, data.get("deploy", {}), Scenario(model=model, topology=topo, workload=work)
    )
    base = Scenario(topology=topo)
    faults = _faults(
        _Reader(
            f"{where}: [faults]",
            data.get("faults", {}),
            (*(n for n in _names(Faults) if n != "events"), "event"),
        ),
        base.node_names(),
    )
    tr = _Reader(f"{where}: [timeouts]", data.get("timeouts", {}), _names(TimeoutSpec))
    td = TimeoutSpec()
    timeouts = TimeoutSpec(**{n: tr.int(n, getattr(td, n), lo=1) for n in _names(TimeoutSpec)})
    pr = _Reader(f"{where}: [phases]", data.get("phases", {}), _names(Phases))
    phases = Phases(
        pr.int("fault_window_us", Phases().fault_window_us), pr.int("liveness_us", Phases().liveness_us, lo=1)
    )
    cr = _Reader(f"{where}: [checks]", data.get("checks", {}), _names(Checks))
    checks = Checks(**{n: cr.bool(n, True) for n in _names(Checks)})
    hooks = top.list("hooks")
    for h in hooks:
        if h not in HOOKS:
            raise ScenarioError(
                f"{_at(where, 'hooks')}: unknown planted bug {h!r} (known: {', '.join(HOOKS)})"
            )
    er = _Reader(f"{where}: [expect]", data.get("expect", {}), ("violations",))
    expect = er.list("violations")
    given = frozenset(n for n in _names(TimeoutSpec) if n in tr.table) | frozenset(
        n for n in ("liveness_us",) if n in pr.table
    )
    out = Scenario(
        name=top.str("name", "unnamed"),
        description=top.str("description", ""),
        seed=top.int("seed", 0),
        model=model,
        topology=topo,
        fabric_profile=profile,
        fabric=fabric,
        flows=flows,
        workload=work,
        faults=faults,
        timeouts=timeouts,
        phases=phases,
        checks=checks,
        hooks=tuple(hooks),
        move_bytes=top.bool("move_bytes", True),
        expect_violations=tuple(str(x) for x in expect),
        deadlines_set=given,
        deploy=deploy,
    )
    out = with_derived_deadlines(out)
    _check_timeouts(f"{where}: [timeouts]", out)
    return out


def load(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ScenarioError(f"{p}: is a directory, not a scenario file") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"{p}: not a text (UTF-8) file, so not a TOML scenario") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise ScenarioError(f"{p}: cannot read: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{p}: not valid TOML: {e}") from None
    return parse(data, where=str(p))


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


# ---------------------------------------------------------------------------------------- writing


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _table(name: str, values: dict[str, Any]) -> list[str]:
    lines = [f"[{name}]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return [*lines, ""]


def _fabric_values(s: Scenario) -> dict[str, Any]:
    """The [fabric] table of a scenario, in the file's keys and units."""
    n, c, k = s.fabric.nic, s.fabric.control, s.fabric.kernel
    return {
        "profile": s.fabric_profile,
        "bandwidth_gbps": n.bandwidth_bps / 1e9,
        "latency_ns": n.latency_ns,
        "jitter_ns": n.jitter_ns,
        "post_cost_ns": n.post_cost_ns,
        "per_desc_ns": n.per_desc_ns,
        "max_inflight": n.max_inflight,
        "error_timeout_ns": n.error_timeout_ns,
        "completion_delay_ns": n.completion_delay_ns,
        "control_latency_ns": c.latency_ns,
        "control_jitter_ns": c.jitter_ns,
        "kernel_launch_ns": k.launch_ns,
        "kernel_busy_mean_ns": k.busy_mean_ns,
        "gpu_copy_gbps": k.gpu_bps / 1e9,
        "pinned_copy_gbps": k.pinned_bps / 1e9,
        "prepped": s.fabric.prepped,
    }


def dump(s: Scenario) -> str:
    """The scenario as TOML; ``parse(tomllib.loads(dump(s)))`` gives ``s`` back."""
    out = [f"name = {_toml_value(s.name)}", f"description = {_toml_value(s.description)}", f"seed = {s.seed}"]
    if s.hooks:
        out.append(f"hooks = {_toml_value(s.hooks)}")
    if not s.move_bytes:
        out.append("move_bytes = false")
    out.append("")
    m = s.model
    out += _table("model", {f.name: getattr(m, f.name) for f in fields(ModelSpec)})
    out += _table("topology", {f.name: getattr(s.topology, f.name) for f in fields(Topology)})
    out += _table("fabric", _fabric_values(s))
    out += _table("flows", {f.name: getattr(s.flows, f.name) for f in fields(FlowSpec)})
    w = s.workload
    out += _table("workload", {f.name: getattr(w, f.name) for f in fields(Workload) if f.name != "explicit"})
    for room in w.explicit:
        out += _table(
            "[workload.room]",
            {
                "tokens": room.tokens,
                "arrival_us": room.arrival_us,
                "chunks": room.chunks,
                "prefill_delay_us": room.prefill_delay_us,
                "decode_lag_us": room.decode_lag_us,
                "decode_tokens": room.decode_tokens,
            },
        )
    f = s.faults
    out += _table("faults", {x.name: getattr(f, x.name) for x in fields(Faults) if x.name != "events"})
    for ev in f.events:
        out += _table("[faults.event]", {x.name: getattr(ev, x.name) for x in fields(FaultEvent)})
    out += _table("timeouts", {x.name: getattr(s.timeouts, x.name) for x in fields(TimeoutSpec)})
    out += _table("phases", {x.name: getattr(s.phases, x.name) for x in fields(Phases)})
    out += _table("checks", {x.name: getattr(s.checks, x.name) for x in fields(Checks)})
    if s.deploy:  # written only when set, so a file without it dumps as before
        out += _table("deploy", s.deploy)
    if s.expect_violations:
        out += _table("expect", {"violations": s.expect_violations})
    return "\n".join(out)


def with_flow(s: Scenario, flow: str) -> Scenario:
    """The scenario with every room on ``flow`` (sizes the flow needs are auto-sized)."""
    choices = flow_choices()
    if flow not in choices:
        raise ScenarioError(f"--flow: expected one of {', '.join(choices)}, got {flow!r}")
    out = replace(s, flows=replace(s.flows, flow=flow))
    if s.deadlines_set is None:
        return out
    # Re-derive from the defaults for the new flow (a slower flow needs longer deadlines).
    given = s.deadlines_set
    td, pd = TimeoutSpec(), Phases()
    base = replace(
        out,
        timeouts=TimeoutSpec(
            **{n: getattr(s.timeouts if n in given else td, n) for n in _names(TimeoutSpec)}
        ),
        phases=replace(
            s.phases, liveness_us=s.phases.liveness_us if "liveness_us" in given else pd.liveness_us
        ),
    )
    derived = with_derived_deadlines(base)
    _check_timeouts(f"[timeouts] under --flow {flow}", derived)
    return derived


def with_overrides(s: Scenario, **kw: Any) -> Scenario:
    return replace(s, **kw)


# ---------------------------------------------------------------------------------------- documentation


@dataclass(frozen=True, slots=True)
class KeyDoc:
    key: str
    type: str
    default: str  # as TOML; or "required", or "none" (no value: leaving the key out means something else)
    meaning: str


@dataclass(frozen=True, slots=True)
class TableDoc:
    """One table of the format: its header, where it sits in the TOML document, and its keys."""

    header: str  # "" for the top level
    path: tuple[str, ...]  # ("workload", "room") for [[workload.room]]
    intro: str
    keys: tuple[KeyDoc, ...]


_TOML_TYPES = {
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "str": "string",
    "tuple[int, ...]": "array of integers",
    "tuple[str, ...]": "array of strings",
}
# Scenario fields that are tables, not top-level keys (each documented by its own dataclass).
_TABLE_FIELDS = frozenset(
    (
        "model",
        "topology",
        "fabric_profile",
        "fabric",
        "flows",
        "workload",
        "faults",
        "timeouts",
        "phases",
        "checks",
        "expect_violations",
        "deadlines_set",
        "deploy",
    )
)
# Fields read from an array of tables under another name: [[workload.room]], [[faults.event]].
_ARRAY_KEYS = {"explicit": "room", "events": "event"}
# The smallest valid entry of each array of tables: its keys are the required ones, and parsing it
# gives the defaults of the others.
_MINIMAL_ENTRIES: dict[str, Any] = {
    "workload": {"room": [{"tokens": 16}]},
    "faults": {"event": [{"kind": "crash", "node": "prefill0"}]},
}


def _choices() -> dict[tuple[str, str], tuple[str, ...]]:
    from kvferry.core.geometry import PRESETS, DType

    layouts = tuple(x.value for x in Layout)
    return {
        ("", "hooks"): HOOKS,
        ("[model]", "dtype"): tuple(x.value for x in DType),
        ("[model]", "preset"): tuple(sorted(PRESETS)),
        ("[topology]", "prefill_layout"): layouts,
        ("[topology]", "decode_layout"): layouts,
        ("[fabric]", "profile"): fabric_profiles(),
        ("[flows]", "flow"): FLOW_CHOICES,
        ("[flows]", "push_match"): PUSH_MATCH_CHOICES,
        ("[[faults.event]]", "kind"): FAULT_EVENT_KINDS,
    }


def _doc_default(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:_}"  # TOML reads 50_000_000 too, and a reader counts the zeros at a glance
    return _toml_value(v)


def _value_type(v: Any) -> str:
    return _TOML_TYPES[type(v).__name__]


def _field_keys(
    cls: type, values: Any, skip: tuple[str, ...] = (), required: tuple[str, ...] = ()
) -> list[KeyDoc]:
    doc: dict[str, str] = cls.DOC  # type: ignore[attr-defined]
    names = [f.name for f in fields(cls) if f.name not in skip]
    missing, extra = set(names) - set(doc), set(doc) - {f.name for f in fields(cls)}
    if missing or extra:
        raise ValueError(f"{cls.__name__}.DOC: undocumented {sorted(missing)}, not fields {sorted(extra)}")
    types = {f.name: f.type for f in fields(cls)}
    return [
        KeyDoc(_ARRAY_KEYS[n], "array of tables", "[]", doc[n])
        if n in _ARRAY_KEYS
        else KeyDoc(
            n,
            _TOML_TYPES[str(types[n])],
            "required" if n in required else _doc_default(getattr(values, n)),
            doc[n],
        )
        for n in names
    ]


def _top_keys(s: Scenario) -> list[KeyDoc]:
    stray = {f.name for f in fields(Scenario)} - set(Scenario.DOC) - _TABLE_FIELDS
    if stray:
        raise ValueError(f"Scenario: fields neither in Scenario.DOC nor tables: {sorted(stray)}")
    return _field_keys(Scenario, s, skip=tuple(_TABLE_FIELDS))


def schema_tables() -> list[TableDoc]:
    """Every table of the scenario format, its keys, their types, and the defaults the parser
    applies (read off ``parse`` itself, so they are the ones a run gets)."""
    s = parse({})
    entries = parse(_MINIMAL_ENTRIES)
    room, event = entries.workload.explicit[0], entries.faults.events[0]
    fabric = _fabric_values(s)
    return [
        TableDoc("", (), "Keys outside any table.", tuple(_top_keys(s))),
        TableDoc(
            "[model]",
            ("model",),
            "The model whose KV cache moves. Either `preset` alone or the explicit keys.",
            (
                *_field_keys(ModelSpec, s.model),
                KeyDoc("preset", "string", "none", "A known model's geometry instead of the keys above."),
            ),
        ),
        TableDoc(
            "[topology]",
            ("topology",),
            "Ranks, pages and workers of each side.",
            tuple(_field_keys(Topology, s.topology)),
        ),
        TableDoc(
            "[fabric]",
            ("fabric",),
            "The simulated network and copy kernels. Defaults shown are the `h100-rdma` profile's; "
            "another `profile` changes them.",
            tuple(
                KeyDoc(k, _value_type(fabric[k]), _doc_default(fabric[k]), meaning)
                for k, meaning in FABRIC_DOC.items()
            ),
        ),
        TableDoc(
            "[flows]",
            ("flows",),
            "Which flow moves each room, and the staging memory each rank registers. Sizes in bytes.",
            tuple(_field_keys(FlowSpec, s.flows)),
        ),
        TableDoc(
            "[workload]",
            ("workload",),
            "The rooms of the run: drawn at random, or listed one by one in `[[workload.room]]`.",
            tuple(_field_keys(Workload, s.workload)),
        ),
        TableDoc(
            "[[workload.room]]",
            ("workload", "room"),
            "One room, given explicitly; repeat the table for each room.",
            tuple(_field_keys(RoomSpec, room, required=tuple(_MINIMAL_ENTRIES["workload"]["room"][0]))),
        ),
        TableDoc(
            "[faults]",
            ("faults",),
            "Random faults, each a probability per message or write, injected until "
            "`[phases].fault_window_us`.",
            tuple(_field_keys(Faults, s.faults)),
        ),
        TableDoc(
            "[[faults.event]]",
            ("faults", "event"),
            "One timed fault; repeat the table for each.",
            tuple(_field_keys(FaultEvent, event, required=tuple(_MINIMAL_ENTRIES["faults"]["event"][0]))),
        ),
        TableDoc(
            "[timeouts]",
            ("timeouts",),
            "The core's deadlines, in ns, scaled down for simulated runs. A key left out whose default "
            "is too short for the scenario's largest room (4x its expected transfer: posting, wire, "
            "kernels, compute on this fabric and flow; sim/expected.py) is derived from it, and so are "
            "the fence, the tombstone and `[phases].liveness_us` then. A file whose deadlines the core "
            "calls unsafe for its fabric (a fence shorter than a peer may still write), or shorter than "
            "its largest room's transfer, is refused.",
            tuple(_field_keys(TimeoutSpec, s.timeouts)),
        ),
        TableDoc(
            "[phases]",
            ("phases",),
            "The fault window and the liveness deadline.",
            tuple(_field_keys(Phases, s.phases)),
        ),
        TableDoc(
            "[checks]",
            ("checks",),
            "Invariants checked; each can be turned off.",
            tuple(_field_keys(Checks, s.checks)),
        ),
        TableDoc(
            "[expect]",
            ("expect",),
            "For regression files of planted bugs.",
            (
                KeyDoc(
                    "violations",
                    "array of strings",
                    "[]",
                    "Invariants this file is known to break: replay passes only if exactly these break.",
                ),
            ),
        ),
        _deploy_doc(),
    ]


def _deploy_doc() -> TableDoc:
    """[deploy]: its keys are DeploySpec's (sim/scenario_deploy.py), so is their list here."""
    from kvferry.sim import scenario_deploy as sd
    from kvferry.sim.deploy.spec import DeploySpec

    known, spec = sd.keys(), DeploySpec()
    stale = set(sd.DOC) - set(known)
    if stale:
        raise ValueError(f"scenario_deploy.DOC: not [deploy] keys {sorted(stale)}")
    refused = ", ".join(f"`{k}`" for k in sd.REFUSED)
    intro = (
        "Deployment knobs for `kvferry select --scenario FILE` (replay ignores this table): the fields "
        "of `DeploySpec` (sim/deploy/spec.py), less those the file sets elsewhere or select sets itself, "
        f"which are refused here with where they belong: {refused}. A key given here wins over select's "
        "option of the same name, whether given or left at its default (as the file's model and TP "
        "already do); a key left out takes the option, or `DeploySpec`'s default where select has none. "
        "Types are strict: an integer is a number, but `true` is not an integer. The table is checked "
        "as one deployment when the file loads (the file's model, TP, page sizes, workers and chunk "
        "size, these keys, `DeploySpec`'s defaults for the rest), so it needs a `[model] preset`.\n\n"
        '```toml\n[model]\npreset = "qwen3-8b"\n\n[deploy]\ngpu = "h200"\n'
        'page_allocator = "lowest-first"\nmax_batch = 128\n```'
    )
    rows = tuple(
        KeyDoc(
            k,
            _TOML_TYPES[kind.__name__],
            "none",  # left out, select's option decides
            f"{sd.DOC.get(k, 'See `DeploySpec` in sim/deploy/spec.py.')} "
            f"Select's default: `{_doc_default(getattr(spec, k))}`.",
        )
        for k, kind in known.items()
    )
    return TableDoc("[deploy]", ("deploy",), intro, rows)


_PREAMBLE = """\
# Scenario files

<!-- Generated from sim/scenario.py: edit the DOC dicts there, then run
     python -m kvferry.sim.scenario --markdown > docs/scenarios.md
     (tests/test_scenario_docs.py fails while this file differs from the generated text). -->

A scenario is one TOML file (`kvferry replay FILE` runs it; `scenarios/` holds examples). Every table
and every key is optional unless marked required; a key left out takes the default shown, which is
what the parser applies. An unknown key, in any table, is an error naming the file and the key (with
a "did you mean" for near misses), and so is a value of the wrong type or out of range
(`[faults].ctrl_drop: expected a probability in [0, 1], got 1.5`). Times are in the unit their key
ends with (`_us`, `_ns`).
"""


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(t: TableDoc, choices: dict[tuple[str, str], tuple[str, ...]]) -> list[str]:
    title = f"`{t.header}`" if t.header else "Top level"
    lines = [f"## {title}", "", t.intro, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for k in t.keys:
        meaning = k.meaning
        if (t.header, k.key) in choices:
            meaning += " One of: " + ", ".join(f"`{c}`" for c in choices[(t.header, k.key)]) + "."
        default = k.default if k.default in ("required", "none") else f"`{k.default}`"
        lines.append(f"| `{k.key}` | {k.type} | {_md_cell(default)} | {_md_cell(meaning)} |")
    return [*lines, ""]


def schema_markdown() -> str:
    """docs/scenarios.md: every table and key of the format, from the dataclasses and the parser."""
    choices = _choices()
    lines = [_PREAMBLE]
    for t in schema_tables():
        lines += _md_table(t, choices)
    return "\n".join(lines).rstrip("\n") + "\n"


def _main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        sys.stderr.write("usage: python -m kvferry.sim.scenario --markdown > docs/scenarios.md\n")
        return 2
    sys.stdout.write(schema_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
