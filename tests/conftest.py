"""Shared test settings.

Hypothesis runs derandomized under CI (CI=true), so a CI failure replays exactly on a laptop with
`CI=true uv run pytest <test id>`; locally it explores new examples each run.
"""

from __future__ import annotations

import os

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
