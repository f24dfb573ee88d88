"""A peer's persistent identity: the RSA key its libp2p peer id is made from.

The key file is what hivemind's p2p daemon reads (`identity_path`), so the peer id, and with
a remembered port the coordinator's printed address, survive restarts. The same key signs
the peer's DHT records (`swarmtrain.trust.records`): a record under subkey X is accepted
only if X is the peer id of the key that signed it.

Without `--identity`, a peer uses `<data dir>/identity/<role>-<n>.key`, taking the first `n`
no other running process of this machine holds (a lock file beside the key), so several
peers of one role on one machine each keep their own id from run to run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

from swarmtrain.errors import ConfigError

MAX_SLOTS = 64
"""Default identities one role may have on one machine (peers of that role running at once)."""
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)


def data_dir() -> Path:
    """Where swarmtrain keeps a user's keys and pins: $SWARMTRAIN_HOME, else
    $XDG_DATA_HOME/swarmtrain, else ~/.local/share/swarmtrain."""
    if os.environ.get("SWARMTRAIN_HOME"):
        return Path(os.environ["SWARMTRAIN_HOME"])
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "swarmtrain"


def public_key_bytes(public_key: rsa.RSAPublicKey) -> bytes:
    """The DER form of an RSA public key, as records carry it."""
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def peer_id_of(public_der: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in DER form, as libp2p derives it."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def verify(public_der: bytes, signature: bytes, data: bytes) -> bool:
    """Whether `signature` is the RSA-PSS signature of `data` by the key `public_der`."""
    try:
        key = serialization.load_der_public_key(public_der)
        if not isinstance(key, rsa.RSAPublicKey):
            return False
        key.verify(signature, data, _PSS, hashes.SHA256())
        return True
    except Exception:  # a malformed key or signature off the wire is just an invalid one
        return False


@dataclass
class Identity:
    """A loaded key file: its path, peer id, and the private key that signs records."""

    path: Path
    peer_id: str
    _private: rsa.RSAPrivateKey = field(repr=False)
    _lock: object = field(default=None, repr=False)
    public_der: bytes = field(init=False, repr=False)

    def __post_init__(self):
        self.public_der = public_key_bytes(self._private.public_key())

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data, _PSS, hashes.SHA256())

    @classmethod
    def load(cls, path: str | os.PathLike, *, create: bool = True, lock=None) -> Identity:
        """Read the key at `path`, making it first if it does not exist (and `create`).
        ConfigError names the file and what is wrong with it."""
        path = Path(path).expanduser()
        if not path.exists():
            if not create:
                raise ConfigError(f"--identity {path}: no such key file")
            if not path.parent.is_dir():
                raise ConfigError(
                    f"--identity {path}: the folder {path.parent} does not exist; create it first"
                )
            P2P.generate_identity(str(path))
        try:
            data = path.read_bytes()
            key_data = crypto_pb2.PrivateKey.FromString(data)
            if key_data.key_type != crypto_pb2.RSA:
                raise ValueError("not an RSA key")
            private = serialization.load_der_private_key(key_data.data, password=None)
            if not isinstance(private, rsa.RSAPrivateKey):
                raise ValueError("not an RSA key")
        except OSError as e:
            raise ConfigError(f"--identity {path}: cannot read it ({e.strerror})") from None
        except Exception as e:
            raise ConfigError(
                f"--identity {path} is not a peer key ({e}): give a file swarmtrain made, or a new path "
                "and one is made there"
            ) from None
        return cls(path=path, peer_id=PeerID.from_identity(data).to_base58(), _private=private, _lock=lock)

    @classmethod
    def default(cls, role: str) -> Identity:
        """This machine's identity for `role`: the first `<role>-<n>.key` under the data dir
        that no running process holds (its lock is held until this process exits)."""
        folder = default_identity_path(role).parent
        for n in range(MAX_SLOTS):
            lock = open(folder / f"{role}-{n}.lock", "a")  # noqa: SIM115 (held for the process's life)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            return cls.load(folder / f"{role}-{n}.key", lock=lock)
        raise ConfigError(
            f"{MAX_SLOTS} {role} peers already run on this machine under default identities: "
            "give this one --identity PATH"
        )

    def remembered_port(self) -> int | None:
        """The port this identity listened on last time (so its address stays the same), if any."""
        try:
            port = int((self.path.parent / (self.path.name + ".port")).read_text())
        except (OSError, ValueError):
            return None
        return port if 0 < port < 65536 else None

    def remember_port(self, port: int) -> None:
        with contextlib.suppress(OSError):  # a read-only key folder only costs the same address next time
            (self.path.parent / (self.path.name + ".port")).write_text(f"{port}\n")


def default_identity_path(role: str, slot: int = 0) -> Path:
    """Where this machine's `slot`-th default identity of `role` lives (it may not exist yet)."""
    folder = data_dir() / "identity"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / f"{role}-{slot}.key"


def identity_of(path: str | os.PathLike | None, role: str) -> Identity:
    """The identity a command runs under: `--identity PATH` (made if missing), else the default for `role`."""
    return Identity.default(role) if path is None else Identity.load(path)
