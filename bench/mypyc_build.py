"""Does compiling the simulator's hot modules with mypyc make the replays cheaper? A probe.

``python bench/mypyc_build.py build DIR [--modules GROUP]`` copies core/, backends/ and sim/ into
a temporary ``kvferry/`` tree (mypy names a module by its folders; the editable install maps the
top-level folders onto ``kvferry.*``, which mypy cannot follow), compiles the modules of a group
with mypyc into DIR (one shared library plus a small shim per module) with a manifest of their
sources' hashes. ``python bench/mypyc_build.py run [--accel DIR] replay|deploy N`` runs the bench's
transfer replay or deployment replay (cython_probe.py's ``run``) with the compiled copies when
``--accel`` is given, and prints its CPU seconds and digest (identical with and without).

mypyc compiles a class with typed native attributes and direct calls between compiled methods
(no instance dict: an attribute no class declares, or a patched method, raises), and checks the
declared types at run time, so a module compiles only if mypy passes it. ``--ignore-type-errors``
adds ``# mypy: ignore-errors`` to the copies: a measurement of what mypyc could give before the
sources type-check, where a wrong annotation raises TypeError at run time rather than passing.

A msgspec Struct declared in a compiled module gets mypyc's run-time annotations, which msgspec
misreads (``int | None`` as ``type``): one that decodes anything lives in an interpreted module
(sim/peek.py). ``check`` compares a subset of tests/data/behaviour-digests.jsonl, compiled or not.

Needs mypy (``uv pip install mypy``, which brings mypyc; not in the lock; measured with 1.20.2) and
a C compiler. Never needed by the tests; the result is in docs/benchmarks.md (the section on
mypyc): ~17% fewer instructions a room, ~8% a request, a CPU gain of ~5% at most on the replay.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cython_probe import ROOT, SUFFIX, CompiledFinder, _sha, run, sources

DIGESTS = ROOT / "tests" / "data" / "behaviour-digests.jsonl"
FOLDERS = {"core": "core", "backends": "backends", "sim": "sim"}
# Data-only modules (msgspec Structs, enums, exceptions, specs, report formatting): mypyc compiles
# their classes as plain Python classes, so they gain nothing, and mypy misreads msgspec's frozen
# inheritance. The rest of cython_probe's list is compiled.
DATA = {
    "kvferry.core.commands",
    "kvferry.core.events",
    "kvferry.core.messages",
    "kvferry.core.errors",
    "kvferry.backends.simfabric.errors",
    "kvferry.backends.simfabric.spec",
    "kvferry.sim.deploy.report",
    "kvferry.sim.deploy.select",
    "kvferry.sim.deploy.capacity",
}
# Left interpreted, where mypyc refuses a class: ExtraFlow subclasses str (native classes cannot
# subclass most builtins), the deployment's world narrows ``Serving.world`` to ``World`` (a native
# attribute keeps one type down the hierarchy), and mypyc turns the transport protocols, which
# are ``runtime_checkable``, into native classes that the decorator rejects; sim/deploy/world.py
# replaces a Trace's ``record`` method on the instance, which a native class refuses.
REFUSED = {
    "kvferry.core.flows.registry",
    "kvferry.sim.deploy.world",
    "kvferry.backends.transport",
    "kvferry.sim.trace",
}
# What was measured (docs/benchmarks.md): ``backend`` type-checks as it is; ``hot`` adds the world,
# the planner and two flows, which need ``--ignore-type-errors`` (22 errors in sim/world.py and
# sim/live_checks.py: optional arrays and unions read without narrowing, harmless at run time).
# The room engines (core/sender.py, receiver.py, proto_common.py, info_acks.py, reliable.py)
# build on top of ``hot`` but move the replay's outcome (not root-caused): left out.
BACKEND = (
    "kvferry.core.deadlines",
    "kvferry.core.machine",
    "kvferry.backends.driver",
    "kvferry.backends.simfabric.calls",
    "kvferry.backends.simfabric.descriptors",
    "kvferry.backends.simfabric.fabric",
    "kvferry.backends.simfabric.memory",
    "kvferry.backends.simfabric.runtime",
    "kvferry.backends.simfabric.transport",
)
HOT = (
    *BACKEND,
    "kvferry.core.planner",
    "kvferry.core.worker",
    "kvferry.core.flows.direct",
    "kvferry.core.flows.push",
    "kvferry.backends.pattern",
    "kvferry.sim.world",
    "kvferry.sim.live_checks",
    "kvferry.sim.pages",
    "kvferry.sim.rooms",
)
GROUPS = {"backend": BACKEND, "hot": HOT}
# mypyc's class options, set in the copies only (the decorator is mypyc's): UnknownRoomError
# derives from two exception classes, which a native class cannot, so it stays a plain Python
# class; the room engines, the fabric and the transport are subclassed by interpreted classes
# (sim/planted.py's bugs, sim/deploy/timing.py's fabric and transport, tests).
NON_NATIVE = "native_class=False"
SUBCLASSED = "allow_interpreted_subclasses=True"
CLASS_ATTRS = {
    "kvferry.core.proto_common": {"UnknownRoomError": NON_NATIVE, "RoomEngine": SUBCLASSED},
    "kvferry.core.machine": {"TableEngine": SUBCLASSED},
    "kvferry.core.sender": {"SenderEngine": SUBCLASSED},
    "kvferry.core.receiver": {"ReceiverEngine": SUBCLASSED},
    "kvferry.backends.simfabric.fabric": {"Fabric": SUBCLASSED},
    "kvferry.backends.simfabric.transport": {"SimTransport": SUBCLASSED},
}


def modules(group: str) -> dict[str, Path]:
    mods = {name: path for name, path in sources().items() if name not in DATA | REFUSED}
    if group == "all":
        return mods
    wanted = set(GROUPS.get(group) or group.split(","))
    missing = wanted - set(mods)
    if missing:
        sys.exit(f"error: not in the probe's list: {sorted(missing)}")
    return {name: mods[name] for name in sorted(wanted)}


def _copy_tree(tmp: Path, mods: dict[str, Path], ignore_errors: bool) -> list[Path]:
    """The tree mypy reads; modules left interpreted get ``# mypy: ignore-errors`` (only the
    compiled ones need to type-check), the compiled ones too with ``ignore_errors``."""
    pkg = tmp / "src" / "kvferry"
    pkg.mkdir(parents=True)
    shutil.copyfile(ROOT / "kvferry" / "__init__.py", pkg / "__init__.py")
    for sub, folder in FOLDERS.items():
        shutil.copytree(ROOT / folder, pkg / sub, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    copies = [tmp / "src" / Path(*name.split(".")).with_suffix(".py") for name in mods]
    compiled = set(copies)
    for copy in pkg.rglob("*.py"):
        if ignore_errors or copy not in compiled:
            copy.write_text("# mypy: ignore-errors\n" + copy.read_text())
    for name, classes in CLASS_ATTRS.items():
        copy = tmp / "src" / Path(*name.split(".")).with_suffix(".py")
        text = copy.read_text()
        for cls, attr in classes.items():
            text, n = re.subn(rf"\nclass {cls}\b(?=[(:])", f"\n@mypyc_attr({attr})\nclass {cls}", text)
            assert n == 1, (name, cls)
        head = "from __future__ import annotations\n"
        copy.write_text(text.replace(head, head + "\nfrom mypy_extensions import mypyc_attr\n", 1))
    return copies


def build(out: Path, group: str, ignore_errors: bool, opt: str, keep: bool) -> None:
    mods = modules(group)
    tmp = Path(tempfile.mkdtemp(prefix="kvf-mypyc-"))
    copies = _copy_tree(tmp, mods, ignore_errors)
    src = tmp / "src"
    setup = src / "setup_mypyc.py"
    rel = [str(c.relative_to(src)) for c in copies]
    setup.write_text(
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        f"setup(name='kvf_mypyc', ext_modules=mypycify({rel!r}, opt_level={opt!r}))\n"
    )
    env = dict(os.environ, MYPYC_OPT_LEVEL=opt)
    cmd = [sys.executable, str(setup), "build_ext", "--inplace", "-j", "2"]
    done = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    if done.returncode:  # mypy's and mypyc's refusals go to stdout
        sys.exit(f"{done.stdout[-20000:]}{done.stderr[-5000:]}error: mypyc failed (sources in {tmp})")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for lib in src.glob(f"*__mypyc{SUFFIX}"):  # the group's shared library, imported by every shim
        shutil.copyfile(lib, out / lib.name)
    rows = {}
    for name, path in mods.items():
        shim = src / Path(*name.split(".")).with_suffix(SUFFIX)
        shutil.copyfile(shim, out / (name + SUFFIX))
        rows[name] = {"source": str(path), "sha256": _sha(path)}
    (out / "manifest.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    if keep:
        print(f"generated C and copies kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def check(replays: int, fuzz: str) -> int:
    """A subset of the pinned behaviour digests (tests/data/behaviour-digests.jsonl): every engine
    case, the first ``replays`` replay cases and the fuzz seeds ``fuzz``; prints and counts the
    cases that moved."""
    import itertools

    import behaviour_digests as bd

    want = {row["case"]: row for row in map(json.loads, DIGESTS.read_text().splitlines())}
    rows = itertools.chain(
        bd.engine_cases(),
        itertools.islice(bd.replay_cases(), replays),
        bd.fuzz_cases(bd.parse_seeds(fuzz)) if fuzz else (),
    )
    moved = n = 0
    for row in rows:
        n += 1
        if want.get(row["case"]) != row:
            moved += 1
            print(f"MOVED {row['case']}\n  was {want.get(row['case'])}\n  now {row}")
    print(f"{n} cases, {moved} moved")
    return moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--modules", default="hot", help="backend, hot, all, or comma-separated module names")
    b.add_argument("--ignore-type-errors", action="store_true")
    b.add_argument("--opt", default="3", help="mypyc's C optimisation level")
    b.add_argument("--keep-temp", action="store_true", help="keep the copies and the generated C")
    r = sub.add_parser("run")
    r.add_argument("--accel", type=Path, default=None, help="a build's folder (default: pure Python)")
    r.add_argument("what", choices=("replay", "deploy"))
    r.add_argument("n", type=int)
    c = sub.add_parser("check", help="compare a subset of the pinned behaviour digests")
    c.add_argument("--accel", type=Path, default=None, help="a build's folder (default: pure Python)")
    c.add_argument("--replays", type=int, default=40, help="how many replay cases, in file order")
    c.add_argument("--fuzz", default="0-29", help="fuzz seeds (a-b), empty for none")
    a = ap.parse_args()
    if a.cmd == "build":
        if importlib.util.find_spec("mypyc") is None:
            sys.exit("error: the probe needs mypyc: uv pip install mypy")
        build(a.out.resolve(), a.modules, a.ignore_type_errors, a.opt, a.keep_temp)
        return
    finder = CompiledFinder(a.accel.resolve()) if a.accel else None
    if finder:
        # Compiled modules import their group's siblings inside the shared library, past the
        # finder's hash check: a build older than any of its sources is refused as a whole.
        stale = [n for n, row in finder.rows.items() if _sha(Path(row["source"])) != row["sha256"]]
        if stale:
            sys.exit(f"error: sources edited since the build, rebuild: {stale}")
        sys.path.insert(0, str(finder.built))  # where the shims find the shared library
        sys.meta_path.insert(0, finder)
    if a.cmd == "check":
        sys.exit(1 if check(a.replays, a.fuzz) else 0)
    cpu, result = run(a.what, a.n)
    compiled = (
        [n for n in finder.rows if str(finder.built) in (sys.modules[n].__file__ or "")] if finder else []
    )
    print(f"{a.what} {a.n}: {cpu:.2f} s CPU, {len(compiled)} modules compiled; {result}")


if __name__ == "__main__":
    main()
