"""kvferry's UCX environment defaults: applied before an agent exists, never over the user's."""

from __future__ import annotations

import os
import subprocess
import sys

from kvferry.backends.nixl.ucx_env import UCX_DEFAULTS, apply_ucx_defaults


def test_a_default_fills_only_what_the_environment_lacks() -> None:
    env: dict[str, str] = {}
    assert apply_ucx_defaults(env) == UCX_DEFAULTS
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert apply_ucx_defaults(env) == {}  # a second call changes nothing


def test_the_users_setting_wins() -> None:
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}
    assert apply_ucx_defaults(env) == {}
    assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}


def test_making_a_real_agent_applies_the_defaults_first() -> None:
    """In a fresh process (UCX reads the environment once), as the runtime makes its agents."""
    code = (
        "import os\n"
        "from kvferry.backends.nixl.agent import make_nixl_agent\n"
        "make_nixl_agent('ucx-env-probe', 'rw', telemetry=False, ucx_threads=0)\n"
        "print(os.environ.get('UCX_CUDA_IPC_ENABLE_GET_ZCOPY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "y"
