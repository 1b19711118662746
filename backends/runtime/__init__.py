"""Threaded runtime over the real backend: endpoints a serving engine would call.

``PrefillEndpoint``/``DecodeEndpoint`` (one per TP rank) own a NIXL agent, a ZMQ control plane,
the core's engine and its threads; ``KVSender``/``KVReceiver`` are per-room handles with SGLang's
shape (init, send, poll, failure_exception, abort, clear).
"""

from kvferry.backends.runtime.base import RuntimeConfig
from kvferry.backends.runtime.decode import DecodeEndpoint, KVReceiver, sender_specs
from kvferry.backends.runtime.errors import EndpointClosedError, KVTransferError
from kvferry.backends.runtime.prefill import KVSender, PrefillEndpoint

__all__ = [
    "DecodeEndpoint",
    "EndpointClosedError",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "PrefillEndpoint",
    "RuntimeConfig",
    "sender_specs",
]
