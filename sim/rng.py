"""Named random streams derived from one root seed.

Every random choice in a simulated run draws from a stream named after what it decides
("fabric", "faults.control", "workload", ...). Streams are independent: adding draws to one never
shifts another, so a change in fault injection does not reshuffle the workload. No global RNG.
"""

from __future__ import annotations

import hashlib
import random


def derive_seed(root: int, name: str) -> int:
    """A 64-bit seed for stream ``name``, stable across Python versions and platforms."""
    digest = hashlib.blake2b(f"{root}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Streams:
    """The streams of one run. ``streams["faults.control"]`` always returns the same generator."""

    def __init__(self, root_seed: int) -> None:
        if root_seed < 0:
            raise ValueError("seeds are non-negative integers")
        self.root_seed = root_seed
        self._streams: dict[str, random.Random] = {}

    def __getitem__(self, name: str) -> random.Random:
        rng = self._streams.get(name)
        if rng is None:
            rng = self._streams[name] = random.Random(derive_seed(self.root_seed, name))
        return rng
