"""A selection as a table, as JSON, and as PNG plots (matplotlib, an optional dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvferry.core.errors import KvferryError
from kvferry.sim.deploy.metrics import SPLIT_DOC, SPLIT_KEYS
from kvferry.sim.deploy.select import Selection

__all__ = ["PlotError", "plot", "table"]


class PlotError(KvferryError, RuntimeError):
    """Plots asked for without matplotlib installed."""


def table(sel: Selection, console: Any) -> None:
    from rich.table import Table

    sp = sel.spec
    counts = (
        f"{sp.prefill_instances} x " if sp.prefill_instances > 1 or sp.decode_instances > 1 else "",
        f"{sp.decode_instances} x " if sp.prefill_instances > 1 or sp.decode_instances > 1 else "",
    )
    t = Table(
        title=f"flows for {sp.model}, {counts[0]}prefill TP {sp.prefill_tp} -> {counts[1]}decode TP "
        f"{sp.decode_tp}, {sp.gpu} + {sp.nic}"
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
        for r in sel.results[flow]:
            note = (
                ""
                if not (r.failed or r.unfinished or r.violations)
                else f" ({r.failed} failed, {r.unfinished} unfinished, {len(r.violations)} violations)"
            )
            if r.retractions:
                note += f" ({r.retractions} retracted: decode out of pages)"
            if r.growth_short:
                note += f" (decode out of pages {r.growth_short}x: optimistic)"
            t.add_row(
                str(rank),
                flow,
                r.label,
                f"{r.ttft_ms.p50:.0f} / {r.ttft_ms.p99:.0f}",
                f"{r.tpot_ms.p50:.1f} / {r.tpot_ms.p99:.1f}",
                f"{r.e2e_ms.p50 / 1000:.2f}",
                f"{r.transfer_ms.p50:.1f}",
                f"{r.slo_attained:.0%} ({r.goodput_rps:.1f}/s){note}",
                f"{sum(r.extra_memory_bytes.values()) / 2**20:.0f}",
            )
    t.caption = (
        "SLO met: requests within both SLOs (goodput, requests/s); extra MiB: staging a prefill rank "
        "and a decode rank register (ring, pinned pools, worker buffers); --json has p90s and means"
    )
    console.print(t)
    s = Table(title="transfer time split (mean ms per request, heaviest load)")
    s.add_column("flow")
    for k in SPLIT_KEYS:
        s.add_column(k)
    for flow in sel.ranking:
        r = sel.results[flow][-1]
        s.add_row(flow, *(f"{r.split_ms[k]:.2f}" for k in SPLIT_KEYS))
    console.print(s)
    console.print("; ".join(f"{k}: {v}" for k, v in SPLIT_DOC.items()), style="dim")
    console.print(f"[bold]recommendation: {sel.recommendation}[/] -- {sel.reason}")
    for k, v in sel.knobs.items():
        console.print(f"  {k}: {v}")


def plot(sel: Selection, path: Path) -> None:
    """Two panels: TTFT p50 against the load points per flow, and the transfer time split."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib: pip install 'kvferry[plots]' (or uv sync --group dev)"
        ) from None
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
