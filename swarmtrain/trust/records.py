"""Signed DHT records, and the validators every swarmtrain DHT node runs.

A record's value is an envelope `{key, body, pub, sig}`: the key's name, the record itself
(msgpack bytes), the signer's RSA public key and its signature over (key, subkey, body,
expiration time). `RecordValidator` accepts a record only if
- the key's name hashes to the DHT key it is stored under,
- the subkey is the peer id of `pub` (so each peer writes only its own records),
- the signature holds (so nobody can change a record or extend its life), and
- the body is what that key holds (`swarmtrain.wire.keys.check_record`).
hivemind calls `validate` on every node asked to store a record and on every record a
lookup returns, so a forged record is dropped by every honest node that sees it.

`SealValidator` adds a private swarm's key (`--swarm-key`): each value is encrypted and
authenticated with AES-GCM under a subkey of it, bound to the record's key, subkey and
expiration. A node without the key can neither read a record nor store one others keep.

This follows hivemind's own `RSASignatureValidator` (sign, validate, strip, priorities),
with the owner's key in the value rather than in the key, so one peer's records share a
subkey with its libp2p identity.
"""

from __future__ import annotations

import base64
import logging
import os
import struct
from collections import OrderedDict
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from swarmtrain.errors import ConfigError
from swarmtrain.trust.identity import Identity, peer_id_of, verify
from swarmtrain.trust.swarmkey import SwarmKey
from swarmtrain.wire.keys import check_record

logger = logging.getLogger(__name__)

RECORD_TAG = "swarmtrain-record-1"
ENVELOPE_FIELDS = frozenset({"key", "body", "pub", "sig"})
MAX_VALUE_BYTES = 64 * 1024
"""Largest record a node stores (a manifest with a long model config is a few KiB)."""
SEAL_TAG = b"stsk1"
VERIFIED_CACHE = 4096
"""Signatures remembered as checked (a lookup returns the same records again and again)."""


def _signed_bytes(key: str, subkey: str, body: bytes, expiration_time: float) -> bytes:
    return MSGPackSerializer.dumps([RECORD_TAG, key, subkey, body, float(expiration_time)])


def sign_record(identity: Identity, key: str, body: Any, expiration_time: float) -> dict:
    """The envelope to store under `key`, subkey `identity.peer_id`, expiring at `expiration_time`."""
    body_bytes = MSGPackSerializer.dumps(body)
    sig = identity.sign(_signed_bytes(key, identity.peer_id, body_bytes, expiration_time))
    return {"key": key, "body": body_bytes, "pub": identity.public_der, "sig": sig}


def open_record(envelope: Any) -> Any:
    """The record inside an envelope a validating DHT returned (already checked by it)."""
    return MSGPackSerializer.loads(envelope["body"])


def check_envelope(record: DHTRecord) -> str:
    """Raise ConfigError unless `record` is a well-signed swarmtrain record; returns its key name."""
    if len(record.value) > MAX_VALUE_BYTES:
        raise ConfigError(f"record of {len(record.value)} bytes (at most {MAX_VALUE_BYTES})")
    try:
        envelope = MSGPackSerializer.loads(record.value)
        subkey = MSGPackSerializer.loads(record.subkey)
    except Exception as e:
        raise ConfigError(f"undecodable record: {e!r}") from None
    if not isinstance(envelope, dict) or set(envelope) != ENVELOPE_FIELDS:
        raise ConfigError("not a signed swarmtrain record")
    key, body, pub, sig = (envelope[f] for f in ("key", "body", "pub", "sig"))
    if not (
        isinstance(key, str) and isinstance(body, bytes) and isinstance(pub, bytes) and isinstance(sig, bytes)
    ):
        raise ConfigError("signed record with fields of the wrong types")
    if DHTID.generate(source=key).to_bytes() != record.key:
        raise ConfigError(f"record names key {key!r} but is stored under another")
    if not isinstance(subkey, str) or subkey != peer_id_of(pub):
        raise ConfigError(f"record under subkey {subkey!r} is not signed by that peer")
    if not verify(pub, sig, _signed_bytes(key, subkey, body, record.expiration_time)):
        raise ConfigError(f"bad signature on {key!r} by {subkey}")
    try:
        check_record(key, subkey, MSGPackSerializer.loads(body))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"malformed {key!r} record: {e!r}") from None
    return key


class RecordValidator(RecordValidatorBase):
    """Accepts only signed, schema-checked swarmtrain records (see the module docstring)."""

    def __init__(self):
        self._checked: OrderedDict[tuple, bool] = OrderedDict()
        self.rejected = 0

    def validate(self, record: DHTRecord) -> bool:
        memo = (record.key, record.subkey, record.value, record.expiration_time)
        if memo in self._checked:
            self._checked.move_to_end(memo)
            return self._checked[memo]
        try:
            check_envelope(record)
            ok = True
        except ConfigError as e:
            self.rejected += 1
            logger.debug("dropped a DHT record: %s", e)
            ok = False
        self._checked[memo] = ok
        if len(self._checked) > VERIFIED_CACHE:
            self._checked.popitem(last=False)
        return ok

    @property
    def priority(self) -> int:
        return 10  # after unsealing (SealValidator), before nothing

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RecordValidator)


class SealValidator(RecordValidatorBase):
    """A private swarm's seal on every record: AES-GCM under the swarm key (see the module docstring)."""

    def __init__(self, swarm_key: SwarmKey):
        self._aead = AESGCM(swarm_key.derive("records"))

    @staticmethod
    def _bound_to(record: DHTRecord) -> bytes:
        return record.key + struct.pack(">d", record.expiration_time) + record.subkey

    def sign_value(self, record: DHTRecord) -> bytes:
        nonce = os.urandom(12)
        return SEAL_TAG + nonce + self._aead.encrypt(nonce, record.value, self._bound_to(record))

    def _open(self, record: DHTRecord) -> bytes | None:
        value = record.value
        if not value.startswith(SEAL_TAG) or len(value) < len(SEAL_TAG) + 12 + 16:
            return None
        nonce = value[len(SEAL_TAG) : len(SEAL_TAG) + 12]
        try:
            return self._aead.decrypt(nonce, value[len(SEAL_TAG) + 12 :], self._bound_to(record))
        except InvalidTag:
            return None

    def validate(self, record: DHTRecord) -> bool:
        return self._open(record) is not None

    def strip_value(self, record: DHTRecord) -> bytes:
        opened = self._open(record)
        return record.value if opened is None else opened

    @property
    def priority(self) -> int:
        return 20  # sealed last, opened first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def validators(swarm_key: SwarmKey | None) -> list[RecordValidatorBase]:
    """The validators a swarmtrain DHT node runs: signatures and schemas, and the seal of a private swarm."""
    return [RecordValidator()] + ([SealValidator(swarm_key)] if swarm_key is not None else [])


MAX_PROOF_BYTES = 8 * 1024
"""Largest membership proof a frame may carry (a peer record's envelope is about 1 KiB)."""
PROOF_SLACK_S = 60.0
"""How long past its expiration a membership proof still holds. A record lives a few heartbeats
in the DHT, but a frame carrying it can take longer than that to cross a congested link; the
caller presenting it is alive (it is calling), and could announce itself again anyway."""


def member_proof(envelope: dict, expiration_time: float) -> str:
    """A peer's signed record as a frame's meta carries it (a string, as meta values are): the
    base64 of msgpack [key, body, pub, sig, expiration]."""
    fields = [envelope["key"], envelope["body"], envelope["pub"], envelope["sig"], float(expiration_time)]
    return base64.b64encode(MSGPackSerializer.dumps(fields)).decode("ascii")


def open_member_proof(proof: Any, *, key: str, signer: str, now: float) -> Any:
    """The record inside a proof that `signer` wrote it under `key` and that it has not expired
    by `now` (DHT time): the same checks a DHT node makes of the record. ConfigError names what
    is wrong."""
    if not isinstance(proof, str) or len(proof) > 2 * MAX_PROOF_BYTES:
        raise ConfigError(f"a membership proof is a string of at most {2 * MAX_PROOF_BYTES} characters")
    try:
        fields = MSGPackSerializer.loads(base64.b64decode(proof, validate=True))
    except Exception:
        raise ConfigError("a membership proof is base64 of msgpack") from None
    if not isinstance(fields, list | tuple) or len(fields) != 5:
        raise ConfigError("a membership proof is [key, body, pub, sig, expiration]")
    proof_key, body, pub, sig, expiration = fields
    if not (
        isinstance(proof_key, str)
        and isinstance(body, bytes)
        and isinstance(pub, bytes)
        and isinstance(sig, bytes)
        and isinstance(expiration, int | float)
    ):
        raise ConfigError("membership proof with fields of the wrong types")
    if len(body) + len(pub) + len(sig) > MAX_PROOF_BYTES:
        raise ConfigError(f"membership proof over {MAX_PROOF_BYTES} bytes")
    if proof_key != key:
        raise ConfigError(f"membership proof of {proof_key!r}, not of {key!r}")
    if peer_id_of(pub) != signer:
        raise ConfigError("membership proof signed by another peer than the caller")
    if expiration + PROOF_SLACK_S <= now:
        raise ConfigError(f"membership proof expired over {PROOF_SLACK_S:.0f} s ago")
    if not verify(pub, sig, _signed_bytes(key, signer, body, expiration)):
        raise ConfigError("bad signature on the membership proof")
    record = MSGPackSerializer.loads(body)
    check_record(key, signer, record)
    return record
