"""Two real processes on loopback (a prefill server and a decode server over NIXL/UCX on DRAM),
driven segment by segment by a parent: the machinery behind ``kvferry soak``.

- ``plan``: the rooms both sides derive from one seed (no router messages needed).
- ``wire``: JSON lines between the parent and a side.
- ``prefill_side`` / ``decode_side``: the two processes (``python -m``).
- ``soak``: the parent: starts, kills (SIGKILL) and restarts the sides, checks every room.
"""
