"""Coverage tables of a campaign (``kvferry fuzz``, ``kvferry chaos``) as plain text: rooms per
flow, TP pair or fault kind with their outcomes, so a row that was never drawn shows as a zero."""

from __future__ import annotations

from collections.abc import Mapping


def table(title: str, rows: Mapping[str, Mapping[str, int]]) -> list[str]:
    """``rows``: name -> {"rooms": n, outcome: n, ...}; one line per row, outcomes in one column
    order for every row, and a mark on rows that drew nothing."""
    outcomes = sorted({k for r in rows.values() for k in r if k != "rooms"})
    width = max([len(title), *(len(k) for k in rows)])
    head = f"  {title:<{width}}  {'rooms':>7}" + "".join(f"  {o:>{max(len(o), 6)}}" for o in outcomes)
    lines = [head]
    for name, r in rows.items():
        cells = "".join(f"  {r.get(o, 0):>{max(len(o), 6)}}" for o in outcomes)
        never = "  <- never drawn" if not r.get("rooms", 0) else ""
        lines.append(f"  {name:<{width}}  {r.get('rooms', 0):>7}{cells}{never}")
    return lines
