"""Shared test settings.

Hypothesis runs derandomized under CI (CI=true), so a CI failure replays exactly on a laptop with
`CI=true uv run pytest <test id>`; locally it explores new examples each run.
"""

from __future__ import annotations

import os
import sys

import pytest
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


@pytest.fixture(autouse=True)
def _lock_discipline():
    yield
    # Only tests that built an endpoint imported it (a pure simulation test pays nothing).
    lockcheck = sys.modules.get("kvferry.backends.lockcheck")
    if lockcheck is not None and lockcheck.VIOLATIONS:
        found = list(lockcheck.VIOLATIONS)
        del lockcheck.VIOLATIONS[:]
        raise AssertionError(f"lock discipline violated: {found[:3]}")
