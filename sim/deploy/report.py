"""A selection as a table, as JSON, and as PNG plots (matplotlib, an optional dependency)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvferry.core.errors import KvferryError
from kvferry.sim.deploy.capacity import Candidate, Capacity
from kvferry.sim.deploy.metrics import SPLIT_DOC, SPLIT_KEYS, DeployResult
from kvferry.sim.deploy.select import Selection
from kvferry.sim.deploy.steady import Interval

__all__ = ["PlotError", "capacity_table", "plot", "plot_capacity", "table"]


class PlotError(KvferryError, RuntimeError):
    """Plots asked for without matplotlib installed."""


def table(sel: Selection, console: Any) -> None:
    """The flows ranked (a row per load point), the transfer time split, and what a reader
    must know besides: overloads, failures, a tie, the recommendation and its knobs."""
    console.print(_flows_table(sel))
    console.print(_split_table(sel))
    console.print("; ".join(f"{k}: {v}" for k, v in SPLIT_DOC.items()), style="dim")
    _notes(sel, console)
    if sel.interrupted:
        console.print(f"[yellow]{sel.interrupted}[/]")
    for flow, of in sel.runs_of.items():
        console.print(
            f"{flow}: the same simulation as {of} here (its first run was {of}'s, figure for figure; "
            f"any later ones are {of}'s)"
        )
    if sel.tie_note:
        console.print(f"tie: {sel.tie_note}")
    console.print(f"[bold]recommendation: {sel.recommendation}[/] -- {sel.reason}")
    for k, v in sel.knobs.items():
        console.print(f"  {k}: {v}")


def _flows_table(sel: Selection) -> Any:
    from rich.table import Table

    sp = sel.spec
    counts = (
        f"{sp.prefill_instances} x " if sp.prefill_instances > 1 or sp.decode_instances > 1 else "",
        f"{sp.decode_instances} x " if sp.prefill_instances > 1 or sp.decode_instances > 1 else "",
    )
    t = Table(
        title=f"flows for {sp.model}, {counts[0]}prefill TP {sp.prefill_tp} -> {counts[1]}decode TP "
        f"{sp.decode_tp}, {sp.gpu} + {sp.nic} ({_transport(sp.nic)})"
        + (f", control path of {sp.control_path}" if sp.control_path else "")
    )
    for col in (
        "#",
        "flow",
        "load",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
        "E2E p50 s",
        "xfer p50 ms",
        "SLO met",
        "extra MiB",
    ):
        t.add_column(col)
    for rank, flow in enumerate(sel.ranking, start=1):
        per_seed = sel.runs.get(flow) or [[r] for r in sel.results[flow]]
        for r, rs in zip(sel.results[flow], per_seed, strict=True):
            t.add_row(*(_seeded_row(rank, flow, rs) if len(rs) > 1 else _row(rank, flow, r)))
    t.caption = (
        "SLO met: requests within both SLOs (goodput, requests/s); extra MiB: staging a prefill rank "
        "and a decode rank register (ring, pinned pools, worker buffers); --json has p90s and means"
        + _groups_note([sp])
    )
    return t


def _groups_note(specs: Sequence[Any]) -> str:
    """Says when the runs of ``specs`` simulated one of an instance pair's identical TP groups,
    not every rank; with the count when they all had as many."""
    counts = {1 if s.every_rank else s.rank_groups() for s in specs}
    if max(counts, default=1) < 2:
        return ""
    many = f"{counts.pop()} " if len(counts) == 1 else ""
    return f"; transfers ran on one of each instance pair's {many}identical TP groups (--every-rank: all)"


def _row(rank: int, flow: str, r: DeployResult) -> list[str]:
    """A table row of one load point's run."""
    counts = ((r.failed, "failed"), (r.unfinished, "unfinished"), (len(r.violations), "violations"))
    said = ", ".join(f"{n} {what}" for n, what in counts if n)
    note = f" ({said})" if said else ""
    if r.retractions:
        note += f" ({r.retractions} retracted: decode out of pages)"
    if r.growth_short:
        note += f" (decode out of pages {r.growth_short}x: optimistic)"
    if r.overload:
        note += " OVERLOADED"
    return [
        str(rank),
        flow,
        r.label,
        f"{_n(r.ttft_ms.p50)} / {_n(r.ttft_ms.p99)}",
        f"{_n(r.tpot_ms.p50, '.1f')} / {_n(r.tpot_ms.p99, '.1f')}",
        _n(r.e2e_ms.p50 / 1000, ".2f"),
        _n(r.transfer_ms.p50, ".1f"),
        f"{r.slo_attained:.0%} ({r.goodput_rps:.1f}/s){note}",
        f"{sum(r.extra_memory_bytes.values()) / 2**20:.0f}",
    ]


def _split_table(sel: Selection) -> Any:
    from rich.table import Table

    s = Table(title="transfer time split (mean ms per request, heaviest load)")
    s.add_column("flow")
    for k in SPLIT_KEYS:
        s.add_column(k)
    for flow in sel.ranking:
        r = sel.results[flow][-1]
        s.add_row(flow, *(f"{r.split_ms[k]:.2f}" for k in SPLIT_KEYS))
    return s


def _notes(sel: Selection, console: Any) -> None:
    """Each load point's overload in words and its failed requests' reasons, most first."""
    for flow in sel.ranking:
        for rs in sel.runs.get(flow) or [[r] for r in sel.results[flow]]:
            said = next((r.overload for r in rs if r.overload), "")
            if said:
                console.print(f"[yellow]{flow} at {rs[0].label}: {said}[/]")
            reasons: dict[str, int] = {}
            for r in rs:
                for k, v in r.failure_reasons.items():
                    reasons[k] = reasons.get(k, 0) + v
            if reasons:
                why = "; ".join(f"{n} x {k}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
                console.print(f"[yellow]{flow} at {rs[0].label}: failed requests: {why}[/]")


def _transport(nic: str) -> str:
    from kvferry.sim.deploy import hardware

    p = hardware.nic(nic)
    est = f", estimated: {', '.join(p.estimates)}" if p.estimates else ""
    return f"{p.transport}, {p.post_cost_us:g} us a post + {p.per_desc_us:g} us a descriptor{est}"


def _n(x: float, fmt: str = ".0f") -> str:
    """A number, or "-" for none (a percentile of no requests)."""
    return "-" if math.isnan(x) else format(x, fmt)


def _seeded_row(rank: int, flow: str, rs: list[Any]) -> list[str]:
    """A table row of one load point over several seeds: means +- 95% intervals."""

    def iv(get: Any, fmt: str = ".0f") -> str:
        return Interval.of([get(r) for r in rs]).text(fmt)

    att = Interval.of([r.slo_attained for r in rs])
    bad = " OVERLOADED" if any(r.overload for r in rs) else ""
    return [
        str(rank),
        flow,
        f"{rs[0].label} ({len(rs)} seeds)",
        f"{iv(lambda r: r.ttft_ms.p50)} / {iv(lambda r: r.ttft_ms.p99)}",
        f"{iv(lambda r: r.tpot_ms.p50, '.1f')} / {iv(lambda r: r.tpot_ms.p99, '.1f')}",
        iv(lambda r: r.e2e_ms.p50 / 1000, ".2f"),
        iv(lambda r: r.transfer_ms.p50, ".1f"),
        f"{att.mean:.0%} +- {att.half:.0%}{bad}",
        f"{sum(rs[0].extra_memory_bytes.values()) / 2**20:.0f}",
    ]


def capacity_table(cap: Capacity, spec: Any, console: Any) -> None:
    """The configurations simulated (with their verdict at the rate, or their maximum rate), the
    count of those whose roofline bound rules them out, and the answer."""
    from rich.table import Table

    rate = cap.rate
    title = (
        f"capacity for {rate:g} req/s" if rate is not None else "maximum sustainable rate per configuration"
    ) + (
        f": {spec.model}, {spec.gpu} + {spec.nic} ({_transport(spec.nic)}), "
        f"SLOs TTFT {spec.ttft_slo_ms:g} ms / TPOT "
        f"{spec.tpot_slo_ms:g} ms for {cap.target:.0%} of requests"
    )
    console.print(title, style="bold")  # above the table, not its title: that wraps at its width
    t = Table()
    # Without a rate no run is judged at one: its latency, SLO and verdict columns would be all
    # "-", and a terminal of 80 columns then folds every row into four lines.
    at_rate = rate is not None
    cols = _AT_RATE_COLUMNS if at_rate else _MAX_RATE_COLUMNS
    for col in cols:
        t.add_column(col)
    for c in cap.candidates:
        if c.met is not None or c.max_rps is not None:
            row = _capacity_row(cap, c)
            t.add_row(*(row if at_rate else [*(row[i] for i in _MAX_RATE_CELLS), _per_gpu(c)]))
    console.print(t)
    # Under the table, not its caption: a caption wraps at the table's width, a few words a line.
    console.print(_capacity_caption(cap, spec))
    for name, b in cap.bounds.items():
        console.print(
            f"  per instance, {name}: prefill at most {b['prefill_rps']:.2f} req/s ({b['prefill_by']}), "
            f"decode at most {b['decode_rps']:.2f} req/s ({b['decode_by']}, batch {b['decode_batch']:.0f})",
            style="dim",
        )
    style = "bold" if cap.answer is not None else "bold yellow"
    console.print(f"[{style}]answer: {cap.reason}[/]")


_AT_RATE_COLUMNS = ("configuration", "GPUs", "flow", "bound req/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                    "SLO met", "max req/s", "verdict")  # fmt: skip
# Of a row, the cells a search without a rate fills, named rather than counted.
_MAX_RATE_CELLS = tuple(
    _AT_RATE_COLUMNS.index(c) for c in ("configuration", "GPUs", "flow", "bound req/s", "max req/s")
)
# and the most a GPU, which the answer without a rate maximises
_MAX_RATE_COLUMNS = (*(_AT_RATE_COLUMNS[i] for i in _MAX_RATE_CELLS), "req/s a GPU")


def _per_gpu(c: Candidate) -> str:
    return "-" if c.max_rps is None else f"{c.max_rps / c.gpus:.3f}"


def _capacity_row(cap: Capacity, c: Candidate) -> list[str]:
    """A simulated configuration's row: its bound, latencies and SLO share over its seeds at the
    rate, its maximum rate, its verdict (``*``: the answer)."""
    rs = c.results
    ttft = (
        f"{Interval.of([r.ttft_ms.p50 for r in rs]).text()} / "
        f"{Interval.of([r.ttft_ms.p99 for r in rs]).text()}"
        if rs
        else "-"
    )
    tpot = (
        f"{Interval.of([r.tpot_ms.p50 for r in rs]).text('.1f')} / "
        f"{Interval.of([r.tpot_ms.p99 for r in rs]).text('.1f')}"
        if rs
        else "-"
    )
    att = f"{Interval.of([r.slo_attained for r in rs]).mean:.0%}" if rs else "-"
    most = (
        "-"
        if c.max_rps is None
        else f"{c.max_rps:.2f}"
        + ("" if c.max_rps_below is None else f"-{c.max_rps_below:.2f}")
        + (" ^" if c.max_rps_from else "")
    )
    mark = " *" if cap.answer is c else ""
    bound = f"{c.bound_rps:.2f} ({c.limit})"
    flow = f"{c.flow} (={c.runs_of})" if c.runs_of else c.flow
    return [c.name + mark, str(c.gpus), flow, bound, ttft, tpot, att, most, c.verdict(cap.rate)]


def _capacity_caption(cap: Capacity, base: Any) -> str:
    rate = cap.rate
    ran = [c.spec(base) for c in cap.candidates if c.met is not None or c.max_rps is not None]
    ruled = sum(1 for c in cap.candidates if c.met is None and c.max_rps is None)
    return (
        f"bound: the most a configuration could finish at full use of its GPUs (roofline); "
        f"{ruled} more configurations not simulated"
        + (f" (bound below {rate:g} req/s, or more GPUs than the answer)" if rate is not None else "")
        + "; max req/s: the highest rate a steady-state run met - the lowest one missed (or the bound)"
        + (
            " (^: no run of its own met more; the lower end is what a configuration with no more "
            "instances sustained)"
            if any(c.max_rps_from for c in cap.candidates)
            else ""
        )
        + "".join(
            f"; {f} (={of}): {of}'s runs stand for {f}'s (its registration costs no host work on this NIC)"
            for f, of in sorted({(c.flow, c.runs_of) for c in cap.candidates if c.runs_of})
        )
        + _groups_note(ran)
    )


def plot_capacity(cap: Capacity, spec: Any, path: Path) -> None:
    """Maximum sustainable rate against GPUs per flow (log axes): the roofline bound hollow, the
    simulated maximum filled, each flow's markers offset so none hides another's."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    flows = sorted({c.flow for c in cap.candidates})
    markers = "osD^vP"
    for i, flow in enumerate(flows):
        cs = [c for c in cap.candidates if c.flow == flow]
        shift = 1 + 0.03 * (i - (len(flows) - 1) / 2)
        m = markers[i % len(markers)]
        ax.scatter([c.gpus * shift for c in cs], [c.bound_rps for c in cs], marker=m, facecolors="none",
                   edgecolors=f"C{i}", alpha=0.35, s=28, label=f"{flow}: bound")  # fmt: skip
        sim = [c for c in cs if c.max_rps]
        if sim:
            took = {c.runs_of for c in sim}  # the flow whose runs it took ("": its own)
            name = f"{flow} (={took.pop()})" if len(took) == 1 and "" not in took else flow
            ax.scatter([c.gpus * shift for c in sim], [c.max_rps for c in sim], marker=m, color=f"C{i}",
                       s=46, label=f"{name}: simulated max")  # fmt: skip
    if cap.rate is not None:
        ax.axhline(cap.rate, color="k", linestyle=":", label=f"{cap.rate:g} req/s asked")
    if cap.answer is not None:
        ax.scatter([cap.answer.gpus], [cap.answer.max_rps or cap.rate or 0], marker="*", s=260,
                   color="gold", edgecolors="k", zorder=5, label=f"answer: {cap.answer.name}")  # fmt: skip
    from matplotlib.ticker import LogFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        # Axes spanning a decade or two label some minor ticks too, as plain numbers (20, 30),
        # not matplotlib's default 2x10^1.
        axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("requests/s sustained within the SLOs")
    ax.set_title(f"{spec.model} on {spec.gpu} + {spec.nic}: capacity per configuration and flow")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib: pip install 'kvferry[plots]' (or uv sync --group dev)"
        ) from None
    return plt


def plot(sel: Selection, path: Path) -> None:
    """Two panels: TTFT p50 against the load points per flow, and the transfer time split."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for flow in sel.ranking:
        rs = sel.results[flow]
        xs = list(range(len(rs)))
        a.plot(xs, [r.ttft_ms.p50 for r in rs], marker="o", label=f"{flow} p50")
        a.plot(xs, [r.ttft_ms.p99 for r in rs], marker="x", linestyle="--", label=f"{flow} p99")
        a.set_xticks(xs, [r.label for r in rs], rotation=30, ha="right")
    a.set_ylabel("TTFT (ms)")
    a.set_yscale("log")
    a.set_title("TTFT per flow")
    a.legend(fontsize=8)
    bottom = [0.0] * len(sel.ranking)
    for k in SPLIT_KEYS:
        vals = [sel.results[f][-1].split_ms[k] for f in sel.ranking]
        b.bar(sel.ranking, vals, bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    b.set_ylabel("ms per request (mean)")
    b.set_title(f"transfer time split at {sel.results[sel.ranking[0]][-1].label}")
    b.legend(fontsize=8)
    fig.suptitle(
        f"{sel.spec.model} TP{sel.spec.prefill_tp} -> TP{sel.spec.decode_tp} on "
        f"{sel.spec.gpu} + {sel.spec.nic}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # whatever the name ends with: --plot writes PNG
    plt.close(fig)
