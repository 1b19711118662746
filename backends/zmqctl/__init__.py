"""Real control plane: ZMQ PUSH/PULL between ranks, one IO thread per endpoint, bounded queues,
one packed frame per message, authenticated with a shared key (auth.py)."""

from kvferry.backends.zmqctl.auth import AuthConfigError, ControlAuth, load_keys
from kvferry.backends.zmqctl.plane import ControlPlane, ControlPlaneError, Inbound, pack_parts, unpack_parts

__all__ = [
    "AuthConfigError",
    "ControlAuth",
    "ControlPlane",
    "ControlPlaneError",
    "Inbound",
    "load_keys",
    "pack_parts",
    "unpack_parts",
]
