"""Shared test settings.

Hypothesis runs derandomized under CI (CI=true), so a CI failure replays exactly on a laptop with
`CI=true uv run pytest <test id>`; locally it explores new examples each run.
"""

from __future__ import annotations

import os
import sys

import pytest
import typer
import typer.main
import typer.testing
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Endpoints refuse to start without a control-plane key (docs/security.md): every endpoint a test
# builds, and the processes tests start (they inherit the environment), share this one.
os.environ.setdefault("KVFERRY_CONTROL_KEY", "kvferry-test-control-key-not-secret")

# Lock discipline debug mode (backends/lockcheck.py): every endpoint's engine asserts that
# whoever enters it holds the endpoint lock; a violation in any thread fails the test it ran in.
os.environ.setdefault("KVFERRY_LOCK_CHECK", "1")

# No UCX mmap hooks where there is no GPU: installing them (UCX 1.23 patches the code of mmap,
# munmap, ...) spins ~0.4 s of CPU in every process's first UCX context, and the suite starts
# hundreds. They only feed UCX's registration caches, and tcp and cma (all a CPU box has) register
# nothing; UCX runs without the cache (docs/benchmarks.md, "CI wall time, fourth pass"). GPU
# hosts keep UCX's default. ("reloc" hooks crash a later torch import.)
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("UCX_MEM_MMAP_HOOK_MODE", "none")


@pytest.fixture(autouse=True)
def _own_run_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """The capacity search keeps its runs on disk (sim/deploy/run_cache.py): each test gets an
    empty directory of its own, so no test answers from another's runs or writes to ~/.cache."""
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path_factory.mktemp("runs")))


@pytest.fixture(autouse=True)
def _lock_discipline():
    yield
    # Only tests that built an endpoint imported it (a pure simulation test pays nothing).
    lockcheck = sys.modules.get("kvferry.backends.lockcheck")
    if lockcheck is not None and lockcheck.VIOLATIONS:
        found = list(lockcheck.VIOLATIONS)
        del lockcheck.VIOLATIONS[:]
        raise AssertionError(f"lock discipline violated: {found[:3]}")


# typer's CliRunner builds the whole click command tree from the app at every invoke (20-40 ms for
# kvferry's: every command's signature and type hints read again), which was most of the time of
# the CLI tests' ~3,000 invokes. The tree depends only on what is registered, so it is built once
# per app and registration state; a command registered later (register_all) makes a new one.
_COMMANDS: dict[tuple[int, int, int, int], tuple[typer.Typer, object]] = {}


def _registration(app: typer.Typer) -> tuple[int, int, int, int]:
    return (id(app), len(app.registered_commands), len(app.registered_groups), id(app.registered_callback))


def _command_built_once(app: typer.Typer) -> object:
    key = _registration(app)
    hit = _COMMANDS.get(key)
    if hit is None or hit[0] is not app:  # the app itself is kept, so its id is not reused
        hit = _COMMANDS[key] = (app, typer.main.get_command(app))
    return hit[1]


typer.testing._get_command = _command_built_once  # type: ignore[assignment]
