"""Authenticated control frames: a shared key, HMAC-SHA256 tags, incarnations, replay checks.

An authenticated message is four parts ``[sender_id, reply_address, header, payload]``, packed
into one ZMQ frame by the control plane (``plane.pack_parts``).
The header is fixed size (``HEADER``): a version byte, the signing key's id (a fingerprint, never
the key), the sender's incarnation (wall-clock ns when its control plane started, so a restarted
process has a larger one), the sender's wall clock at sending, a per-incarnation sequence number,
and the tag. The tag is HMAC-SHA256 under the key over a domain string, the header fields, the
sender id, the reply address, the *recipient* id, and the payload: a frame cannot be relabelled
to another sender, redirected to another recipient, or altered.

The receiver checks, in this order, and counts a rejection by reason (nothing rejected reaches
the caller, so never the engine): frame shape (``malformed``, ``untagged``), a key it accepts
(``unknown_key``), the tag (``bad_tag``), freshness (``stale``: sent more than ``max_age_ns`` ago
by the sender's clock), the sender's incarnation (``old_incarnation``: older than the newest
seen from that sender, i.e. a frame of a past life of the peer) and sequence
(``replayed``: not above the last accepted from that incarnation), and optionally that the payload
names the frame's sender (``identity_mismatch``). A rejected frame changes no state.

Keys: one or two. The first signs, all are accepted, so a key is rotated without downtime:
``(old, new)`` everywhere, then ``(new, old)``, then ``(new,)``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.core.errors import KvferryError

__all__ = [
    "ENV_KEY",
    "ENV_KEY_FILE",
    "HEADER",
    "AuthConfigError",
    "ControlAuth",
    "load_keys",
]

log = logging.getLogger(__name__)

ENV_KEY = "KVFERRY_CONTROL_KEY"  # one key, or two separated by a comma (signing key first)
ENV_KEY_FILE = "KVFERRY_CONTROL_KEY_FILE"
VERSION = 1
_DOMAIN = b"kvferry-control/1\x00"
_FIXED = struct.Struct(">B8sQQQ")  # version, key id, incarnation, sent_ns, seq
HEADER = _FIXED.size + 32
MIN_KEY_BYTES = 16
MAX_KEYS = 2
DEFAULT_MAX_AGE_S = 300.0


class AuthConfigError(KvferryError, ValueError):
    """No usable control key (or a bad one): the endpoint refuses to start unauthenticated."""


def _key_id(key: bytes) -> bytes:
    return hashlib.sha256(b"kvferry-key-id\x00" + key).digest()[:8]


def _lp(b: bytes) -> bytes:
    return len(b).to_bytes(4, "big") + b


def _parse_key(text: str, where: str) -> bytes:
    """A key as text: ``hex:<hex>`` or any string of at least 16 bytes (used as UTF-8 bytes)."""
    text = text.strip()
    if text.startswith("hex:"):
        try:
            key = bytes.fromhex(text[4:])
        except ValueError:
            raise AuthConfigError(f"{where}: 'hex:' key is not hexadecimal") from None
    else:
        key = text.encode()
    if len(key) < MIN_KEY_BYTES:
        raise AuthConfigError(f"{where}: a control key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def load_keys(
    keys: Sequence[str] = (), key_file: str = "", env: dict[str, str] | None = None
) -> tuple[bytes, ...]:
    """The control keys, signing key first, from the first source that has any: ``keys``, then
    ``key_file`` (one key a line, ``#`` comments), then ``$KVFERRY_CONTROL_KEY`` (comma
    separated), then ``$KVFERRY_CONTROL_KEY_FILE``. Empty if none is set."""
    env = dict(os.environ) if env is None else env
    sources: list[tuple[str, list[str]]] = []
    if keys:
        sources.append(("control_keys", list(keys)))
    elif key_file:
        sources.append((key_file, _read_key_file(key_file)))
    elif env.get(ENV_KEY):
        sources.append((ENV_KEY, env[ENV_KEY].split(",")))
    elif env.get(ENV_KEY_FILE):
        sources.append((env[ENV_KEY_FILE], _read_key_file(env[ENV_KEY_FILE])))
    if not sources:
        return ()
    where, texts = sources[0]
    texts = [t for t in texts if t.strip()]
    if not texts or len(texts) > MAX_KEYS:
        raise AuthConfigError(f"{where}: expected 1 or {MAX_KEYS} control keys, got {len(texts)}")
    return tuple(_parse_key(t, where) for t in texts)


def _read_key_file(path: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise AuthConfigError(f"control key file {path}: {exc.strerror or exc}") from None
    return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


@dataclass
class _PeerState:
    incarnation: int
    seq: int


@dataclass
class ControlAuth:
    """Signs outbound and checks inbound frames for one control plane (IO thread only, except
    ``rejected``, which other threads may read).

    ``src_of``: the sender named inside a payload (None if it names none or cannot be read); when
    given, a payload naming another sender than its frame is rejected (``identity_mismatch``).
    ``clock_ns``: wall clock, injectable for tests.
    """

    keys: tuple[bytes, ...]
    max_age_s: float = DEFAULT_MAX_AGE_S
    src_of: Callable[[bytes], str | None] | None = None
    clock_ns: Callable[[], int] = time.time_ns
    incarnation: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    accepted: int = 0

    def __post_init__(self) -> None:
        if not 1 <= len(self.keys) <= MAX_KEYS:
            raise AuthConfigError(f"expected 1 or {MAX_KEYS} control keys, got {len(self.keys)}")
        for k in self.keys:
            if len(k) < MIN_KEY_BYTES:
                raise AuthConfigError(f"a control key needs at least {MIN_KEY_BYTES} bytes")
        self._by_id = {_key_id(k): k for k in self.keys}
        self._sign_id = _key_id(self.keys[0])
        if not self.incarnation:
            self.incarnation = max(1, self.clock_ns())
        self._seq = 0
        self._peers: dict[bytes, _PeerState] = {}
        self._max_age_ns = int(self.max_age_s * 1e9)

    # ---- sending ------------------------------------------------------------------------------
    def sign(self, sender: bytes, reply: bytes, recipient: bytes, payload: bytes) -> bytes:
        """The header frame for one outbound message."""
        self._seq += 1
        fixed = _FIXED.pack(VERSION, self._sign_id, self.incarnation, self.clock_ns(), self._seq)
        return fixed + self._tag(self.keys[0], fixed, sender, reply, recipient, payload)

    @staticmethod
    def _tag(
        key: bytes, fixed: bytes, sender: bytes, reply: bytes, recipient: bytes, payload: bytes
    ) -> bytes:
        # One C call over the joined message (the same bytes, so the same tag as an HMAC object
        # fed part by part): a message costs one digest, not an object and six updates.
        msg = b"".join((_DOMAIN, fixed, _lp(sender), _lp(reply), _lp(recipient), payload))
        return hmac.digest(key, msg, "sha256")

    # ---- receiving ----------------------------------------------------------------------------
    def check(self, sender: bytes, reply: bytes, recipient: bytes, header: bytes, payload: bytes) -> str:
        """Empty if the frame is authentic, fresh and new (its sender's state then advances),
        else the reason it was rejected (counted)."""
        why = self._why(sender, reply, recipient, header, payload)
        if why:
            self.rejected[why] += 1
        else:
            self.accepted += 1
        return why

    def reject(self, reason: str) -> None:
        """Count a frame rejected before it could be checked (wrong frame count)."""
        self.rejected[reason] += 1

    def _why(self, sender: bytes, reply: bytes, recipient: bytes, header: bytes, payload: bytes) -> str:
        if len(header) != HEADER:
            return "untagged"
        fixed, tag = header[: _FIXED.size], header[_FIXED.size :]
        version, key_id, inc, sent_ns, seq = _FIXED.unpack(fixed)
        if version != VERSION:
            return "malformed"
        key = self._by_id.get(key_id)
        if key is None:
            return "unknown_key"
        if not hmac.compare_digest(tag, self._tag(key, fixed, sender, reply, recipient, payload)):
            return "bad_tag"
        if self.clock_ns() - sent_ns > self._max_age_ns:
            return "stale"
        st = self._peers.get(sender)
        if st is not None:
            if inc < st.incarnation:
                return "old_incarnation"
            if inc == st.incarnation and seq <= st.seq:
                return "replayed"
        if self.src_of is not None:
            named = self.src_of(payload)
            if named is not None and named.encode() != sender:
                return "identity_mismatch"
        if st is None:
            self._peers[sender] = _PeerState(inc, seq)
        else:
            st.incarnation, st.seq = inc, seq
        return ""


def warn_insecure(identity: str) -> None:
    log.warning(
        "control plane of %s is UNAUTHENTICATED (insecure flag): any process that reaches its port "
        "is believed, and its NIXL metadata loaded",
        identity,
    )
