"""The runtime's control-plane authentication: keys from the config, a key file or the
environment (backends/zmqctl/auth.py), and the sender a core message names, so a frame's
authenticated sender must be the one its payload claims. Threat model: docs/security.md."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import msgspec
from kvferry.backends.zmqctl.auth import ENV_KEY, ENV_KEY_FILE, AuthConfigError, ControlAuth, load_keys
from kvferry.core.messages import Endpoint

if TYPE_CHECKING:
    from kvferry.backends.runtime.base import RuntimeConfig

__all__ = ["control_auth", "ephemeral_key", "message_src"]


class _Src(msgspec.Struct):
    src: Endpoint


_src_decoder = msgspec.msgpack.Decoder(_Src)


def message_src(payload: bytes) -> str | None:
    """``str(src)`` of a control message (every core message names its sender), or None if the
    payload is not one: the engine then rejects it as garbage, from an authenticated peer."""
    try:
        return str(_src_decoder.decode(payload).src)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def control_auth(config: RuntimeConfig) -> ControlAuth | None:
    """The endpoint's authenticator; None only under ``control_insecure`` (the plane logs a
    warning). Raises AuthConfigError when no key is configured anywhere."""
    keys = load_keys(config.control_keys, config.control_key_file)
    if keys:
        return ControlAuth(keys, max_age_s=config.control_max_age_s, src_of=message_src)
    if config.control_insecure:
        return None
    raise AuthConfigError(
        "no control-plane key: set RuntimeConfig.control_keys or control_key_file, or "
        f"${ENV_KEY} / ${ENV_KEY_FILE}; or control_insecure=True to run unauthenticated"
    )


def ephemeral_key() -> str:
    """A fresh random key, for endpoints that all live in one process (benchmarks, examples)."""
    return "hex:" + secrets.token_hex(32)
