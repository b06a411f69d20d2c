"""API keys and team names (pure: no I/O).

A key is shown once, when it is made; the ledger keeps only its SHA-256 and a short prefix. The
prefix is what operators see in listings and on usage rows, so a key can be told apart and revoked
without anyone ever handling the secret again.
"""

from __future__ import annotations

import hashlib
import re
import secrets

KEY_MARKER = "im-"
PREFIX_LENGTH = 11  # "im-" and 8 random characters: 48 bits, enough to tell keys apart
_RANDOM_BYTES = 30  # url-safe base64 of 30 bytes is exactly 40 characters, no padding
_TEAM_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def hash_key(key: str) -> str:
    """The SHA-256 (hex) under which a key is stored and looked up."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_prefix(key: str) -> str:
    return key[:PREFIX_LENGTH]


def new_key() -> tuple[str, str, str]:
    """A fresh key: (key, prefix, key_hash). The key itself must be shown once and then forgotten."""
    key = KEY_MARKER + secrets.token_urlsafe(_RANDOM_BYTES)
    return key, key_prefix(key), hash_key(key)


def valid_team_name(name: object) -> bool:
    """Team names become subject tokens and KV keys elsewhere, so they stay to a safe alphabet."""
    return isinstance(name, str) and _TEAM_NAME.fullmatch(name) is not None
