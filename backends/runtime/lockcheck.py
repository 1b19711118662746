"""The lock-check debug mode's old import path: it lives in ``kvferry.backends.lockcheck`` (the
native executor and the copy executor use it too, below the runtime)."""

from kvferry.backends.lockcheck import *  # noqa: F403 (the same objects: VIOLATIONS is one list)
from kvferry.backends.lockcheck import __all__  # noqa: F401
