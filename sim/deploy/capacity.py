"""Capacity: how many prefill and decode instances, at which TP, with which flow, serve a rate
within the SLOs, and the most each configuration sustains.

Each configuration (TP pair, flow, P prefill and D decode instances) is judged by steady-state
runs (``steady_run``: Poisson arrivals at the rate for a duration, warm-up excluded, a run stopped
once its queue shows it cannot keep up). A configuration meets a rate when no run of it is
overloaded and at least the target share of its requests meet both SLOs (mean over seeds).

Simulating every configuration would take minutes; two facts keep it to the few that matter:

- An upper bound per instance and flow (``bounds``): a prefill instance cannot finish more
  requests per second than its GPUs compute their prompts at full rate (the attention over the
  whole prompt included, the step overhead once per chunk), a decode instance no more than its
  largest batch that fits its memory and keeps a step within the TPOT SLO, over the output
  length, and neither more than its busiest NIC posts and carries (``nic_ns``). P prefill and D
  decode instances sustain at most ``min(P x prefill, D x decode)``; a configuration whose bound
  is below the rate cannot meet it and is not simulated (its row says so).
- Configurations are tried in order of GPUs (then instances), those of one GPU count at once
  (``Runner``: worker processes); the first count where one meets the rate answers.

The most a configuration sustains (``max_rate``) is narrowed by steady-state runs between a rate
it met and its bound, one rate a run: first at a guess (the share of its bound that a
configuration limited alike sustained, ``_guess``), then a growing stride beyond it, then
bisection once two runs bracket the answer. A run that meets its rate runs its whole duration and
one that misses stops early, so bisection's first rates (met, far below the answer) cost the most
and say the least. Configurations are narrowed side by side on the workers (``InOrder``), each
waiting only for the earlier ones whose results it starts from, so the table is the one narrowing
them one after another gives, and the same whatever the number of workers.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.in_order import InOrder
from kvferry.sim.deploy.metrics import DeployResult
from kvferry.sim.deploy.run import simulate
from kvferry.sim.deploy.run_cache import RunCache
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.deploy.steady import Interval, queue_limit

__all__ = [
    "MAX_RATES",
    "Bounds",
    "Candidate",
    "Capacity",
    "Runner",
    "Workload",
    "bounds",
    "max_rate",
    "meets",
    "nic_ns",
    "search",
    "steady_run",
    "steady_runs",
]

NS = 1_000_000_000
MIN_REQUESTS = 16
# Which configurations' maximum sustainable rate a search narrows: "simulated" (with a rate: the
# answer's and that of every configuration simulated at the rate; without: each balanced
# configuration's) or "all" (every configuration within the limits, its bound ruling none out:
# minutes a configuration on two cores).
MAX_RATES = ("simulated", "all")  # a steady-state run below this many requests says nothing


@dataclass(frozen=True, slots=True)
class Workload:
    isl: int
    osl: int
    duration_s: float = 30.0
    warmup_s: float = 10.0
    spread: float = 0.0  # input and output lengths uniform within +-spread of isl, osl


def steady_run(
    spec: DeploySpec, rate: float, w: Workload, label: str = "", target: float | None = None
) -> DeployResult:
    """One steady-state run: Poisson arrivals at ``rate`` for ``w.duration_s`` (at least
    MIN_REQUESTS requests), metrics over the arrivals after the warm-up, stopped as overloaded once
    the queue passes what meeting the TTFT SLO allows (``steady.queue_limit``), and, with a
    ``target``, once more measured requests missed an SLO than that attainment allows (the
    verdict is then known: the rest of the run would not change it)."""
    n = max(MIN_REQUESTS, math.ceil(rate * w.duration_s))
    reqs = wl.poisson(rate, n, w.isl, w.osl, spec.seed, w.spread)
    warmup_ns = int(min(w.warmup_s, w.duration_s / 2) * NS)
    measured = sum(1 for r in reqs if r.arrival_ns >= warmup_ns)
    return simulate(
        spec,
        wl.Arrivals(requests=reqs),
        label=label or f"{rate:g} req/s",
        warmup_ns=warmup_ns,
        queue_limit=queue_limit(rate, spec.ttft_slo_ms),
        miss_limit=-1 if target is None else math.floor((1 - target) * measured + 1e-9),
    )


def steady_runs(
    spec: DeploySpec, rate: float, w: Workload, seeds: Sequence[int], target: float | None = None
) -> list[DeployResult]:
    return [steady_run(replace(spec, seed=s), rate, w, target=target) for s in seeds]


def meets(rs: Sequence[DeployResult], target: float) -> bool:
    """No run overloaded, stopped or with a violation, and the SLO attainment (mean over seeds)
    >= target."""
    if any(r.overload or r.stopped or r.violations for r in rs):
        return False
    return Interval.of([r.slo_attained for r in rs]).mean >= target


@dataclass(frozen=True, slots=True)
class Bounds:
    """Requests per second one instance of each side can finish at most (roofline and NIC at full
    use), and which of compute or the NIC sets each."""

    prefill_rps: float
    decode_rps: float
    decode_batch: int  # the largest batch that fits decode memory and the TPOT SLO
    prefill_by: str = "compute"  # "compute" or "NIC" (posting and wire of its busiest rank)
    decode_by: str = "compute"

    def of(self, p: int, d: int) -> float:
        return min(p * self.prefill_rps, d * self.decode_rps)

    def limit(self, p: int, d: int) -> str:
        if p * self.prefill_rps <= d * self.decode_rps:
            return f"prefill {self.prefill_by}"
        return f"decode {self.decode_by}"


def bounds(spec: DeploySpec, isl: int, osl: int) -> Bounds:
    """Upper bounds per instance (see the module's docstring); every time here is a lower bound
    of what the simulation charges, so no configuration that could meet a rate is left out."""
    roof = spec.roofline("prefill")
    gpu = roof.gpu
    pairs = isl * (isl + 1) // 2  # each prompt token attends to those before it
    flops = 2.0 * roof.w.active_per_token() * isl + roof._attn_flops(pairs)
    chunks = -(-isl // spec.chunk_tokens)
    # Full chunks cannot share a step; only the last, partial chunk may ride with another's.
    overhead_s = (chunks - 1) * gpu.prefill_step_overhead_us * 1e-6
    prefill_s = flops / (gpu.flops * spec.prefill_tp) + overhead_s
    dec = spec.roofline("decode")
    tokens = spec.pages("decode") * spec.decode_page_size  # every request needs its prompt's slots
    fit = min(spec.max_batch, max(1, tokens // max(1, isl)))
    slo_ns = spec.tpot_slo_ms * 1e6
    best, batch = 0.0, 0
    for b in range(1, fit + 1):
        step = dec.decode_ns(b, b * isl)
        if step > slo_ns:
            break
        rps = b / (osl * step / NS)
        if rps > best:
            best, batch = rps, b
    pre_nic, dec_nic = nic_ns(spec, isl)
    compute_p = 1.0 / prefill_s if prefill_s > 0 else math.inf
    nic_p = NS / pre_nic if pre_nic else math.inf
    nic_d = NS / dec_nic if dec_nic else math.inf
    return Bounds(
        min(compute_p, nic_p),
        min(best, nic_d),
        batch,
        "compute" if compute_p <= nic_p else "NIC",
        "compute" if best <= nic_d else "NIC",
    )


def nic_ns(spec: DeploySpec, isl: int) -> tuple[int, int]:
    """The least NIC time one request takes on the busiest prefill rank and the busiest decode
    rank under ``spec.flow``: its posting (the initiator's NIC posts serially: fixed cost per post,
    cost per descriptor, the pages contiguous so descriptors merge the most they can) or its bytes
    over the NIC's bandwidth, whichever is longer."""
    from kvferry.core.geometry import links
    from kvferry.sim.deploy.run import build_scenario
    from kvferry.sim.deploy.select import UNSTAGED
    from kvferry.sim.deploy.timing import LayerPlanner
    from kvferry.sim.scenario import pools

    s = build_scenario(spec, (wl.DeployRequest(0, isl, 1),))
    pre, dec = pools(s)
    model = pre[0].model
    nic = s.fabric.nic
    sizes = _chunks(isl, spec.chunk_tokens)
    plan = LayerPlanner()
    post_p, post_d = [0] * len(pre), [0] * len(dec)
    out_b, in_b = [0] * len(pre), [0] * len(dec)
    for link in links(model, len(pre), len(dec)):
        if link.is_dummy:
            continue
        p, d = link.prefill_rank, link.decode_rank
        nbytes = isl * model.num_regions * link.num_heads * model.head_bytes
        out_b[p] += nbytes
        in_b[d] += nbytes
        if spec.flow in UNSTAGED:
            sp = list(range(-(-isl // pre[p].page_size)))
            dp = list(range(-(-isl // dec[d].page_size)))
            n, start = 0, 0
            for c in sizes:
                got = plan(pre[p], dec[d], sp, dp, start, start + c)
                n += got.count * model.num_layers
                start += c
        else:
            n = len(sizes)  # one block a chunk into the staging buffer
        # Layer-wise posts one WRITE per layer of every chunk (the same descriptors in all).
        posts = len(sizes) * (model.num_layers if spec.flow == "layerwise" else 1)
        if spec.flow == "pull":  # decode READs, at a READ's cost a descriptor where the NIC has one
            post_d[d] += posts * nic.post_cost_ns + n * (nic.read_desc_ns or nic.per_desc_ns)
        else:
            post_p[p] += posts * nic.post_cost_ns + n * nic.per_desc_ns
    bw = nic.bandwidth_bps
    pre_ns = max(max(post_p), max(out_b) * NS // bw)
    dec_ns = max(max(post_d), max(in_b) * NS // bw)
    return pre_ns, dec_ns


def _chunks(tokens: int, chunk: int) -> list[int]:
    return [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])


@dataclass(slots=True)
class Candidate:
    prefill_tp: int
    decode_tp: int
    flow: str
    prefill: int  # instances
    decode: int
    bound_rps: float  # the roofline bound: the most it could sustain
    limit: str  # the side that bound comes from
    results: list[DeployResult] = field(default_factory=list)  # at the asked rate, one per seed
    met: bool | None = None  # None: not simulated (its bound is below the rate)
    max_rps: float | None = None  # simulated: the most it was seen to sustain within the SLOs
    max_rps_below: float | None = None  # and the least it could not (a rate it missed, or its bound)
    # Where max_rps comes from when no run of its own met a higher rate: a configuration with no
    # more instances of either side (same TP and flow) that was seen to sustain it (more instances
    # never serve less: an assumption the bisection then narrows from). "" when its own runs did.
    max_rps_from: str = ""
    max_rps_runs: int = 0  # steady-state runs its bisection took
    staging_bytes: int = 0
    # The flow whose runs stand for this one's (``DeploySpec.runs_as``: push's are direct's where
    # a push registration costs no host work), "" when it ran its own: its results and maximum are
    # that configuration's, relabelled, and it took no run.
    runs_of: str = ""

    def spec(self, base: DeploySpec) -> DeploySpec:
        """``base`` as this configuration: its TP sizes, flow and instance counts."""
        return replace(
            base,
            prefill_tp=self.prefill_tp,
            decode_tp=self.decode_tp,
            flow=self.flow,
            prefill_instances=self.prefill,
            decode_instances=self.decode,
        )

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def name(self) -> str:
        return f"{self.prefill}P x TP{self.prefill_tp} + {self.decode}D x TP{self.decode_tp}"

    def verdict(self, rate: float | None) -> str:
        if rate is None:
            return ""
        if self.met is None:
            return f"cannot: bound {self.bound_rps:.2f} req/s < {rate:g} ({self.limit} side)"
        if self.met:
            return "meets the SLOs"
        r = self.results[0]
        if r.overload:
            return r.overload
        if r.stopped:
            return r.stopped
        att = Interval.of([x.slo_attained for x in self.results])
        return f"{att.mean:.0%} within the SLOs"

    def as_dict(self, rate: float | None) -> dict[str, Any]:
        return {
            "prefill_tp": self.prefill_tp,
            "decode_tp": self.decode_tp,
            "flow": self.flow,
            "prefill_instances": self.prefill,
            "decode_instances": self.decode,
            "gpus": self.gpus,
            "bound_rps": self.bound_rps,
            "bound_side": self.limit,
            "met": self.met,
            "verdict": self.verdict(rate),
            "max_rps": self.max_rps,
            "max_rps_below": self.max_rps_below,
            "max_rps_from": self.max_rps_from or ("simulated" if self.max_rps is not None else None),
            "max_rps_runs": self.max_rps_runs,
            "runs_of": self.runs_of or None,
            "staging_bytes_per_rank_pair": self.staging_bytes,
            "results": [r.as_dict() for r in self.results],
        }


@dataclass(slots=True)
class Capacity:
    rate: float | None
    target: float
    candidates: list[Candidate]
    answer: Candidate | None
    reason: str
    bounds: dict[str, dict[str, Any]]  # "TP8->TP4 ring": per-instance bounds

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "attainment_target": self.target,
            "answer": self.answer.as_dict(self.rate) if self.answer else None,
            "reason": self.reason,
            "per_instance_bounds": self.bounds,
            "candidates": [c.as_dict(self.rate) for c in self.candidates],
        }


Progress = Callable[[str], None]


def _staging(spec: DeploySpec, w: Workload) -> int:
    from kvferry.sim.deploy.run import build_scenario, staging_bytes

    s = build_scenario(spec, (wl.DeployRequest(0, w.isl, w.osl),))
    return sum(staging_bytes(s).values())


Job = tuple[DeploySpec, float, Workload, tuple[int, ...], float]  # spec, rate, workload, seeds, target


def _runs(job: Job) -> list[DeployResult]:
    spec, rate, w, seeds, target = job
    return steady_runs(spec, rate, w, seeds, target)


class Runner:
    """Runs steady-state jobs, ``jobs`` at a time in forked worker processes (1: in this one).
    Each run is one process's work, so two cores halve a search's wall time."""

    def __init__(self, jobs: int = 1, cache: RunCache | None = None) -> None:
        self.jobs = max(1, jobs)
        self.cache = cache  # results of earlier searches (sim/deploy/run_cache.py), None: none kept
        self._pool: Any = None

    def __enter__(self) -> Runner:
        if self.jobs > 1:
            import multiprocessing

            from kvferry.sim.executors import new_pool

            self._pool = new_pool(self.jobs, multiprocessing.get_context("fork"))
            # A fork pool starts every worker at its first job: here, on this thread, before the
            # search's threads (``InOrder``) exist, whose locks a forked child would inherit held.
            self._pool.submit(int).result()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        from kvferry.sim.executors import stop_workers

        if self._pool is None:
            return
        if kind is None:
            self._pool.shutdown(cancel_futures=True)
        else:  # Ctrl-C (the workers ignore it) or an error: the runs in flight are not waited for
            stop_workers(self._pool)

    def map(self, jobs: Sequence[Job]) -> list[list[DeployResult]]:
        """Each job's runs, in order: kept ones from the cache, the others simulated (at once
        on the workers) and kept."""
        kept = [self.cache.get(j) if self.cache is not None else None for j in jobs]
        todo = [j for j, k in zip(jobs, kept, strict=True) if k is None]
        # One job goes to the pool too: the search's threads each ask for one run at a time.
        done = [_runs(j) for j in todo] if self._pool is None else list(self._pool.map(_runs, todo))
        if self.cache is not None:
            for j, rs in zip(todo, done, strict=True):
                self.cache.put(j, rs)
        fresh = iter(done)
        return [k if k is not None else next(fresh) for k in kept]


def max_rate(
    spec: DeploySpec,
    w: Workload,
    seeds: Sequence[int],
    target: float,
    lo: float,
    hi: float,
    steps: int = 8,
    progress: Progress | None = None,
    runner: Runner | None = None,
    runs: list[int] | None = None,
    guess: float = 0.0,
) -> tuple[float, float]:
    """Search between a rate met (``lo``, 0 for none) and one that cannot be (``hi``) until the
    two are within 5% (finer is below the seeds' noise), one rate a step (``_next_rate``), at
    most ``steps`` steps. ``guess`` (0: none), where the answer likely lies: the first step tries
    it, and each step after one a stride beyond the rate just tried, on the side its run said
    the answer lies, the stride tripling while runs keep landing on one side; below a miss, from
    the third miss in a row (``_HOLD``). One rate a step,
    not several at once: a configuration's rates wait for each other, but a search narrows
    several configurations side by side, and a guess within 5% then costs two runs where
    several at once spend the rest on rates that say nothing. ``runs``, when given, gets the
    number of rates tried added to its first item."""
    runner = runner or Runner()
    aim, stride, last, lo_0 = guess, _TOL, None, lo
    misses = 0  # in a row, the last run's included
    for _ in range(steps):
        if lo > 0 and hi <= lo * (1 + _TOL):
            break
        r = _next_rate(lo, hi, aim, last)
        if progress is not None:
            progress(f"  max rate of {spec.prefill_instances}P{spec.decode_instances}D {spec.flow}: {r:.2f}")
        (rs,) = runner.map([(spec, r, w, tuple(seeds), target)])
        if runs is not None:
            runs[0] += 1
        met = meets(rs, target)
        if met:
            lo = r
        else:
            hi = r
        misses = 0 if met else misses + 1
        if aim and last is not None and met != last:
            aim = 0.0  # the answer is bracketed between the last two runs: bisect from here
        elif aim and not (met and aim <= lo_0):
            stride = stride * _GROW if met == last and not 1 < misses <= _HOLD else _TOL
            aim = r * (1 + stride) if met else r / (1 + stride)
        else:
            aim = 0.0  # a guess of only "just above the rate met" (``lo``) was met: bisect
        last = met
    return lo, hi


_TOL = 0.05  # a maximum rate is narrowed until its interval is this narrow (relative to its rate met)
_GROW = 3  # a guided step's stride grows this much a run while runs land on one side of the answer
# Below a miss the stride holds at 5% for this many misses in a row. A guess that overshoots does
# so by a few percent more often than not (the 70B table's: 7% twice, 18% once), and a miss stops
# early (about two thirds of a run met): a third run 5% lower, met, then closes it where a stride
# of 15% lands far below and bisects back up with two runs met. Above a met run it grows at once:
# each step there is a run met, the costliest kind. Over guesses up to 10% off either way it takes
# 14% less run time (2.84 runs a configuration, not 3.25), up to 25% off 3% less, up to 40% off the
# same (bench/narrowing_oracle.py).
_HOLD = 2


def _next_rate(lo: float, hi: float, aim: float, last: bool | None = None) -> float:
    """A rate strictly inside (lo, hi). Without ``aim``: the middle (geometric, or half of ``hi``
    with nothing met). With one: ``aim``, but no nearer either end than 5% of it, so the run
    closes the interval whenever the answer lies within 5% of that end (a miss just above a rate
    met, a rate met just below a miss); and after a run (``last``: whether it met its rate), no
    farther on than the middle, so a guess far off costs no more than bisection. Within 10% of
    each other, only the middle is left, which closes the interval either way."""
    mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
    near_lo, near_hi = lo * (1 + _TOL), hi / (1 + _TOL)
    if not aim or near_lo >= near_hi:
        return mid
    if last is not None:
        aim = min(aim, mid) if last else max(aim, mid)
    return min(max(aim, near_lo), near_hi)


def search(
    base: DeploySpec,
    tp_pairs: Sequence[tuple[int, int]],
    flows_of: Callable[[DeploySpec], Sequence[str]],
    w: Workload,
    rate: float | None,
    seeds: Sequence[int] = (1,),
    target: float = 0.9,
    max_instances: int = 8,
    max_gpus: int = 1 << 30,
    max_rate_steps: int = 8,
    progress: Progress | None = None,
    jobs: int = 1,
    max_rates: str = "simulated",
    cache: RunCache | None = None,
) -> Capacity:
    """With ``rate``: the cheapest configuration meeting it (None if none within the limits), and
    the most it sustains. Without: the most each balanced configuration (per prefill count, the
    fewest decode instances whose bound covers it) sustains. With a rate, the most each
    configuration simulated at it sustains too; ``max_rates="all"``: the most every configuration
    within the limits sustains (``_every_max_rate``). ``cache``: runs kept from earlier searches,
    and where this one's are kept."""
    if max_rates not in MAX_RATES:
        raise ValueError(f"max_rates must be one of {', '.join(MAX_RATES)}, got {max_rates!r}")
    say = _one_at_a_time(progress or (lambda _msg: None))
    cands, per = _candidates(base, tp_pairs, flows_of, w, max_instances, max_gpus)
    if any(c.flow == "layerwise" for c in cands):
        say(_layerwise_note(base, w))
    try:
        with Runner(jobs, cache) as runner:
            s = _Search(base, w, tuple(seeds), target, max_rate_steps, say, runner)
            _check_twins(cands, s)
            if rate is not None:
                cap = _for_rate(cands, per, rate, s)
            elif max_rates == "all":
                cap = Capacity(None, target, cands, None, "", per)
            else:
                return _balanced(cands, per, max_instances, s)
            if max_rates == "all" or rate is not None:
                chosen = cands if max_rates == "all" else [c for c in cands if c.met is not None]
                try:
                    _every_max_rate(chosen, cands, rate, s)
                except KeyboardInterrupt:
                    # Ctrl-C here keeps the answer found; the maxima not narrowed yet stay empty.
                    if rate is not None:
                        left = sum(1 for c in chosen if c.max_rps is None)
                        cap.reason += f" (interrupted: {left} maximum rates not narrowed)"
                        return cap
                    raise
                if rate is None:
                    cap.answer, cap.reason = _best_per_gpu(cands)
            return cap
    except KeyboardInterrupt:
        # Ctrl-C: the configurations judged so far, and no answer.
        judged = sum(1 for c in cands if c.met is not None or c.max_rps is not None)
        why = f"interrupted: {judged} configurations judged before Ctrl-C are listed; no answer"
        return Capacity(rate, target, cands, None, why, per)


def _layerwise_note(base: DeploySpec, w: Workload) -> str:
    """Why a search with layer-wise takes longer: its runs simulate a write per layer and chunk,
    where the other flows simulate about one a chunk (a 70B model's TP 8 -> 8 search on an H200: a
    layer-wise run 4-15x a direct one, 227 s with it and 39 s without, docs/benchmarks.md)."""
    layers = base.geometry().num_layers
    chunks = len(_chunks(w.isl, base.chunk_tokens))
    return (
        f"layer-wise runs simulate a write per layer and chunk ({layers} x {chunks} a request), the other "
        f"flows about one a chunk: its runs take the longest (leave it out with --flows for a sooner answer)"
    )


def _one_at_a_time(say: Progress) -> Progress:
    """``say`` for configurations narrowed on several threads: one line at a time."""
    lock = threading.Lock()

    def locked(msg: str) -> None:
        with lock:
            say(msg)

    return locked


def _candidates(
    base: DeploySpec,
    tp_pairs: Sequence[tuple[int, int]],
    flows_of: Callable[[DeploySpec], Sequence[str]],
    w: Workload,
    max_instances: int,
    max_gpus: int,
) -> tuple[list[Candidate], dict[str, dict[str, Any]]]:
    """Every configuration within the limits, cheapest first (GPUs, then instances, then staging
    memory), with its roofline bound; and each TP pair and flow's bounds per instance."""
    cands: list[Candidate] = []
    per: dict[str, dict[str, Any]] = {}
    for ptp, dtp in tp_pairs:
        spec_tp = replace(base, prefill_tp=ptp, decode_tp=dtp)
        for flow in flows_of(spec_tp):
            b = bounds(replace(spec_tp, flow=flow), w.isl, w.osl)
            per[f"TP{ptp}->TP{dtp} {flow}"] = {
                "prefill_rps": b.prefill_rps,
                "prefill_by": b.prefill_by,
                "decode_rps": b.decode_rps,
                "decode_by": b.decode_by,
                "decode_batch": b.decode_batch,
            }
            mem = _staging(replace(spec_tp, flow=flow), w)
            for p in range(1, max_instances + 1):
                for d in range(1, max_instances + 1):
                    if p * ptp + d * dtp > max_gpus:
                        continue
                    cands.append(
                        Candidate(ptp, dtp, flow, p, d, b.of(p, d), b.limit(p, d), staging_bytes=mem)
                    )
    cands.sort(key=lambda c: (c.gpus, c.prefill + c.decode, c.staging_bytes))
    return cands, per


@dataclass(frozen=True, slots=True)
class _Search:
    """What every phase of one search shares: the base spec, the workload, the seeds, the
    attainment target, the rounds a maximum rate gets, progress and the worker pool."""

    base: DeploySpec
    w: Workload
    seeds: tuple[int, ...]
    target: float
    steps: int
    say: Progress
    runner: Runner
    # (prefill TP, decode TP, flow) whose run was not its twin's (``_check_twins``): they run their own.
    apart: set[tuple[int, int, str]] = field(default_factory=set)
    # flow -> the flow whose runs are its runs (``DeploySpec.runs_as``), asked once a flow: the
    # answer reads the NIC's and the control path's profiles, and ``twin`` is asked per candidate.
    runs_as: dict[str, str] = field(default_factory=dict)

    def job(self, c: Candidate, rate: float) -> Job:
        return (c.spec(self.base), rate, self.w, self.seeds, self.target)

    def twin(self, c: Candidate, among: Sequence[Candidate]) -> Candidate | None:
        """The configuration of ``among`` whose runs are ``c``'s (``DeploySpec.runs_as``), if any."""
        flow = self.runs_as.get(c.flow)
        if flow is None:
            flow = self.runs_as[c.flow] = replace(self.base, flow=c.flow).runs_as()
        if flow == c.flow or (c.prefill_tp, c.decode_tp, c.flow) in self.apart:
            return None
        return next((o for o in among if o.flow == flow and _where(o) == _where(c)), None)

    def narrow(
        self,
        c: Candidate,
        lo: float,
        hi: float,
        quiet: bool = False,
        runs: list[int] | None = None,
        guess: float = 0.0,
    ) -> tuple[float, float]:
        """``max_rate`` of configuration ``c`` between ``lo`` and ``hi``, first around ``guess``."""
        say = None if quiet else self.say
        return max_rate(c.spec(self.base), self.w, self.seeds, self.target, lo, hi, self.steps, say,
                        self.runner, runs, guess)  # fmt: skip


def _check_twins(cands: Sequence[Candidate], s: _Search) -> None:
    """Before a flow takes another's runs (``_Search.twin``), its smallest configuration of each TP
    pair runs once beside its twin, at 75% of the twin's bound: ``DeploySpec.runs_as`` says why
    the two are one simulation, and this deployment shows it, or the flow runs its own at that TP
    pair (and progress says so). Two small runs of the search's hundred."""
    first: dict[tuple[int, int, str], tuple[Candidate, Candidate]] = {}
    for c in sorted(cands, key=lambda c: c.gpus):
        key = (c.prefill_tp, c.decode_tp, c.flow)
        if key not in first and (twin := s.twin(c, cands)) is not None:
            first[key] = (c, twin)
    if not first:
        return
    pairs = list(first.items())
    jobs = [s.job(x, 0.75 * twin.bound_rps) for _k, (c, twin) in pairs for x in (c, twin)]
    got = s.runner.map(jobs)
    for i, (key, (c, twin)) in enumerate(pairs):
        mine, theirs = got[2 * i], got[2 * i + 1]
        if len(mine) != len(theirs) or not all(a.same_run(b) for a, b in zip(mine, theirs, strict=True)):
            s.apart.add(key)
            s.say(
                f"{c.flow} at TP{c.prefill_tp}->TP{c.decode_tp}: its run of {c.name} is not "
                f"{twin.flow}'s: it runs its own"
            )


def _take_runs(c: Candidate, twin: Candidate) -> None:
    """``c`` judged by ``twin``'s runs (the same simulation): its results relabelled, its maximum,
    no run of its own."""
    c.runs_of = twin.flow
    c.results = [replace(r, flow=c.flow) for r in twin.results]
    c.met = twin.met
    c.max_rps, c.max_rps_below, c.max_rps_from = twin.max_rps, twin.max_rps_below, twin.max_rps_from
    c.max_rps_runs = 0


def _for_rate(cands: list[Candidate], per: dict[str, dict[str, Any]], rate: float, s: _Search) -> Capacity:
    """Configurations by GPU count, those of one count at once: the first count where one meets
    the rate answers (the best of that count's, ``_better``)."""
    found: Candidate | None = None
    for _gpus, group in itertools.groupby(cands, key=lambda c: c.gpus):
        todo = [c for c in group if c.bound_rps >= rate]
        if not todo:
            continue
        twins = {id(c): s.twin(c, todo) for c in todo}
        own = [c for c in todo if twins[id(c)] is None]
        for c in own:
            s.say(f"{c.name} {c.flow} at {rate:g} req/s (bound {c.bound_rps:.2f})")
        got = s.runner.map([s.job(c, rate) for c in own])
        for c, rs in zip(own, got, strict=True):
            c.results = rs
            c.met = meets(rs, s.target)
        for c in todo:
            if (twin := twins[id(c)]) is not None:
                _take_runs(c, twin)
            if c.met and (found is None or _better(c, found)):
                found = c
        if found is not None:
            break
    if found is None:
        return Capacity(rate, s.target, cands, None, _none_reason(cands, rate), per)
    s.say(f"most {found.name} {found.flow} sustains")
    found.max_rps, found.max_rps_below = s.narrow(found, rate, found.bound_rps)
    return Capacity(rate, s.target, cands, found, _answer_reason(found, cands, rate), per)


def _balanced(
    cands: list[Candidate], per: dict[str, dict[str, Any]], max_instances: int, s: _Search
) -> Capacity:
    """No rate: the most each balanced configuration (per prefill count, the fewest decode
    instances whose bound covers the prefill instances') sustains. They go by instance count, so
    each starts from what is known: from below, the same TP pair and flow's next smaller
    configuration's rate (more instances never serve less); as a guess, the share of its bound
    that a configuration of as many prefill instances and the same limit sustained (another flow),
    else that smaller one's share."""
    balanced = []
    for c in cands:
        b = per[f"TP{c.prefill_tp}->TP{c.decode_tp} {c.flow}"]
        want = min(
            max_instances, max(1, math.ceil(c.prefill * b["prefill_rps"] / max(1e-9, b["decode_rps"])))
        )
        if c.decode == want:
            balanced.append(c)
    order = sorted(balanced, key=lambda c: (c.prefill, c.decode))
    # The same TP pair and flow's next smaller one, whose rate each starts from.
    prev: list[int | None] = []
    last: dict[tuple[int, int, str], int] = {}
    for i, c in enumerate(order):
        kind = (c.prefill_tp, c.decode_tp, c.flow)
        prev.append(last.get(kind))
        last[kind] = i
    at = {id(c): i for i, c in enumerate(order)}
    steps = InOrder(len(order), parallel=s.runner.jobs > 1)

    def narrow(i: int) -> None:
        c, lo, src = order[i], 0.0, ""
        if (twin := s.twin(c, order[:i])) is not None:
            steps.wait(at[id(twin)])
            _take_runs(c, twin)
            return
        j = prev[i]
        if j is not None:
            steps.wait(j)
            p = order[j]
            if p.max_rps and p.decode <= c.decode:
                lo, src = p.max_rps, p.name
        guess = _guess(c, lo, order[:i], lambda o: steps.wait(at[id(o)]))
        s.say(f"most {c.name} {c.flow} sustains (bound {c.bound_rps:.2f} req/s)")
        runs = [0]
        got, below = s.narrow(c, lo, c.bound_rps, runs=runs, guess=guess)
        if steps.stopped:
            return
        c.max_rps, c.max_rps_below, c.max_rps_runs = got, below, runs[0]
        c.max_rps_from = src if got == lo and src else ""

    steps.run(narrow)
    best, why = _best_per_gpu(cands)
    return Capacity(None, s.target, cands, best, why, per)


def _guess(c: Candidate, lo: float, before: Sequence[Candidate], wait: Callable[[Candidate], None]) -> float:
    """Where ``c``'s maximum rate likely lies, a rate to try first (0: none known, bisect), at
    least ``lo`` (then: just above it), as a share of its bound:

    - the last 5% below its bound, when its own flow's two latest smaller configurations limited
      alike both sustained theirs (``_at_bound``): its chain has reached its roofline;
    - else the share that the latest of ``before`` with as many prefill instances and the same
      limiting side sustained (another flow limited alike);
    - else the share of that side's configurations of fewer prefill instances, drawn through the
      latest two (``_share_at``);
    - else, with a rate known from below (``lo``), the share that the latest configuration of as
      many prefill instances sustained, whatever limited it: the first configuration of a side
      (pull's at eight decode instances) otherwise starts just above ``lo`` and bisects up from
      there, far below where any flow at this count ended (six runs where five do).

    ``wait(o)`` before reading ``o``'s result (a search narrowing several at once)."""
    if near := _at_bound(c, before, wait):
        return max(lo, near)
    for o in reversed(before):
        if o.prefill == c.prefill and o.limit == c.limit:
            wait(o)
            if o.max_rps:
                return max(lo, o.max_rps / o.bound_rps * c.bound_rps)
    seen: list[tuple[int, float]] = []  # (prefill instances, share): the latest per count, newest first
    for o in reversed(before):
        if o.limit == c.limit and o.prefill < c.prefill and all(o.prefill != p for p, _ in seen):
            wait(o)
            if o.max_rps:
                seen.append((o.prefill, o.max_rps / o.bound_rps))
                if len(seen) == 2:
                    break
    if seen:
        return max(lo, _share_at(c.prefill, seen) * c.bound_rps)
    if lo > 0:
        # Not for the very first configurations (no ``lo``): there it measured no fewer runs, and
        # it would make them wait for each other instead of starting side by side.
        for o in reversed(before):
            if o.prefill == c.prefill:
                wait(o)
                if o.max_rps:
                    return max(lo, o.max_rps / o.bound_rps * c.bound_rps)
    return lo


def _at_bound(c: Candidate, before: Sequence[Candidate], wait: Callable[[Candidate], None]) -> float:
    """``c``'s bound less 5%, when the two latest smaller configurations of its own TP pair, flow
    and limiting side (of distinct prefill counts) each sustained the last 5% below their bound;
    else 0. Such a chain has reached its roofline, and the next one most likely does too (ring
    and pinned from five instances a side). It reads only its own flow's results, which its
    narrowing waits for anyway, so ring and pinned of as many instances narrow side by side
    rather than one after the other: their last and costliest runs ran alone on one worker."""
    seen: list[int] = []
    for o in reversed(before):
        if not (_same_kind(o, c) and o.limit == c.limit and o.prefill < c.prefill) or o.prefill in seen:
            continue
        wait(o)
        if not o.max_rps or o.max_rps * (1 + _TOL) < o.bound_rps * (1 - 1e-9):
            return 0.0
        seen.append(o.prefill)
        if len(seen) == 2:
            return c.bound_rps / (1 + _TOL)
    return 0.0


def _share_at(p: int, seen: Sequence[tuple[int, float]]) -> float:
    """The share of its bound that ``p`` instances likely sustain, from what fewer did (newest
    first). More instances of a side smooth its Poisson arrivals, so they keep more of their bound
    busy within the same SLO: by Kingman's formula the share lost to queueing falls about as
    1/(1 + a p), so 1/share is about linear in 1/p. Two points draw that line; one, or two that do
    not rise, give the newest share. Never above the bound."""
    (p1, y1), *rest = seen
    if not rest or (rest[0][1] - y1) * (rest[0][0] - p1) <= 0:  # no share rising with p
        return y1
    p2, y2 = rest[0]
    slope = (1 / y1 - 1 / y2) / (1 / p1 - 1 / p2)
    inverse = 1 / y1 + slope * (1 / p - 1 / p1)
    return 1.0 if inverse <= 1 else 1 / inverse


def _best_per_gpu(cands: Sequence[Candidate]) -> tuple[Candidate | None, str]:
    """The configuration sustaining the most requests per GPU. Each maximum is known only within
    its narrowing's interval (a rate met, one missed), so those that could match the highest (their
    missed rate per GPU above its met one) tie with it: the least staging memory wins, as in the
    search for a rate, and the reason names the ties."""
    sized = [c for c in cands if c.max_rps]
    if not sized:
        return None, "no configuration sustains any rate within the SLOs"
    top = max(sized, key=lambda c: (c.max_rps or 0.0) / c.gpus)
    floor = (top.max_rps or 0.0) / top.gpus
    ties = [c for c in sized if (c.max_rps_below or c.max_rps or 0.0) / c.gpus > floor or c is top]
    # A configuration judged by another's runs (``runs_of``) ties with it: that one is named.
    best = min(ties, key=lambda c: (c.staging_bytes, -(c.max_rps or 0.0) / c.gpus, bool(c.runs_of)))
    per_gpu = (best.max_rps or 0.0) / best.gpus
    why = (
        f"most requests per second per GPU: {best.name} with {best.flow}, {per_gpu:.3f} a GPU; "
        f"sustains {_sustains(best)}"
    )
    others = sorted(
        (c for c in ties if c is not best and not c.runs_of), key=lambda c: -(c.max_rps or 0.0) / c.gpus
    )
    if others:
        said = ", ".join(f"{c.name} with {c.flow} ({(c.max_rps or 0.0) / c.gpus:.3f})" for c in others[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        why += (
            f"; tied within the narrowing's intervals with {said}{more}: chosen for less staging "
            f"memory ({best.staging_bytes / 2**20:.0f} MiB a rank pair), then the most a GPU"
        )
    return best, why + _twins_note(best, cands)


def _where(c: Candidate) -> tuple[int, int, int, int]:
    """A configuration but its flow."""
    return (c.prefill_tp, c.decode_tp, c.prefill, c.decode)


def _twins(a: Candidate, b: Candidate) -> bool:
    """One configuration judged by the other's runs (``Candidate.runs_of``)."""
    return _where(a) == _where(b) and (a.runs_of == b.flow or b.runs_of == a.flow)


def _twins_note(c: Candidate, cands: Sequence[Candidate]) -> str:
    names = sorted({o.flow for o in cands if o is not c and _twins(o, c)})
    if not names:
        return ""
    flows = " and ".join(names)
    return f"; {flows} ran as {c.flow} here (the same simulation), so {c.name} with {flows} does as well"


def _same_kind(a: Candidate, b: Candidate) -> bool:
    return (a.prefill_tp, a.decode_tp, a.flow) == (b.prefill_tp, b.decode_tp, b.flow)


def _every_max_rate(
    chosen: Sequence[Candidate], cands: Sequence[Candidate], rate: float | None, s: _Search
) -> None:
    """The most each ``chosen`` configuration sustains, narrowed by steady-state runs (``max_rate``) inside
    what is already known of it: from below, the most a configuration with no more instances of
    either side (same TP pair and flow) was seen to sustain, or the asked rate if it met it; from
    above, its bound, the asked rate if it missed it, and the least that a configuration with no
    fewer instances of either side could not sustain. Configurations go smallest first so each
    starts from its smaller neighbours' results (``cands``: all of them, ``chosen`` among them);
    an interval already within 5% takes no run."""
    seeds = [c for c in cands if c.max_rps is not None]  # the answer's, narrowed already
    order = sorted(
        (c for c in chosen if c.max_rps is None),
        key=lambda c: (c.prefill_tp, c.decode_tp, c.flow, c.prefill, c.decode),
    )
    at = {id(c): i for i, c in enumerate(order)}
    steps = InOrder(len(order), parallel=s.runner.jobs > 1)

    def narrow(i: int) -> None:
        c = order[i]
        if (twin := s.twin(c, seeds + order[:i])) is not None:
            if id(twin) in at:
                steps.wait(at[id(twin)])
            _take_runs(c, twin)
            return
        lo, src = (rate, "") if c.met and rate is not None else (0.0, "")
        hi = c.bound_rps if c.met is not False or rate is None else min(c.bound_rps, rate)
        for o in cands:
            if o is c or not _same_kind(o, c):
                continue
            j = at.get(id(o))
            if j is not None and j > i:
                # Narrowed after this one in order: nothing known of its rates yet.
                max_rps, below = None, None
            else:
                if j is not None:
                    steps.wait(j)
                max_rps, below = o.max_rps, o.max_rps_below
            if o.prefill <= c.prefill and o.decode <= c.decode and (max_rps or 0.0) > lo:
                lo, src = max_rps or 0.0, o.name
            if o.prefill >= c.prefill and o.decode >= c.decode:
                if below is not None:
                    hi = min(hi, below)
                if o.met is False and rate is not None:
                    hi = min(hi, rate)
        if lo >= hi:  # the seeds' noise against the assumption: start from this one's own results
            lo, src = (rate, "") if c.met and rate is not None else (0.0, "")
            hi = c.bound_rps if c.met is not False or rate is None else min(c.bound_rps, rate)
        runs = [0]
        if lo == 0.0 or hi - lo > 0.05 * lo:
            s.say(f"most {c.name} {c.flow} sustains: between {lo:.2f} and {hi:.2f} req/s")
        guess = _guess(c, lo, seeds + order[:i], lambda o: steps.wait(at[id(o)]) if id(o) in at else None)
        got, below_c = s.narrow(c, lo, hi, quiet=True, runs=runs, guess=guess)
        if steps.stopped:
            return
        c.max_rps, c.max_rps_below, c.max_rps_runs = got, below_c, runs[0]
        c.max_rps_from = src if got == lo and src else ""

    steps.run(narrow)


def _p99(c: Candidate) -> float:
    return Interval.of([r.ttft_ms.p99 for r in c.results]).mean


def _better(a: Candidate, b: Candidate) -> bool:
    """Among configurations of as many GPUs: lower TTFT p99 (beyond the seeds' interval), then
    less staging memory."""
    ia = Interval.of([r.ttft_ms.p99 for r in a.results])
    ib = Interval.of([r.ttft_ms.p99 for r in b.results])
    tie = ia.overlaps(ib) if ia.n > 1 else abs(ia.mean - ib.mean) <= 0.05 * max(ia.mean, ib.mean)
    if not tie:
        return ia.mean < ib.mean
    # A configuration judged by another's runs (``runs_of``) ties with it: that one answers.
    return (a.staging_bytes, bool(a.runs_of)) < (b.staging_bytes, bool(b.runs_of))


def _answer_reason(c: Candidate, cands: Sequence[Candidate], rate: float) -> str:
    r = c.results
    ttft = Interval.of([x.ttft_ms.p50 for x in r]), Interval.of([x.ttft_ms.p99 for x in r])
    tpot = Interval.of([x.tpot_ms.p50 for x in r]), Interval.of([x.tpot_ms.p99 for x in r])
    att = Interval.of([x.slo_attained for x in r])
    cheaper = [x for x in cands if x.gpus < c.gpus]
    tried = sum(1 for x in cheaper if x.met is not None)
    also = [x for x in cands if x is not c and x.gpus == c.gpus and x.met and not x.runs_of]
    tie = ""
    if also:
        said = ", ".join(
            f"{x.name} with {x.flow} (TTFT p99 {_p99(x):.0f} ms, {x.staging_bytes / 2**20:.0f} MiB staging)"
            for x in also
        )
        tie = (
            f". At the same cost {said} also meet the rate; the answer has the lower TTFT p99 beyond "
            f"the noise or, within it (a tie), less staging memory ({c.staging_bytes / 2**20:.0f} MiB, "
            f"TTFT p99 {_p99(c):.0f} ms)"
        )
    return (
        f"{c.name} with {c.flow} ({c.gpus} GPUs) serves {rate:g} req/s: TTFT p50 {ttft[0].text()} ms / "
        f"p99 {ttft[1].text()} ms, TPOT p50 {tpot[0].text('.1f')} ms / p99 {tpot[1].text('.1f')} ms, "
        f"{att.mean:.0%} within the SLOs; sustains {_sustains(c)}. Of {len(cheaper)} "
        f"cheaper configurations, {len(cheaper) - tried} cannot reach the rate by their roofline "
        f"bound and {tried} missed it in simulation{tie}{_twins_note(c, cands)}"
    )


def _sustains(c: Candidate) -> str:
    """The most a configuration sustains, as the search bracketed it."""
    lo, hi = c.max_rps or 0.0, c.max_rps_below
    if hi is None:
        return f"{lo:.2f} req/s"
    what = "its roofline bound" if hi >= c.bound_rps else "a rate it missed"
    return f"at least {lo:.2f} req/s and less than {hi:.2f} ({what})"


def _none_reason(cands: Sequence[Candidate], rate: float) -> str:
    best = max(cands, key=lambda c: c.bound_rps, default=None)
    if best is None:
        return "no configuration fits the GPU limit"
    return (
        f"no configuration within the limits meets {rate:g} req/s; the largest bound is "
        f"{best.bound_rps:.2f} req/s ({best.name}): more instances (--max-instances, --max-gpus) or "
        "a larger TP"
    )
