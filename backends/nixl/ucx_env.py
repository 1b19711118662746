"""UCX settings kvferry applies before it creates a NIXL agent, unless the user set them.

UCX reads its configuration from the environment when a NIXL agent creates its UCX backend, so
these are environment defaults: a variable the user exported always wins.

``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``: UCX's ``auto`` turns off cuda_ipc's zero-copy GET on GPUs
without an active NVLink (UCX pull request 7566: concurrent reads were slower than writes there).
A NIXL READ then has no GPU path at all and UCX emulates it over TCP loopback: measured on a
single-GPU H100 host, a 256 MiB READ between two processes on GPU 0 ran at 0.55 GB/s against a
1,400 GB/s WRITE (UCX's selection table: "remote memory read ... software emulation | tcp/lo").
The pull flow is made of READs, so it crawled at 0.001 of a write. NIXL later made the same
change for its own UCX plugin (ai-dynamo/nixl pull request 2208).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

UCX_DEFAULTS: dict[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def apply_ucx_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each default the environment lacks; return the ones this call set."""
    target = os.environ if env is None else env
    applied = {k: v for k, v in UCX_DEFAULTS.items() if k not in target}
    target.update(applied)
    return applied
