"""msgspec's decoding errors in the scenario format's words: every error names the file, the table
and the key (``FILE: [faults].ctrl_drop: expected a probability in [0, 1], got 1.5``), shows the
value it refused, and for an unknown key suggests the near one meant ("did you mean")."""

from __future__ import annotations

import difflib
import re
from typing import Any

import msgspec
from kvferry.sim.scenario_schema import ScenarioError
from msgspec import inspect as mi

Path = tuple[str | int, ...]

# What a value should have been, by msgspec's name for its type.
_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "array": "an array",
    "object": "a table",
}
_MESSAGE = re.compile(r"(?P<what>.*?)(?: - at `(?P<path>[^`]*)`)?$")
_STEP = re.compile(r"\.([A-Za-z0-9_-]+)|\[(\d+)\]")


def at(where: str, key: str) -> str:
    """One error path format: ``FILE: key`` at the top level, ``FILE: [table].key`` in a table
    (``where`` is ``FILE`` or ``FILE: [table]``, or deeper: ``FILE: [workload].room[0]``)."""
    return f"{where}.{key}" if ": [" in where else f"{where}: {key}"


def place(file: str, path: Path) -> str:
    """``FILE``, ``FILE: key``, ``FILE: [table]`` or ``FILE: [table].key[0].key``."""
    if not path:
        return file
    if len(path) == 1:
        return f"{file}: {path[0]}"
    where = f"{file}: [{path[0]}]"
    for step in path[1:]:
        where = f"{where}[{step}]" if isinstance(step, int) else at(where, step)
    return where


def _path(text: str) -> Path:
    return tuple(m[1] if m[1] else int(m[2]) for m in _STEP.finditer(text.removeprefix("$")))


def _value(data: Any, path: Path) -> Any:
    for step in path:
        data = data[step]
    return data


def _type(root: mi.Type, path: Path) -> mi.Type | None:
    """The type msgspec decodes at ``path`` (None where the path leaves the schema)."""
    t: Any = root
    for step in path:
        if isinstance(t, mi.UnionType):  # ``X | None``: the value's type is X
            t = next(x for x in t.types if not isinstance(x, mi.NoneType))
        if isinstance(step, int) and hasattr(t, "item_type"):
            t = t.item_type
        elif isinstance(t, mi.StructType):
            t = next((f.type for f in t.fields if f.encode_name == step), None)
        else:
            return None
    if isinstance(t, mi.UnionType):
        t = next(x for x in t.types if not isinstance(x, mi.NoneType))
    return t


def _keys(t: mi.Type | None) -> list[str]:
    return [f.encode_name for f in t.fields] if isinstance(t, mi.StructType) else []


def _hint(key: str, known: list[str]) -> str:
    near = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {near[0]!r}?" if near else ""


def _range(t: Any, v: Any) -> str:
    if isinstance(t, mi.IntType):
        if t.ge is not None and v < t.ge:
            return f"must be >= {t.ge}, got {v}"
        return f"must be <= {t.le}, got {v}"
    if (t.ge, t.le) == (0.0, 1.0):
        return f"expected a probability in [0, 1], got {v!r}"
    bounds = f"in [{t.ge}, {t.le}]" if t.le is not None else f">= {t.ge}"
    return f"expected a number {bounds}, got {v!r}"


def scenario_error(
    e: msgspec.ValidationError, data: Any, root: type, file: str, base: Path = ()
) -> ScenarioError:
    """``e`` (from decoding ``data`` as ``root``) as a ScenarioError naming the key in ``file``;
    ``base``: where ``data`` sits in the file (``("deploy",)`` for a table decoded on its own)."""
    m = _MESSAGE.fullmatch(str(e))
    assert m is not None  # the pattern matches any text
    what, path = m["what"], _path(m["path"] or "$")
    schema = mi.type_info(root)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", what)
    if unknown:
        key = unknown[1]
        known = _keys(_type(schema, path))
        hint = _hint(key, known) or f"known: {', '.join(known)}"
        return ScenarioError(f"{place(file, base + path + (key,))}: unknown field ({hint})")
    missing = re.fullmatch(r"Object missing required field `(.*)`", what)
    if missing:
        return ScenarioError(f"{place(file, base + path + (missing[1],))}: missing (a required key)")
    where = place(file, base + path)
    value = _value(data, path)
    mismatch = re.fullmatch(r"Expected `(\w+)`, got `\w+`", what)
    if mismatch and mismatch[1] == "object" and len(base + path) == 1:
        where = f"{file}: [{(base + path)[0]}]"  # a table given as a plain value
    if mismatch:
        msg = f"{where}: expected {_EXPECTED.get(mismatch[1], mismatch[1])}, got {value!r}"
        if mismatch[1] == "array" and path and isinstance(path[-1], str):
            # `room = 24` is a plain value under an array's name: most likely a near key misspelt.
            near = _hint(path[-1], [k for k in _keys(_type(schema, path[:-1])) if k != path[-1]])
            msg += f" ({near})" if near else ""
        return ScenarioError(msg)
    t = _type(schema, path)
    if what.startswith("Invalid enum value") and isinstance(t, mi.LiteralType):
        return ScenarioError(f"{where}: expected one of {', '.join(map(str, t.values))}, got {value!r}")
    if isinstance(t, mi.IntType | mi.FloatType) and re.fullmatch(r"Expected `\w+` [<>]=? .*", what):
        return ScenarioError(f"{where}: {_range(t, value)}")
    return ScenarioError(f"{where}: {what[0].lower()}{what[1:]}")
