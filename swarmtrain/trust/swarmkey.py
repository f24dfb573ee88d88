"""The shared secret of a private swarm (`--swarm-key FILE`, made by `swarmtrain keygen`).

Every peer of a private swarm holds the same 32 random bytes. With them a peer
- seals each DHT record it stores (authenticated encryption: a peer without the key can
  neither read a record nor store one that others keep), and
- answers the challenge every stream opens with (an HMAC bound to the nonce and both peer
  ids), before any frame is read.

Without `--swarm-key` the swarm is open, as libp2p and hivemind leave it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.errors import ConfigError

KEY_BYTES = 32
HEADER = "swarmtrain-swarm-key-v1"
"""First line of a swarm key file; the second is the key as 64 hex digits."""


@dataclass(frozen=True)
class SwarmKey:
    """A private swarm's secret. `derive(purpose)` gives an independent subkey per use, so a
    MAC made for streams can never pass as one made for records."""

    secret: bytes

    def __post_init__(self):
        if not isinstance(self.secret, bytes) or len(self.secret) != KEY_BYTES:
            raise ConfigError(f"a swarm key is {KEY_BYTES} bytes")

    def __repr__(self) -> str:  # never print the secret
        return f"SwarmKey(fingerprint={self.fingerprint})"

    @property
    def fingerprint(self) -> str:
        """8 hex digits that name the key in logs and the dashboard (they reveal nothing of it)."""
        return hashlib.sha256(b"swarmtrain fingerprint\0" + self.secret).hexdigest()[:8]

    def derive(self, purpose: str) -> bytes:
        """A 32-byte subkey for one purpose ('records', 'streams')."""
        return hmac.new(self.secret, b"swarmtrain/" + purpose.encode(), hashlib.sha256).digest()

    def mac(self, purpose: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 under the `purpose` subkey over `parts` (each length-prefixed, so the
        split between parts is part of what is signed)."""
        h = hmac.new(self.derive(purpose), digestmod=hashlib.sha256)
        for part in parts:
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.digest()

    def verify(self, tag: bytes, purpose: str, *parts: bytes) -> bool:
        return hmac.compare_digest(tag, self.mac(purpose, *parts))


def generate_swarm_key(path: str | os.PathLike) -> SwarmKey:
    """Write a new random swarm key to `path` (readable by its owner only); refuses to
    overwrite an existing file."""
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path} already exists: keygen never overwrites a key; pick another path")
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {path}: the folder {path.parent} does not exist")
    key = SwarmKey(secrets.token_bytes(KEY_BYTES))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{HEADER}\n{key.secret.hex()}\n")
    return key


def load_swarm_key(path: str | os.PathLike) -> SwarmKey:
    """Read a key file written by `generate_swarm_key`; ConfigError names what is wrong."""
    path = Path(path)
    hint = "make one with `swarmtrain keygen PATH` and give every peer of the swarm the same file"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--swarm-key {path}: no such file; {hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--swarm-key {path}: cannot read it ({e}); {hint}") from None
    lines = text.split()
    if len(lines) != 2 or lines[0] != HEADER:
        raise ConfigError(
            f"--swarm-key {path} is not a swarm key file (its first line is not {HEADER!r}); {hint}"
        )
    try:
        secret = bytes.fromhex(lines[1])
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise ConfigError(f"--swarm-key {path}: the key must be {2 * KEY_BYTES} hex digits; {hint}")
    return SwarmKey(secret)
