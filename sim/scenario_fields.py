"""The typed-field reader of the scenario format: pulls checked values out of one TOML table and
names the file, the table and the key in every error (``FILE: [faults].ctrl_drop: ...``), with a
"did you mean" for a near miss."""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

from kvferry.sim.scenario_schema import ScenarioError


def at(where: str, key: str) -> str:
    """One error path format: ``FILE: key`` at the top level, ``FILE: [table].key`` in a table
    (``where`` is ``FILE`` or ``FILE: [table]``, or deeper: ``FILE: [workload].room[0]``)."""
    return f"{where}.{key}" if ": [" in where else f"{where}: {key}"


class Reader:
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
                raise ScenarioError(f"{at(where, key)}: unknown field{extra}")

    def _err(self, key: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{at(self.where, key)}: {msg}")

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


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))
