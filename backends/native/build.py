"""Build the native engine from source without pip: ``python -m kvferry.backends.native.build``.

The package's install builds it (setup.py's extension). This is for a checkout used in place (the
device scripts put the checkout on PYTHONPATH without installing it) and for sanitizer builds:
``--sanitize address --out /tmp/kvf_asan.so``, then ``KVFERRY_NATIVE_LIB=/tmp/kvf_asan.so`` (the
library is loaded into a Python that was not built with the sanitizer: preload its runtime,
``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "engine.c", HERE / "copy.c")
FLAGS = ["-std=c11", "-O2", "-Wall", "-fPIC", "-shared", "-pthread"]


def default_out() -> Path:
    """Where the installed extension lives: next to this file, with Python's extension suffix."""
    return HERE / f"_kvf_engine{sysconfig.get_config_var('EXT_SUFFIX')}"


def build(out: Path, sanitize: str = "", cc: str = "gcc") -> Path:
    flags = list(FLAGS)
    if sanitize:
        flags = [f for f in flags if f != "-O2"] + [
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            f"-fsanitize={sanitize}",
        ]
    cmd = [cc, *flags, "-o", str(out), *map(str, SOURCES), "-ldl"]
    subprocess.run(cmd, check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sanitize", default="", help="address or thread")
    ap.add_argument("--cc", default="gcc")
    a = ap.parse_args()
    try:
        out = build(a.out or default_out(), a.sanitize, a.cc)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"error: native engine build failed: {exc}", file=sys.stderr)
        sys.exit(2)
    print(out)


if __name__ == "__main__":
    main()
