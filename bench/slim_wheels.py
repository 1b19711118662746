"""Drop what kvferry never loads from the NIXL wheel carried to the device: the expert-parallel
extension ``nixl_ep_cu13`` (three torch-version builds, 27 MB of the wheel's 59 MB). The device
tool carries at most 64 MiB (the tracked tree and the wheels together), and the full wheel left
under 1 MiB for the tree.

Run here after downloading the wheels (bench/gpu_common.sh), before a device call:
``python bench/slim_wheels.py .whl``. The wheel is rewritten in place with its RECORD updated; a
wheel without the extension is left as it is.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

DROP = ("nixl_ep_cu13/", "nixl_ep_cu12/")


def _dropped(name: str) -> bool:
    return name.startswith(DROP)


def slim(wheel: Path) -> int:
    """Rewrite ``wheel`` without the dropped packages; the bytes saved (0: nothing to drop)."""
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        if not any(_dropped(i.filename) for i in infos):
            return 0
        tmp = wheel.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if _dropped(info.filename):
                    continue
                data = z.read(info)
                if info.filename.endswith(".dist-info/RECORD"):  # pip reads it to know what it installed
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if not _dropped(line)).encode()
                out.writestr(info, data)
    before = wheel.stat().st_size
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="the folder of downloaded wheels (.whl)")
    folder = ap.parse_args().folder
    wheels = sorted(folder.glob("nixl_cu1*.whl"))
    if not wheels:
        print(f"error: no nixl_cu12/nixl_cu13 wheel in {folder}", file=sys.stderr)
        sys.exit(2)
    for w in wheels:
        saved = slim(w)
        print(f"{w.name}: {saved / 1e6:.1f} MB dropped" if saved else f"{w.name}: nothing to drop")


if __name__ == "__main__":
    main()
