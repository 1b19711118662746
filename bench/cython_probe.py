"""Does compiling the simulator's hot modules with Cython make the replays cheaper? A probe.

``python bench/cython_probe.py build DIR`` compiles the modules of MODULES, unchanged (Cython 3's
pure-Python mode, annotation typing off so a ``float`` annotation stays a Python object and every
value is what the interpreter computes), into DIR with a manifest of their sources' hashes.
``python bench/cython_probe.py run [--accel DIR] replay|deploy N`` runs the bench's transfer replay
(``big_scenario(N)``, seed 0) or deployment replay (N requests), with the compiled copies when
``--accel`` is given, and prints its CPU seconds and digest (identical with and without).

Needs Cython 3 and a C compiler (``uv pip install cython``; not in the lock: the package does not
use it). The build takes ~10 CPU minutes. The result is in docs/benchmarks.md (the section on the
execution model): ~12% fewer instructions a room and no measurable CPU gain, so nothing ships.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
# Where a room and a request spend their Python time (cProfile by file). Package __init__ stays Python.
MODULES = {
    "kvferry.core": ("core", ("*.py", "flows/*.py", "resources/*.py")),
    "kvferry.backends": ("backends", ("driver.py", "pattern.py", "transport.py", "simfabric/*.py")),
    "kvferry.sim": (
        "sim",
        (
            "world.py",
            "trace.py",
            "pages.py",
            "live_checks.py",
            "serving.py",
            "rooms.py",
            "faults.py",
            "checker.py",
        ),
    ),
    "kvferry.sim.deploy": ("sim/deploy", ("*.py",)),
}
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "binding": True}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sources() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package, (folder, patterns) in MODULES.items():
        for pattern in patterns:
            for path in sorted((ROOT / folder).glob(pattern)):
                if path.name != "__init__.py":
                    rel = path.relative_to(ROOT / folder).with_suffix("")
                    out[".".join((package, *rel.parts))] = path
    return out


def build(out: Path, jobs: int) -> None:
    from Cython.Build import cythonize
    from setuptools import Extension
    from setuptools.dist import Distribution

    mods = sources()
    tmp = Path(tempfile.mkdtemp(prefix="kvf-cython-"))
    exts = [Extension(name, [str(src)], extra_compile_args=["-O2"]) for name, src in mods.items()]
    compiled = cythonize(
        exts, nthreads=jobs, quiet=True, build_dir=str(tmp / "c"), compiler_directives=DIRECTIVES
    )
    dist = Distribution({"ext_modules": compiled})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp, cmd.parallel = str(tmp / "lib"), str(tmp / "o"), jobs  # type: ignore[attr-defined]
    dist.run_command("build_ext")
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, src in mods.items():
        shutil.copyfile(tmp / "lib" / (name.replace(".", "/") + SUFFIX), out / (name + SUFFIX))
        rows[name] = {"source": str(src), "sha256": _sha(src)}
    (out / "manifest.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)


class CompiledFinder:
    """Loads a manifest's module from its extension while its source still has the built hash."""

    def __init__(self, built: Path) -> None:
        self.built = built
        self.rows = json.loads((built / "manifest.json").read_text())
        self.loaded: list[str] = []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        row = self.rows.get(fullname)
        if row is None or _sha(Path(row["source"])) != row["sha256"]:
            return None  # not compiled, or edited since the build: the .py
        ext = self.built / (fullname + SUFFIX)
        self.loaded.append(fullname)
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(ext))
        return importlib.util.spec_from_file_location(fullname, ext, loader=loader)


def run(what: str, n: int) -> tuple[float, str]:
    """CPU seconds of one replay, and what it produced (the digest, or the deployment's figures)."""
    sys.path.insert(0, str(ROOT / "bench"))
    if what == "replay":
        from kvferry.sim.campaign import run_one
        from sim_bench import big_scenario

        scen = big_scenario(n)
        t0 = time.process_time()
        res, _ = run_one(scen, 0)
        d = res.as_dict()
        return time.process_time() - t0, f"{d['events']} events, digest {d['digest']}"
    from kvferry.sim.deploy import workload as wl
    from kvferry.sim.deploy.run import simulate
    from kvferry.sim.deploy.spec import DeploySpec

    spec = DeploySpec(model="qwen3-8b", prefill_tp=4, decode_tp=2, flow="ring")
    arrivals = wl.Arrivals(requests=wl.poisson(20.0, n, 1000, 100, seed=1, spread=0.5))
    t0 = time.process_time()
    r = simulate(spec, arrivals)
    figures = (r.completed, r.ttft_ms.p50, r.ttft_ms.p99, r.tpot_ms.p50, r.sim_s, len(r.violations))
    return time.process_time() - t0, repr(figures)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("-j", "--jobs", type=int, default=2)
    r = sub.add_parser("run")
    r.add_argument("--accel", type=Path, default=None, help="a build's folder (default: pure Python)")
    r.add_argument("what", choices=("replay", "deploy"))
    r.add_argument("n", type=int)
    a = ap.parse_args()
    if a.cmd == "build":
        if importlib.util.find_spec("Cython") is None:
            sys.exit("error: the probe needs Cython 3: uv pip install cython")
        build(a.out, a.jobs)
        return
    finder = CompiledFinder(a.accel) if a.accel else None
    if finder:
        sys.meta_path.insert(0, finder)
    cpu, result = run(a.what, a.n)
    compiled = len(finder.loaded) if finder else 0
    print(f"{a.what} {a.n}: {cpu:.2f} s CPU, {compiled} modules compiled; {result}")


if __name__ == "__main__":
    main()
