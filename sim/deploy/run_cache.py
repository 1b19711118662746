"""Steady-state runs kept on disk, so the same question asked again (another plot, ``--json``, a
rate within the table) answers without simulating again.

A run is a pure function of its job (deployment spec, rate, workload, seeds, target) and of the
code that simulates it, so a kept result is the result. The key hashes both: the job, and every
source and profile file of the package with the versions of Python and of the libraries a run
goes through. Any edit to the simulator, a profile or a dependency leaves the old entries unread.

Entries are msgpack files (never pickle: a cache directory is a place others may write), one per
job, written whole under a temporary name and renamed into place, so two searches at once (or one
stopped by Ctrl-C) never leave half an entry; an entry that does not decode is counted, ignored and
written again.
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec
from kvferry.sim.deploy.metrics import DeployResult

__all__ = ["RunCache", "code_digest", "default_dir", "digest_of", "digested_files"]

_LIBRARIES = ("simpy", "msgspec", "numpy")
_SUFFIXES = (".py", ".toml", ".c")


def default_dir() -> Path:
    """``$KVFERRY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvferry/runs``, else ``~/.cache/kvferry/runs``."""
    if os.environ.get("KVFERRY_CACHE_DIR"):
        return Path(os.environ["KVFERRY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvferry" / "runs"


def digested_files() -> list[tuple[str, Path]]:
    """Every source and profile file a run's result may depend on, each with the name it is
    hashed under: kvferry's package and its core, backends and sim folders (the profiles live in
    sim/deploy/profiles)."""
    import kvferry
    from kvferry import backends, core, sim

    roots = {Path(m.__file__).resolve().parent for m in (kvferry, core, backends, sim)}
    return [
        (str(path.relative_to(root.parent)), path)
        for root in sorted(roots)
        for path in sorted(root.rglob("*"))
        if path.suffix in _SUFFIXES and "__pycache__" not in path.parts
    ]


def digest_of(files: Sequence[tuple[str, Path]]) -> str:
    """One hash of ``files``' names and bytes and of the interpreter's and libraries' versions."""
    h = hashlib.sha256()
    h.update(f"python {platform.python_implementation()} {platform.python_version()}\n".encode())
    for lib in _LIBRARIES:
        h.update(f"{lib} {metadata.version(lib)}\n".encode())
    for name, path in files:
        h.update(f"{name}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


_digest: str | None = None
_digest_lock = threading.Lock()


def code_digest() -> str:
    """What a run's result depends on besides its job (``digest_of(digested_files())``),
    computed once a process (a few hundred small files)."""
    global _digest
    with _digest_lock:
        if _digest is None:
            _digest = digest_of(digested_files())
        return _digest


# capacity.Job (spec, rate, workload, seeds, target) is the one statement of a job's shape;
# capacity imports this module, so the cache takes any tuple msgspec encodes.
Job = tuple[Any, ...]


@dataclass
class RunCache:
    """Results of steady-state jobs under ``root``; ``hits``, ``misses`` and ``bad`` (entries that
    did not decode) count this process's lookups. Safe to use from several threads."""

    root: Path
    hits: int = 0
    misses: int = 0
    bad: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def key(self, job: Job) -> str:
        h = hashlib.sha256(code_digest().encode())
        h.update(msgspec.msgpack.encode(job))
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.msgpack"

    def get(self, job: Job) -> list[DeployResult] | None:
        path = self._path(self.key(job))
        try:
            data = path.read_bytes()
        except OSError:
            with self._lock:
                self.misses += 1
            return None
        try:
            got = msgspec.msgpack.decode(data, type=list[DeployResult])
        except (msgspec.DecodeError, msgspec.ValidationError):
            with self._lock:
                self.bad += 1
                self.misses += 1
            return None
        with self._lock:
            self.hits += 1
        return got

    def put(self, job: Job, results: Sequence[DeployResult]) -> None:
        """Keep ``results``; a directory that cannot be written is not an error (the search goes
        on; the next one simulates again)."""
        path = self._path(self.key(job))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.msgpack.encode(list(results)))
            os.replace(tmp, path)
        except OSError:  # a full disk: no half entry left behind
            Path(tmp).unlink(missing_ok=True)

    def summary(self) -> str:
        """One line for the progress output."""
        bad = f", {self.bad} unreadable entries simulated again" if self.bad else ""
        kept = f"{self.hits} runs kept from earlier searches"
        return f"run cache {self.root}: {kept}, {self.misses} simulated{bad}"
