"""Fault campaigns: many seeds, each a whole run with its own swarm personality, checked.

Without a base scenario every seed also draws its deployment (TP pair, heads or MLA, page sizes,
layouts, workers, workload), so a campaign covers topologies as well as faults. A failing seed is
written out as a resolved scenario file: replaying it (``kvferry replay FILE``) repeats the run
event for event, and dropping it into ``tests/scenarios/`` makes it a regression test.

Campaigns say what they covered: every run counts its rooms per flow and outcome and its TP pair
(``room_coverage``), and ``CoverageTally`` adds them up per flow, per TP pair and per fault kind
drawn, with the rooms that failed only by a deadline, so a campaign that never drew a flow or a
fault, or whose deadline failures drift up, shows it. The liveness class (``liveness_scenario``)
draws only faults the protocol promises to ride out, and there every room must end Success.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
from kvferry.backends.simfabric.spec import FabricSpec
from kvferry.core.flows import FLOW_NAMES as CORE_FLOW_NAMES
from kvferry.sim import executors as ex
from kvferry.sim import scenario as sc
from kvferry.sim.executors import Executor
from kvferry.sim.expected import valid_deadlines
from kvferry.sim.faults import _calm as stretch_for_load
from kvferry.sim.metrics import RunResult, collect
from kvferry.sim.rng import Streams
from kvferry.sim.world import World
from msgspec.structs import replace


def parse_seeds(text: str) -> list[int]:
    """``"0-999"``, ``"7"``, ``"1,5,10-12"`` -> the seeds, in order, without repeats."""
    out: list[int] = []
    seen: set[int] = set()
    # The whole list (and a set) is built: 10M seeds is about 1 GB, and weeks of runs.
    max_seeds = 10_000_000
    count = 0
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
            else:
                lo = hi = int(part)
        except ValueError:
            raise ValueError(f"bad seed range {part!r}; use e.g. 0-999 or 1,5,10-12") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"bad seed range {part!r}")
        count += hi - lo + 1  # checked before the list is built
        if count > max_seeds:
            raise ValueError(f"too many seeds in {text!r}: at most {max_seeds:,} in one campaign")
        for s in range(lo, hi + 1):
            if s not in seen:
                seen.add(s)
                out.append(s)
    if not out:
        raise ValueError("no seeds given")
    return out


# The share of drawn deployments with several servers a side, and the (prefill, decode) counts
# they draw from: small, since every rank is a node of its own and a seed should stay quick.
MULTI_INSTANCE_SHARE = 0.25
INSTANCE_DRAWS = ((1, 2), (2, 1), (2, 2), (1, 3), (3, 2))


def fuzz_scenario(seed: int, base: sc.Scenario | None = None, hooks: tuple[str, ...] = ()) -> sc.Scenario:
    """The scenario seed ``seed`` runs: ``base`` with swarm faults, or a deployment drawn too."""
    if base is not None:
        return replace(base, seed=seed, faults=replace(base.faults, swarm=True), hooks=base.hooks + hooks)
    # Each part draws from its own named stream, but the topology stream runs through three of
    # them: model and ranks, the workload's sizes, and last the fault window.
    rng = Streams(seed)["swarm.topology"]
    model, topo, rooms = _drawn_deployment(rng)
    work, fabric, burst = _drawn_workload(seed, rng, rooms)
    flows, model, work = _drawn_flows(seed, burst, model, work)
    topo, work = _drawn_spread(seed, topo, work)
    drawn = sc.Scenario(
        name=f"fuzz-{seed}",
        seed=seed,
        model=model,
        topology=topo,
        fabric=fabric,
        flows=flows,
        workload=work,
        faults=sc.Faults(swarm=True),
        phases=sc.Phases(fault_window_us=rng.choice((5_000, 15_000, 30_000))),
        hooks=hooks,
    )
    # Only deadlines a scenario file could set: a fence the peers' writes may outlive would
    # blame the core for the draw, and its saved failure would not load (sim/expected.py).
    return valid_deadlines(drawn)


def _drawn_deployment(rng: random.Random) -> tuple[sc.ModelSpec, sc.Topology, int]:
    """The model (heads or MLA), the TP pair and page sizes, the layouts, workers and room count."""
    heads, mla = rng.choice(((8, False), (8, False), (4, False), (2, False), (1, True)))
    tps = [t for t in (1, 2, 4) if (t <= heads and heads % t == 0) or (t > heads and t % heads == 0)]
    ptp, dtp = rng.choice(tps), rng.choice(tps)
    pps, dps = rng.choice((4, 16, 32)), rng.choice((4, 16, 32))
    layouts = ("sglang_nhd", "vllm_nhd", "vllm_hnd")
    model = sc.ModelSpec(
        name="fuzz",
        num_layers=rng.randint(1, 3),
        num_kv_heads=heads,
        head_dim=rng.choice((4, 8, 16)) if not mla else 32,
        dtype=rng.choice(("bf16", "fp8_e4m3")),
        is_mla=mla,
    )
    rooms = rng.randint(6, 16)
    topo = sc.Topology(
        prefill_tp=ptp,
        decode_tp=dtp,
        prefill_page_size=pps,
        decode_page_size=dps,
        prefill_pages=2048 // pps * 4,
        decode_pages=2048 // dps * 4,
        prefill_layout=rng.choice(layouts),
        decode_layout=rng.choice(layouts),
        workers=rng.randint(1, 3),
        aux_rows=64,
    )
    return model, topo, rooms


def _drawn_workload(seed: int, rng: random.Random, rooms: int) -> tuple[sc.Workload, FabricSpec, bool]:
    """The workload and the NIC's jitter, and whether the seed hands its chunks over in a burst."""
    # The blind spots, from their own stream (every earlier draw of a seed stays as it was):
    # decode allocations shorter or longer than prefill's; chunks handed over back to back with
    # a wide per-write jitter, so several chunks of a room are in flight and land (and notify)
    # out of order even when no fault is injected.
    brng = Streams(seed)["swarm.blind"]
    mismatch = brng.choice((0.0, 0.0, 0.1, 0.3))
    burst = brng.random() < 0.35
    jitter_ns = brng.choice((2_000, 40_000)) if burst else 2_000
    work = sc.Workload(
        rooms=rooms,
        tokens_min=1,
        tokens_max=rng.choice((64, 160, 300)),
        chunk_tokens=rng.choice((0, 16, 48, 64)),
        arrival_mean_us=rng.choice((100, 500, 1500)),
        compute_ns_per_token=0 if burst else sc.Workload().compute_ns_per_token,
        length_mismatch=mismatch,
    )
    fabric = sc.Scenario().fabric
    fabric = dataclasses.replace(fabric, nic=dataclasses.replace(fabric.nic, jitter_ns=jitter_ns))
    return work, fabric, burst


def _drawn_flows(
    seed: int, burst: bool, model: sc.ModelSpec, work: sc.Workload
) -> tuple[sc.FlowSpec, sc.ModelSpec, sc.Workload]:
    """The flow and its staging depth; layer-wise seeds also get more layers and a slower forward."""
    # Flows from their own stream, so adding them left every other draw of a seed as it was.
    frng = Streams(seed)["swarm.flows"]
    flows = sc.FlowSpec(
        flow=frng.choice(("policy", "direct", "ring", "pinned", "mixed", "mixed")),
        auto_chunks=frng.choice((1, 1, 2, 4, 16)),  # staging space from one chunk to many
    )
    # Pull from a stream of its own too: a fifth of the seeds run every room pulled, the others
    # keep the flow they drew before pull existed ("mixed" draws it per room as well).
    if Streams(seed)["swarm.flows.pull"].random() < 0.2:
        flows = replace(flows, flow="pull")
    elif Streams(seed)["swarm.flows.push"].random() < 0.25:
        flows = replace(flows, flow="push")
    elif not burst:
        # Layer-wise from a stream of its own, where the forward is slow enough (a long
        # prompt's) that layers leave one by one while the next ones compute (a burst hands
        # every chunk over at once: its draws stay as they were), with at least two layers.
        lrng = Streams(seed)["swarm.flows.layerwise"]
        if lrng.random() < 0.25:
            flows = replace(flows, flow="layerwise")
            model = replace(model, num_layers=max(model.num_layers, lrng.randint(2, 4)))
            work = replace(work, compute_ns_per_token=lrng.choice((2_000, 20_000)))
    # Push registrations matched by request id (no router transfer id), from a stream of its own.
    if Streams(seed)["swarm.flows.push_match"].random() < 0.4:
        flows = replace(flows, push_match="request_id")
    return flows, model, work


def _drawn_spread(seed: int, topo: sc.Topology, work: sc.Workload) -> tuple[sc.Topology, sc.Workload]:
    """Several servers a side, and prefix hits, each from a stream of its own."""
    # Several servers on one side or both: routing, each server's own memory, and faults and
    # aborts that hit one server while its neighbours carry on.
    irng = Streams(seed)["swarm.instances"]
    if irng.random() < MULTI_INSTANCE_SHARE:
        pre_n, dec_n = irng.choice(INSTANCE_DRAWS)
        topo = replace(topo, prefill_instances=pre_n, decode_instances=dec_n)
    # Prefix hits (decode holds the first tokens): a third of the seeds, for half of their rooms.
    if Streams(seed)["swarm.prefix"].random() < 0.3:
        work = replace(work, prefix_hit=0.5)
    return topo, work


# The liveness class: control messages dropped, duplicated, reordered and delayed, notifications
# delayed, and short slow links, at rates the resend intervals are sized for (every message that
# matters is resent each heartbeat interval until answered, well inside a room's deadlines).
LIVENESS_RATES = {
    "ctrl_drop": 0.02,
    "ctrl_dup": 0.05,
    "ctrl_reorder": 0.05,
    "ctrl_delay": 0.1,
    "notif_delay": 0.1,
}
LIVENESS_SLOW_FACTOR = 0.25  # a slow link keeps at least a quarter of its bandwidth
LIVENESS = "liveness_class"  # the violation's name
# What a campaign can draw, listed in its coverage even when it drew none of it.
FLOW_NAMES = ("policy", *CORE_FLOW_NAMES)
TP_PAIRS = tuple(f"{p}->{d}" for p in (1, 2, 4) for d in (1, 2, 4))
FAULT_KINDS = (
    "ctrl_drop", "ctrl_dup", "ctrl_reorder", "ctrl_delay", "notif_drop", "notif_delay", "xfer_err", "abort",
    "crash", "link_down", "slow_link",
)  # fmt: skip
LIVENESS_KINDS = (*LIVENESS_RATES, "slow_link")


def liveness_scenario(s: sc.Scenario) -> sc.Scenario:
    """``s`` with its faults replaced by a draw of the liveness class (from the seed's own
    stream): each ridable fault on or off, its rate up to ``LIVENESS_RATES``, and maybe one slow
    link for at most a tenth of the fault window. No crash, link down, write error, lost
    notification, abort or length mismatch: those may fail rooms by design."""
    rng = Streams(s.seed)["liveness"]
    rates = {
        k: round(rng.uniform(0.0, hi), 4) if rng.random() < 0.6 else 0.0 for k, hi in LIVENESS_RATES.items()
    }
    events: tuple[sc.FaultEvent, ...] = ()
    window = s.phases.fault_window_us
    nodes = s.node_names()
    if rng.random() < 0.5 and window > 10:
        pre = [n for n in nodes if n.startswith("prefill")]
        dec = [n for n in nodes if n.startswith("decode")]
        events = (
            sc.FaultEvent(
                at_us=rng.randrange(window), kind="slow_link", node=rng.choice(pre), peer=rng.choice(dec),
                duration_us=rng.randrange(1, window // 10 + 1),
                factor=round(rng.uniform(LIVENESS_SLOW_FACTOR, 0.8), 3),
            ),
        )  # fmt: skip
    faults = sc.Faults(swarm=False, events=events, clock_skew_max_us=s.faults.clock_skew_max_us, **rates)
    work = replace(s.workload, length_mismatch=0.0)
    # Deadlines stretched as for a calm seed: a drawn overload queues rooms past unstretched
    # deadlines with no fault at all, which is load, not a resend gone missing.
    return stretch_for_load(replace(s, name=f"liveness-{s.seed}", faults=faults, workload=work))


def room_coverage(w: World) -> dict[str, Any]:
    """This run's rooms per flow (``policy`` where the policy chose) and outcome, its TP pair,
    and how many rooms failed only by a deadline (every reason a "timed out while" one)."""
    by_flow: dict[str, Counter[str]] = defaultdict(Counter)
    outcomes: Counter[str] = Counter()
    by_deadline = 0
    for r in w.requests:
        outcome = r.outcome or "open"
        by_flow[r.flow or "policy"][outcome] += 1
        outcomes[outcome] += 1
        reasons = [x for x in r.reason.values() if x]
        by_deadline += outcome == "failed" and bool(reasons) and all("timed out while" in x for x in reasons)
    t = w.scenario.topology
    return {
        "by_flow": {f: dict(c) for f, c in sorted(by_flow.items())},
        "tp": f"{t.prefill_tp}->{t.decode_tp}",
        "outcomes": dict(outcomes),
        "failed_by_deadline": by_deadline,
    }


def _liveness_violations(w: World) -> list[dict[str, Any]]:
    out = []
    for r in w.requests:
        if r.outcome != "success" and not r.mismatched:
            why = next((f"{n}: {x}" for n, x in sorted(r.reason.items()) if x), "")
            detail = f"room {r.key} {r.outcome or 'unfinished'} under faults the protocol rides out ({why})"
            out.append({"invariant": LIVENESS, "detail": detail, "t_ns": int(w.env.now), "room": r.key})
    return out


class CoverageTally:
    """A campaign's coverage: rooms per flow, per TP pair and per fault kind (the rooms of every
    run that injected that kind; ``none``: runs that injected nothing), with their outcomes and
    the rooms that failed only by a deadline."""

    def __init__(self) -> None:
        self.by_flow: dict[str, Counter[str]] = defaultdict(Counter)
        self.by_tp: dict[str, Counter[str]] = defaultdict(Counter)
        self.by_fault: dict[str, Counter[str]] = defaultdict(Counter)

    def add(self, res: RunResult) -> None:
        cov = res.coverage
        if not cov:
            return
        for flow, c in cov["by_flow"].items():
            self.by_flow[flow].update(c)
        deadline = {"failed_by_deadline": cov["failed_by_deadline"]} if cov["failed_by_deadline"] else {}
        self.by_tp[cov["tp"]].update({**cov["outcomes"], **deadline})
        for kind in [k for k, n in res.faults.items() if n] or ["none"]:
            self.by_fault[kind].update({**cov["outcomes"], **deadline, "runs": 1})

    def as_dict(self, liveness: bool = False) -> dict[str, dict[str, dict[str, int]]]:
        """Every flow, TP pair and fault kind the campaign could draw has a row (zero if never)."""

        def rows(d: dict[str, Counter[str]], known: tuple[str, ...]) -> dict[str, dict[str, int]]:
            out = {}
            for k in [*known, *sorted(set(d) - set(known))]:
                c = d.get(k, Counter())
                rooms = sum(n for o, n in c.items() if o in ("success", "failed", "open"))
                out[k] = {"rooms": rooms, **dict(sorted(c.items()))}
            return out

        kinds = LIVENESS_KINDS if liveness else FAULT_KINDS
        return {
            "by_flow": rows(self.by_flow, FLOW_NAMES),
            "by_tp": rows(self.by_tp, TP_PAIRS),
            "by_fault": rows(self.by_fault, ("none", *kinds)),
        }


def run_one(
    s: sc.Scenario,
    seed: int | None = None,
    keep_trace: bool = False,
    detail: bool = False,
    before_run: Callable[[World], Any] | None = None,
    liveness: bool = False,
) -> tuple[RunResult, World]:
    """One run, checked. ``before_run`` sees the built world first (a trace viewer's tap);
    ``liveness``: a run of the liveness class, where a room that is not Success is a violation."""
    t0 = time.perf_counter()
    w = World(s, seed=seed, keep_trace=keep_trace)
    if before_run is not None:
        before_run(w)
    w.run()
    res = collect(w, wall_s=time.perf_counter() - t0, detail=detail)
    res.coverage = room_coverage(w)
    if liveness:
        res.violations += _liveness_violations(w)
    if res.violations:
        res.scenario_toml = failing_scenario_toml(w, res)
    return res, w


def failing_scenario_toml(w: World, res: RunResult) -> str:
    first = res.violations[0]
    s = replace(
        w.scenario,
        name=f"{w.scenario.name}-seed-{w.seed}"
        if not w.scenario.name.endswith(f"-{w.seed}")
        else w.scenario.name,
        description=f"found by kvferry fuzz: {first['invariant']}: {first['detail']}"[:500],
        seed=w.seed,
        expect_violations=tuple(res.violated()) if w.scenario.hooks else (),
    )
    header = (
        f"# Failing run saved by `kvferry fuzz` (seed {w.seed}). Replay: kvferry replay <this file>\n"
        f"# Violated: {', '.join(res.violated())}. Dropped into tests/scenarios/ it is a regression\n"
        "# test that expects no violation (or exactly those under [expect] for planted bugs).\n"
    )
    return header + sc.dump(s)


def _job(seed: int, base_toml: str | None, hooks: tuple[str, ...], liveness: bool = False) -> bytes:
    """One seed's run, as msgpack: results cross processes and machines as data, never pickles."""
    base = sc.parse(_loads(base_toml)) if base_toml is not None else None
    s = fuzz_scenario(seed, base, hooks)
    res, _ = run_one(liveness_scenario(s) if liveness else s, liveness=liveness)
    return msgspec.msgpack.encode(res)


def _loads(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


def seed_job(
    base: sc.Scenario | None = None, hooks: tuple[str, ...] = (), liveness: bool = False
) -> Callable[[int], bytes]:
    """The picklable function an executor maps over seeds (the base travels as its TOML text)."""
    toml = sc.dump(base) if base is not None else None
    return functools.partial(_job, base_toml=toml, hooks=hooks, liveness=liveness)


def decode_result(data: bytes) -> RunResult:
    return msgspec.msgpack.decode(data, type=RunResult)


def run_seeds(
    seeds: Sequence[int],
    base: sc.Scenario | None = None,
    hooks: tuple[str, ...] = (),
    executor: Executor | None = None,
    progress: ex.Progress | None = None,
    liveness: bool = False,
) -> Iterator[RunResult]:
    """Every seed once, yielded as runs finish (any order); ``executor`` defaults to inline."""
    executor = executor or ex.LocalExecutor(1)
    for _, data in executor.map(seed_job(base, hooks, liveness), seeds, progress=progress):
        yield decode_result(data)


def campaign(
    seeds: Sequence[int],
    base: sc.Scenario | None = None,
    jobs: int = 1,
    hooks: tuple[str, ...] = (),
    executor: Executor | None = None,
) -> Iterator[RunResult]:
    """Run every seed; yields results in seed order (so output does not depend on ``jobs``)."""
    order = list(seeds)
    held: dict[int, RunResult] = {}
    nxt = 0
    for res in run_seeds(order, base, hooks, executor or ex.LocalExecutor(jobs)):
        held[res.seed] = res
        while nxt < len(order) and order[nxt] in held:
            yield held.pop(order[nxt])
            nxt += 1


def first_failing(runs: Iterator[RunResult]) -> RunResult | None:
    """The first run with a violation, or None: the runs after it are not waited for (leaving
    ``campaign``'s generator ends it), which a planted-bug check needs no more of."""
    return next((r for r in runs if r.violations), None)


def save_failure(res: RunResult, directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"seed-{res.seed}.toml"
    path.write_text(res.scenario_toml)
    return path


Progress = Callable[[RunResult], None]
