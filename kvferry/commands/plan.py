"""``kvferry plan``: plan one room's KV transfer between a prefill and a decode server, and count it."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import numpy as np
import typer

from kvferry.commands import MAX_SEED, bad_input
from kvferry.commands.options import Json
from kvferry.core.errors import KvferryError
from kvferry.core.flows.summary import staged_summary
from kvferry.core.geometry import PRESETS, DType, Layout, ModelGeometry, links, make_pools
from kvferry.core.messages import MAX_PAGES
from kvferry.core.planner import RankPlan, plan_rank_pair
from kvferry.core.staging_layout import StagingFormat, plan_staged_room

# Bounds that keep one `kvferry plan` to seconds and about a GB; past them it would allocate tens
# of GB (--tokens 99999999999: 46 GiB of page ids) or walk ranks and heads for hours.
MAX_TP = 1024  # links() walks every head for every rank; no deployment shards a model wider
MAX_LAYERS = 1024  # a pool holds a region object per layer and kind; real models have < 200 layers
MAX_KV_HEADS = 1024  # links() walks every head; real models have at most 128 KV heads
# tokens x regions x head groups: the descriptors the planner may write unmerged (its cost is
# linear in them; at this bound qwen3-8b TP8->1, fragmented, took 4 s and 1.2 GB).
MAX_DESCRIPTORS = 1 << 28
# --fragmented: scattered pages x regions, the page runs the planner holds at once (~32 bytes
# each: deepseek-v3 with 2M scattered pages of 1 token took 4 GB); at this bound 4 s and 1.2 GB.
MAX_SCATTERED_RUNS = 1 << 25
# A rank's pool is one registered range of virtual memory: past 2**48 bytes (the 48-bit address
# space of x86-64 and ARM64) it cannot exist, and its byte offsets would near int64 overflow.
MAX_POOL_BYTES = 1 << 48


def build_model(
    model: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype: DType | None,
    mla: bool | None,
) -> ModelGeometry:
    """A preset, with any explicit flag overriding it; without a preset all of shape must be given."""
    if model is not None:
        base = ModelGeometry.preset(model)
    else:
        missing = [
            n
            for n, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim))
            if v is None
        ]
        if missing:
            raise typer.BadParameter(f"give --model or all of {', '.join(missing)}")
        base = None
    return ModelGeometry(
        name=_model_name(model, layers, kv_heads, head_dim, mla),
        num_layers=layers if layers is not None else base.num_layers,  # type: ignore[union-attr]
        num_kv_heads=kv_heads if kv_heads is not None else base.num_kv_heads,  # type: ignore[union-attr]
        head_dim=head_dim if head_dim is not None else base.head_dim,  # type: ignore[union-attr]
        dtype=dtype if dtype is not None else (base.dtype if base else DType.BF16),
        is_mla=mla if mla is not None else (base.is_mla if base else False),
    )


def _model_name(
    model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None, mla: bool | None
) -> str:
    if model is None:
        return "custom"
    reshaped = any(v is not None for v in (layers, kv_heads, head_dim, mla))
    return f"{model} (modified)" if reshaped else model


def check_bounds(
    model: ModelGeometry,
    prefill_tp: int,
    decode_tp: int,
    prefill_page_size: int,
    decode_page_size: int,
    tokens: int,
    fragmented: bool,
) -> None:
    """Raise typer.BadParameter, naming the limit, before planning a room past the bounds above."""
    for side, tp in (("--prefill-tp", prefill_tp), ("--decode-tp", decode_tp)):
        if tp > MAX_TP:
            raise typer.BadParameter(f"{side} {tp}: kvferry plan handles TP up to {MAX_TP}")
    if model.num_layers > MAX_LAYERS:
        raise typer.BadParameter(f"{model.num_layers} layers: kvferry plan handles up to {MAX_LAYERS}")
    if model.num_kv_heads > MAX_KV_HEADS:
        raise typer.BadParameter(f"{model.num_kv_heads} KV heads: kvferry plan handles up to {MAX_KV_HEADS}")
    for side, ps in (("prefill", prefill_page_size), ("decode", decode_page_size)):
        pages = -(-tokens // ps)
        if pages > MAX_PAGES:
            raise typer.BadParameter(
                f"--tokens {tokens:,} is {pages:,} {side} pages of {ps}; a room has at most "
                f"{MAX_PAGES:,} pages (MAX_PAGES, the most one transfer can name)"
            )
        pool = (2 if fragmented else 1) * pages * ps * model.token_bytes
        if pool > MAX_POOL_BYTES:
            raise typer.BadParameter(
                f"the {side} server's pool would be {pool:,} bytes (page size {ps}, "
                f"{model.token_bytes:,} bytes a token); past 2**48 bytes no pool can be registered"
            )
    pages = -(-tokens // min(prefill_page_size, decode_page_size))
    if fragmented and pages * model.num_regions > MAX_SCATTERED_RUNS:
        raise typer.BadParameter(
            f"--fragmented: {pages:,} scattered pages x {model.num_regions} regions is "
            f"{pages * model.num_regions:,} page runs; kvferry plan stops at {MAX_SCATTERED_RUNS:,} "
            f"(here at most {MAX_SCATTERED_RUNS // model.num_regions:,} pages a side)"
        )
    groups = max(model.num_kv_heads, prefill_tp, decode_tp)
    per_token = model.num_regions * groups
    if tokens * per_token > MAX_DESCRIPTORS:
        raise typer.BadParameter(
            f"--tokens {tokens:,} x {model.num_regions} regions x {groups} head groups may be "
            f"{tokens * per_token:,} descriptors; kvferry plan stops at {MAX_DESCRIPTORS:,} "
            f"(here at most {MAX_DESCRIPTORS // per_token:,} tokens)"
        )


def room_pages(
    tokens: int, page_size: int, fragmented: bool, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """(page ids, pool size): contiguous from 0, or a random subset of a pool twice as large."""
    needed = max(1, -(-tokens // page_size))
    if not fragmented:
        return np.arange(needed, dtype=np.int64), needed
    pool = 2 * needed
    return rng.permutation(pool)[:needed].astype(np.int64), pool


def make_report(
    model: ModelGeometry,
    prefill_tp: int,
    decode_tp: int,
    prefill_page_size: int,
    decode_page_size: int,
    tokens: int,
    prefill_layout: Layout,
    decode_layout: Layout,
    fragmented: bool,
    seed: int,
    chunk_tokens: int = 0,
) -> dict[str, Any]:
    """Everything ``kvferry plan`` prints, as plain JSON-able data (deterministic for a seed)."""
    _check_sizes(tokens, chunk_tokens, prefill_page_size, decode_page_size, seed)
    check_bounds(model, prefill_tp, decode_tp, prefill_page_size, decode_page_size, tokens, fragmented)
    sp, sn = room_pages(tokens, prefill_page_size, fragmented, np.random.default_rng([seed, 0]))
    dp, dn = room_pages(tokens, decode_page_size, fragmented, np.random.default_rng([seed, 1]))
    src = make_pools(model, prefill_tp, prefill_page_size, sn, prefill_layout)
    dst = make_pools(model, decode_tp, decode_page_size, dn, decode_layout)
    # Pair by pair, keeping only the counts: a whole long room's descriptor arrays can be GBs.
    all_links = links(model, prefill_tp, decode_tp)
    pairs = [
        _pair_summary(plan_rank_pair(src[x.prefill_rank], dst[x.decode_rank], sp, dp, 0, tokens))
        for x in all_links
        if not x.is_dummy
    ]
    staged = {fmt.value: plan_staged_room(src, dst, sp, dp, 0, tokens, fmt) for fmt in StagingFormat}
    flows = staged_summary(src, dst, tokens, chunk_tokens)
    return {
        "model": _model_dict(model),
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "prefill_page_size": prefill_page_size,
        "decode_page_size": decode_page_size,
        "prefill_layout": prefill_layout.value,
        "decode_layout": decode_layout.value,
        "tokens": tokens,
        "fragmented": fragmented,
        "seed": seed,
        "total_bytes": sum(p["bytes"] for p in pairs),
        "descriptors": sum(p["descriptors"] for p in pairs),
        "descriptors_unmerged": sum(p["descriptors_unmerged"] for p in pairs),
        "pairs": pairs,
        "dummies": [
            {"prefill_rank": x.prefill_rank, "decode_rank": x.decode_rank} for x in all_links if x.is_dummy
        ],
        "staged": {name: _staged_dict(s) for name, s in staged.items()},
        "flows": {
            # Direct: the planner's count for the whole room (chunking splits runs, never merges).
            "direct": {
                "descriptors": sum(p["descriptors"] for p in pairs),
                "chunks": flows["ring"]["chunks"],
            },
            "ring": flows["ring"],
            "pinned": flows["pinned"],
            "policy_choice": flows["policy_choice"],
        },
    }


def _check_sizes(
    tokens: int, chunk_tokens: int, prefill_page_size: int, decode_page_size: int, seed: int
) -> None:
    if tokens < 1:
        raise typer.BadParameter("--tokens must be at least 1")
    if chunk_tokens < 0:
        raise typer.BadParameter(f"--chunk-tokens must be >= 0, got {chunk_tokens}")
    for side, ps in (("prefill", prefill_page_size), ("decode", decode_page_size)):
        if ps < 1:
            raise typer.BadParameter(f"{side} page_size must be at least 1, got {ps}")
    if not 0 <= seed <= MAX_SEED:  # numpy's generators take non-negative seeds only
        raise typer.BadParameter(f"--seed must be in [0, 2**63 - 1], got {seed}")


def _model_dict(model: ModelGeometry) -> dict[str, Any]:
    return {
        "name": model.name,
        "layers": model.num_layers,
        "kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "dtype": model.dtype.value,
        "mla": model.is_mla,
    }


def _staged_dict(staged: Any) -> dict[str, int]:
    return {
        "descriptors": staged.count,
        "bytes": staged.total_bytes,
        "max_prefill_buffer_bytes": max((p.src_buffer_bytes for p in staged.pairs), default=0),
        "max_decode_buffer_bytes": _max_decode_buffer(staged),
    }


def _pair_summary(p: RankPlan) -> dict[str, int]:
    return {
        "prefill_rank": p.src_rank,
        "decode_rank": p.dst_rank,
        "head_start": p.head_start,
        "num_heads": p.num_heads,
        "descriptors": p.count,
        "descriptors_unmerged": p.descriptors_unmerged,
        "bytes": p.total_bytes,
    }


def _max_decode_buffer(staged: Any) -> int:
    per_rank: dict[int, int] = {}
    for p in staged.pairs:
        end = max(p.dst_buffer_bytes, p.dst_staging_offset + p.length)
        per_rank[p.dst_rank] = max(per_rank.get(p.dst_rank, 0), end)
    return max(per_rank.values(), default=0)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    m = report["model"]
    title = (
        f"{m['name']} ({m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']} {m['dtype']}"
        f"{', MLA' if m['mla'] else ''}): prefill TP {report['prefill_tp']} "
        f"(page {report['prefill_page_size']}) -> decode TP {report['decode_tp']} "
        f"(page {report['decode_page_size']}), {report['tokens']} tokens"
        f"{', fragmented seed ' + str(report['seed']) if report['fragmented'] else ''}"
    )
    table = Table(title=title)
    for col in ("prefill", "decode", "heads", "descriptors", "unmerged", "bytes"):
        table.add_column(col, justify="right")
    for p in report["pairs"]:
        table.add_row(
            str(p["prefill_rank"]),
            str(p["decode_rank"]),
            f"{p['head_start']}..{p['head_start'] + p['num_heads'] - 1}",
            f"{p['descriptors']:,}",
            f"{p['descriptors_unmerged']:,}",
            _human(p["bytes"]),
        )
    for d in report["dummies"]:
        table.add_row(str(d["prefill_rank"]), str(d["decode_rank"]), "dummy", "0", "0", "0 B")
    table.add_section()
    table.add_row(
        "total",
        "",
        "",
        f"{report['descriptors']:,}",
        f"{report['descriptors_unmerged']:,}",
        _human(report["total_bytes"]),
    )
    console = Console()
    console.print(table)
    for name, s in report["staged"].items():
        console.print(
            f"staged {name}: {s['descriptors']} descriptors, {_human(s['bytes'])}, "
            f"buffers up to {_human(s['max_prefill_buffer_bytes'])} (prefill) / "
            f"{_human(s['max_decode_buffer_bytes'])} (decode)"
        )
    f = report["flows"]
    ring, pinned = f["ring"], f["pinned"]
    console.print(
        f"flows ({ring['chunks']} chunk(s)): direct {f['direct']['descriptors']:,} descriptors; "
        f"ring {ring['descriptors']:,} (decode ring >= {_human(ring['decode_space_per_chunk_bytes'])} "
        f"a chunk, prefill slots {_human(ring['prefill_space_per_chunk_bytes'])}); pinned "
        f"{pinned['descriptors']:,} (decode pool >= {_human(pinned['decode_space_per_chunk_bytes'])} "
        "a chunk); "
        f"the default policy picks {f['policy_choice']}"
    )


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan(
        model: Annotated[
            str | None, typer.Option(help=f"Model preset: {', '.join(sorted(PRESETS))}.")
        ] = None,
        prefill_tp: Annotated[int, typer.Option(help="Prefill server TP size.")] = 1,
        decode_tp: Annotated[int, typer.Option(help="Decode server TP size.")] = 1,
        page_size: Annotated[int, typer.Option(help="Tokens per page on both sides.")] = 16,
        prefill_page_size: Annotated[int | None, typer.Option(help="Override page size, prefill.")] = None,
        decode_page_size: Annotated[int | None, typer.Option(help="Override page size, decode.")] = None,
        tokens: Annotated[int, typer.Option(help="Tokens in the room.")] = 4096,
        fragmented: Annotated[
            bool, typer.Option(help="Scatter the room over random pages of a pool twice its size.")
        ] = False,
        seed: Annotated[int, typer.Option(help="Seed for --fragmented page ids.")] = 0,
        layers: Annotated[int | None, typer.Option(help="Explicit model: layers.")] = None,
        kv_heads: Annotated[int | None, typer.Option(help="Explicit model: total KV heads.")] = None,
        head_dim: Annotated[int | None, typer.Option(help="Explicit model: head_dim (MLA: latent).")] = None,
        dtype: Annotated[DType | None, typer.Option(help="KV dtype (overrides the preset's).")] = None,
        mla: Annotated[bool | None, typer.Option("--mla/--no-mla", help="Explicit model: MLA.")] = None,
        prefill_layout: Annotated[Layout, typer.Option(help="Prefill pool layout.")] = Layout.SGLANG_NHD,
        decode_layout: Annotated[Layout, typer.Option(help="Decode pool layout.")] = Layout.SGLANG_NHD,
        as_json: Json = False,
        chunk_tokens: Annotated[
            int, typer.Option(help="Chunked prefill: tokens per chunk (0: the room is one chunk).")
        ] = 0,
    ) -> None:
        """Plan one room's KV transfer: descriptors (merged and unmerged), bytes per rank pair,
        the staged layouts, and what each flow (direct, ring, pinned) posts and needs."""
        try:
            geometry = build_model(model, layers, kv_heads, head_dim, dtype, mla)
            report = make_report(
                geometry,
                prefill_tp,
                decode_tp,
                prefill_page_size if prefill_page_size is not None else page_size,
                decode_page_size if decode_page_size is not None else page_size,
                tokens,
                prefill_layout,
                decode_layout,
                fragmented,
                seed,
                chunk_tokens,
            )
        except (KvferryError, typer.BadParameter) as exc:
            bad_input(str(exc))
        if as_json:
            json.dump(report, sys.stdout)
            sys.stdout.write("\n")
        else:
            print_table(report)
