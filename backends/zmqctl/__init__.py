"""Real control plane: ZMQ PUSH/PULL between ranks, one IO thread per endpoint, bounded queues."""

from kvferry.backends.zmqctl.plane import ControlPlane, ControlPlaneError, Inbound

__all__ = ["ControlPlane", "ControlPlaneError", "Inbound"]
