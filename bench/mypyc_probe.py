"""Probe: does compiling the simulator's hot modules with mypyc make it faster? (an experiment, not a build)

Needs mypy in the venv (``uv pip install mypy``; it is not a project dependency) and a C compiler.

    python bench/mypyc_probe.py time                  # CPU time of the two replays, pure Python
    python bench/mypyc_probe.py build [--set hot]     # compile a module set, drop the .so files in place
    python bench/mypyc_probe.py time                  # same replays, now through the compiled modules
    python bench/mypyc_probe.py digests               # engine + replay behaviour digests vs the stored file
    python bench/mypyc_probe.py clean                 # remove every .so that build placed
    python bench/mypyc_probe.py place                 # put the last build's .so files back

``build`` copies kvferry/, core/, backends/ and sim/ into build/mypyc/src/kvferry/ (the installed
package layout, so the compiled modules get their real ``kvferry.*`` names), runs mypycify there and
copies each module's extension next to its .py (CPython's path finder prefers an extension to a .py
of the same name; *.so is gitignored), plus mypyc's shared group library into site-packages. The
project does not type-check cleanly under mypy, so the error codes it reports are disabled: mypyc
then trusts the annotations as written, and the digests are what shows whether that was safe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "mypyc"
SRC = BUILD / "src"
MANIFEST = BUILD / "installed.json"
FOLDERS = {"kvferry": "kvferry", "core": "kvferry/core", "backends": "kvferry/backends", "sim": "kvferry/sim"}
GROUP = "kvferry_mypyc"

# The flat-profile modules (docs/benchmarks.md). Left out, with why:
# - core/events.py, core/messages.py, core/commands.py: msgspec Struct declarations (data, no logic
#   on the hot path; mypyc cannot make a native class of a msgspec.Struct subclass).
# - core/errors.py: exception classes; compiled, they become extension classes, and a class that
#   also inherits a builtin (UnknownRoomError(ProtocolError, KeyError)) must be non-native, which
#   mypyc forbids on top of an extension class.
DATA = {"__init__", "events", "messages", "commands", "errors"}


def _py(folder: str) -> list[Path]:
    return [p.relative_to(ROOT) for p in sorted((ROOT / folder).glob("*.py")) if p.stem not in DATA]


HOT = [
    *_py("core"),
    *_py("core/flows"),
    Path("backends/driver.py"),
    *_py("backends/simfabric"),
    Path("sim/world.py"),
    *_py("sim/deploy"),
]
SETS = {
    "hot": HOT,
    "core": [p for p in HOT if p.parts[0] == "core"],
    "sim": [p for p in HOT if p.parts[0] != "core"],
}
# mypy's findings on this code base (129 on the hot set, mostly msgspec Structs read as frozen
# dataclasses, Hashable keys, protocol mismatches): none is a mypyc limitation, so they are muted.
MUTED = "misc,arg-type,has-type,union-attr,index,var-annotated,call-overload,override,attr-defined,assignment"


# mypyc cannot make a native class that inherits a builtin (KeyError, str, RuntimeError beside
# another base). The probe marks those classes non-native in its staged copy only (the repository's
# sources stay free of mypy_extensions); a product build would need the same marks in the source.
NON_NATIVE = {
    "kvferry/core/proto_common.py": "class UnknownRoomError(",
    "kvferry/core/flows/registry.py": "class ExtraFlow(",
    "kvferry/sim/deploy/report.py": "class PlotError(",
}


def mark_non_native() -> None:
    for rel, head in NON_NATIVE.items():
        path = SRC / rel
        text = path.read_text()
        assert head in text, (rel, head)
        text = text.replace(head, "@mypyc_attr(native_class=False)\n" + head, 1)
        text = text.replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nfrom mypy_extensions import mypyc_attr\n",
            1,
        )
        path.write_text(text)


# Annotations that run-time values break: mypyc checks them, CPython does not. Widened in the staged
# copy only (a product build would need the same edits in the source).
WIDEN = {
    # mypy keeps r.flow narrowed to None across self._choose_flow(r), so mypyc casts it to None
    # and raises TypeError once _choose_flow has set it (every room failed)
    "kvferry/core/sender.py": (
        "            self._choose_flow(r)\n            if r.flow is None:",
        '            self._choose_flow(r)\n            if getattr(r, "flow") is None:',
    ),
    # a pinned Reservation lands in the variable typed by the ring's assign()
    "kvferry/core/flows/staged_receiver.py": (
        "got = self.ring.assign(need, r.key)",
        "got: Any = self.ring.assign(need, r.key)",
    ),
}


def widen() -> None:
    for rel, (old, new) in WIDEN.items():
        path = SRC / rel
        text = path.read_text()
        assert text.count(old) == 1, (rel, old)
        path.write_text(text.replace(old, new))


def staged(p: Path) -> str:
    return str(Path(FOLDERS[p.parts[0]], *p.parts[1:]))


def stage() -> None:
    shutil.rmtree(SRC, ignore_errors=True)
    for folder, dest in FOLDERS.items():
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            out = SRC / dest / py.relative_to(ROOT / folder)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(py, out)


def build(modules: list[Path], jobs: int, exclude: set[str]) -> None:
    clean()
    stage()
    mark_non_native()
    widen()
    mods = [staged(p) for p in modules if p.stem not in exclude and str(p) not in exclude]
    flags = ["--ignore-missing-imports", "--follow-imports=silent", f"--cache-dir={BUILD / 'mypy-cache'}"]
    flags += [f"--disable-error-code={code}" for code in MUTED.split(",")]
    setup = (
        "from setuptools import setup\nfrom mypyc.build import mypycify\n"
        f"setup(name='{GROUP}', ext_modules=mypycify({flags + mods!r}, opt_level='3', multi_file=True, "
        f"group_name='{GROUP}'))\n"
    )
    (SRC / "setup_mypyc.py").write_text(setup)
    (SRC / "modules.json").write_text(json.dumps(mods))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "setup_mypyc.py", "build_ext", "--inplace", f"-j{jobs}"], cwd=SRC, check=True
    )
    wall = time.perf_counter() - t0
    place(mods, wall)


def place(mods: list[str], wall: float) -> None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    site = Path(sysconfig.get_paths()["purelib"])
    top = {v: k for k, v in FOLDERS.items()}
    placed: list[str] = []
    for so in SRC.rglob(f"*{suffix}"):
        rel = so.relative_to(SRC)
        if rel.parts[0] == "build":  # setuptools' own copies
            continue
        if rel.parts[0] != "kvferry":  # mypyc's shared group library: a top-level module
            dest = site / rel
        else:
            key = "/".join(rel.parts[:2]) if "/".join(rel.parts[:2]) in top else "kvferry"
            dest = ROOT / top[key] / Path(*rel.parts[len(key.split("/")) :])
        shutil.copy2(so, dest)
        placed.append(str(dest))
    MANIFEST.write_text(json.dumps({"modules": mods, "placed": placed, "build_wall_s": round(wall, 1)}))
    print(f"compiled {len(mods)} modules in {wall:.1f} s wall, placed {len(placed)} extensions")


def clean() -> None:
    if MANIFEST.exists():
        for p in json.loads(MANIFEST.read_text())["placed"]:
            Path(p).unlink(missing_ok=True)
        MANIFEST.unlink()


def timings(rooms: int, requests: int, repeats: int) -> dict[str, object]:
    sys.path.insert(0, str(ROOT / "bench"))
    import sim_bench as sb
    from kvferry.core import sender
    from kvferry.sim import world
    from kvferry.sim.campaign import run_one

    replay, deploy = [], []
    for _ in range(repeats):
        s = sb.big_scenario(rooms)
        c0 = time.process_time()
        res, _w = run_one(s)
        replay.append(time.process_time() - c0)
        assert not res.violations and res.succeeded == rooms
        deploy.append(sb.deploy_replay(requests)["deploy_cpu_s"])
    return {
        "compiled": [m.__name__ for m in (sender, world) if not str(m.__file__).endswith(".py")],
        "replay_rooms": rooms,
        "replay_cpu_s": [round(x, 2) for x in replay],
        "deploy_requests": requests,
        "deploy_cpu_s": deploy,
    }


def digests() -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    import behaviour_digests as bd

    stored = {}
    with open(ROOT / "tests/data/behaviour-digests.jsonl") as f:
        for line in f:
            row = json.loads(line)
            stored[row["case"]] = row
    moved = n = 0
    for row in [*bd.engine_cases(), *bd.replay_cases()]:
        n += 1
        if stored.get(row["case"]) != row:
            moved += 1
            print(f"moved: {row['case']}")
    print(f"{n} cases, {moved} moved")
    return 1 if moved else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("build", "clean", "place", "time", "digests"))
    ap.add_argument("--set", choices=tuple(SETS), default="hot")
    ap.add_argument("--exclude", default="", help="comma-separated module stems or paths to leave out")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rooms", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    if a.what == "build":
        build(SETS[a.set], a.jobs, {x for x in a.exclude.split(",") if x})
    elif a.what == "clean":
        clean()
    elif a.what == "place":  # put the last build's extensions back after a clean
        place(json.loads((SRC / "modules.json").read_text()), 0.0)
    elif a.what == "time":
        print(json.dumps(timings(a.rooms, a.requests, a.repeats)))
    else:
        sys.exit(digests())


if __name__ == "__main__":
    main()
