"""Which flow moves a room's bytes: a pure, configurable choice per room.

Flows (DESIGN section 9): ``direct`` WRITEs the planner's descriptors; ``ring`` gathers into a
worker's staging buffer and WRITEs one block per writer into decode's staging ring (SGLang PR 22536);
``pinned`` bounces through pinned host memory, head-major (SGLang PR 18968); ``pull`` lets decode READ
prefill's pages (vLLM's default; core/flows/pull.py), chosen only by an explicit override.
``push`` writes like ``direct`` under registration leases (vLLM PR 35264; core/resources/leases.py),
also only by override. ``layerwise`` writes each layer range the moment the engine reports it
computed (core/flows/layerwise.py), so only the last layer's write remains after the forward
pass; also only by override (the engine must report layers).

Default: ``direct`` when the two ranks hold the same heads (equal TP: whole pages coalesce into a
few descriptors); otherwise ``ring`` when decode registered a ring, else ``pinned`` when it
registered a pinned pool, else ``direct`` (always possible, only slow). An explicit override
always wins; overriding with a flow decode did not register fails the room with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvferry.core.errors import KvferryError
from kvferry.core.flows.registry import extra_flow
from kvferry.core.geometry import PoolGeometry
from kvferry.core.staging_layout import StagingFormat

__all__ = ["BUILT_FLOWS", "FLOW_NAMES", "Flow", "FlowError", "FlowPolicy", "staging_format"]


class FlowError(KvferryError, ValueError):
    """A flow name that does not exist or is not built."""


class Flow(StrEnum):
    """Every flow, in the order every list of flows shows them (CLI, scenarios, select, bench)."""

    DIRECT = "direct"
    RING = "ring"
    PINNED = "pinned"
    PULL = "pull"
    PUSH = "push"
    LAYERWISE = "layerwise"

    @classmethod
    def parse(cls, name: str) -> Flow:
        """A flow by name; a name registered outside ``Flow`` (core/flows/registry.py) gives its
        ``ExtraFlow``, which reads like a member."""
        try:
            # The table first (EnumType's call is slow; asked per room), for a plain name only.
            flow = (_BY_NAME.get(name) if type(name) is str else None) or cls(name)
        except ValueError:
            extra = extra_flow(name)
            if extra is not None:
                return extra  # type: ignore[return-value]
            raise FlowError(f"unknown flow {name!r} (known: {', '.join(f.value for f in cls)})") from None
        if flow not in BUILT_FLOWS:
            raise FlowError(f"flow {name!r} is not built yet (built: {', '.join(BUILT_FLOWS)})")
        return flow

    @property
    def staged(self) -> bool:
        return self is Flow.RING or self is Flow.PINNED


# The only list of flows: everything that names the flows (the CLI's choices, scenario checks,
# select's and calibrate's candidates, the benches, the loopback soak) reads these.
BUILT_FLOWS = tuple(Flow)
_BY_NAME: dict[str, Flow] = {f.value: f for f in Flow}  # Flow.parse's lookup, without the call
FLOW_NAMES = tuple(f.value for f in BUILT_FLOWS)


def staging_format(flow: Flow) -> StagingFormat:
    return StagingFormat.LAYER_MAJOR if flow is Flow.RING else StagingFormat.HEAD_MAJOR


def same_heads(src: PoolGeometry, dst: PoolGeometry) -> bool:
    return src.head_start == dst.head_start and src.heads_per_rank == dst.heads_per_rank


@dataclass(frozen=True, slots=True)
class FlowPolicy:
    """``fallback_direct``: a chunk too large for decode's ring or pinned pool goes direct
    instead of failing the room. Off by default: a silent 1000x slowdown is worse than a
    clear error naming the size to configure."""

    override: Flow | None = None
    fallback_direct: bool = False

    def choose(
        self,
        src: PoolGeometry,
        dst: PoolGeometry,
        ring_bytes: int,
        pinned_bytes: int,
        override: str | None = None,
    ) -> Flow:
        """The flow of one (room, decode rank); ``override`` (per room) beats the policy's own."""
        if override is not None:
            return Flow.parse(override)
        if self.override is not None:
            return self.override
        if same_heads(src, dst):
            return Flow.DIRECT
        if ring_bytes > 0:
            return Flow.RING
        if pinned_bytes > 0:
            return Flow.PINNED
        return Flow.DIRECT

    def requested(self, override: str | None) -> Flow | None:
        """The flow a room asked for before any is chosen: its own ``override``, else the
        policy's; None when ``choose`` will decide. An unknown name raises ``FlowError``."""
        return self.override if override is None else Flow.parse(override)

    @staticmethod
    def without_data() -> Flow:
        """The flow of a room whose every link is a dummy: nothing to stage or move, only the
        last chunk's notes."""
        return Flow.DIRECT
