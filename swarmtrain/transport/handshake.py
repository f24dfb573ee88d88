"""The private swarm's stream handshake: both ends prove they hold the swarm key before a frame.

With a `SwarmKey`, every stream opens with one round trip before its request frame:

    opener -> responder   hello      b"STH1" | opener nonce (32 bytes)
    responder -> opener   challenge  b"STC1" | responder nonce (32) | responder tag (32)
    opener -> responder   proof      b"STP1" | opener tag (32), then the request frame

A tag is an HMAC under the key's "streams" subkey over its role, both nonces and both peer
ids (as libp2p authenticated them): it proves the key, is fresh, and is good on this stream
only; it cannot be replayed, passed off as the other role's, or relayed to a third peer.

The responder reads nothing but these fixed-size messages, each within the transport's read
timeout, until the proof checks out; it refuses with an ordinary error frame, which the
opener reads in place of a challenge or a reply. A peer without a key still recognises a
hello, and answers that it is in no private swarm rather than that the frame is bad.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.trust.swarmkey import SwarmKey
from swarmtrain.wire.frames import MAGIC, Frame, read_frame

HELLO, CHALLENGE, PROOF = b"STH1", b"STC1", b"STP1"
MAGIC_BYTES = 4
NONCE_BYTES = TAG_BYTES = 32
PURPOSE = "streams"
"""The swarm key's subkey for stream tags."""

START_WITH_KEY = "start with --swarm-key FILE, the same file every peer of the swarm uses"


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """Why a responder refuses a stream before reading its request."""

    message: str
    cause: Cause
    strike: bool
    """Whether the opener misbehaved (garbage, a wrong proof) rather than was misconfigured."""
    retryable: bool | None = None


def _signed(
    role: bytes, opener_nonce: bytes, responder_nonce: bytes, opener: str, responder: str
) -> tuple[bytes, ...]:
    """What a tag signs: its role, both nonces, both peer ids."""
    return role, opener_nonce, responder_nonce, opener.encode(), responder.encode()


async def open_stream(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: SwarmKey,
    *,
    opener: str,
    responder: str,
    timeout_s: float,
) -> bytes | Frame:
    """The opener's side: send a hello and check the responder's challenge.

    Returns the proof, to write just before the request frame, or the error frame the
    responder sent instead of a challenge (a refusal to raise). Raises RemoteError
    (UNAUTHORIZED) when the responder fails to prove it holds the key; our proof goes out
    first all the same, so that the responder learns why too.
    """
    opener_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(HELLO + opener_nonce)
    await writer.drain()
    magic = await asyncio.wait_for(reader.readexactly(MAGIC_BYTES), timeout_s)
    if magic == MAGIC:  # refused: an error frame (no tensors) in place of the challenge
        return await asyncio.wait_for(read_frame(reader, max_frame_bytes=0, first=magic), timeout_s)
    if magic != CHALLENGE:
        raise RemoteError(
            f"peer {responder[-8:]} answered the private swarm's hello with {magic!r}, neither a "
            f"challenge nor an error frame: it does not speak this version of swarmtrain",
            cause=Cause.UNAUTHORIZED,
            peer=responder,
            retryable=True,
        )
    challenge = await asyncio.wait_for(reader.readexactly(NONCE_BYTES + TAG_BYTES), timeout_s)
    responder_nonce, responder_tag = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    proof = PROOF + key.mac(PURPOSE, *_signed(b"opener", opener_nonce, responder_nonce, opener, responder))
    if key.verify(
        responder_tag, PURPOSE, *_signed(b"responder", opener_nonce, responder_nonce, opener, responder)
    ):
        return proof
    writer.write(proof)
    await writer.drain()
    # wait for its refusal: once that has come, the responder has counted our stream against us
    with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(1), timeout_s)
    raise RemoteError(
        f"peer {responder[-8:]} is not in your private swarm: it does not hold your swarm key "
        f"(fingerprint {key.fingerprint}); it belongs to another swarm, or you do. Every peer of a "
        f"private swarm starts with --swarm-key FILE, the same file everywhere",
        cause=Cause.UNAUTHORIZED,
        peer=responder,
        retryable=True,  # another peer may well hold the key
    )


async def accept_stream(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: SwarmKey | None,
    *,
    opener: str,
    responder: str,
    timeout_s: float,
) -> tuple[Refusal | None, bytes]:
    """The responder's side, before any frame is read.

    Returns (refusal, b"") to refuse the stream, or (None, bytes of the request frame already
    read) to go on and read the request. With a `key` the opener must first prove it holds
    it; without one, a stream is accepted unless it opens with a hello (an opener that
    believes we are in its private swarm). Raises IncompleteReadError if the stream ends.
    """
    try:
        magic = await asyncio.wait_for(reader.readexactly(MAGIC_BYTES), timeout_s)
    except asyncio.TimeoutError:
        message = f"request did not arrive within {timeout_s} s"
        return Refusal(message=message, cause=Cause.UNREACHABLE, strike=False), b""
    if key is None:
        if magic != HELLO:
            return None, magic
        return Refusal(
            message=f"peer {responder[-8:]} is not in your private swarm: it runs without --swarm-key, "
            f"so it does not hold your swarm key; start every peer of the swarm with the same key, or none",
            cause=Cause.UNAUTHORIZED,
            strike=False,
            retryable=True,  # another peer may well hold the key
        ), b""
    if magic == MAGIC:
        return Refusal(
            message=f"peer {responder[-8:]} belongs to a private swarm: {START_WITH_KEY}",
            cause=Cause.UNAUTHORIZED,
            strike=False,
        ), b""
    if magic != HELLO:
        return Refusal(
            message=f"not a swarmtrain stream: it opens with {magic!r}, neither a frame nor the private "
            f"swarm's hello",
            cause=Cause.BAD_FRAME,
            strike=True,
        ), b""
    try:
        opener_nonce = await asyncio.wait_for(reader.readexactly(NONCE_BYTES), timeout_s)
        responder_nonce = secrets.token_bytes(NONCE_BYTES)
        tag = key.mac(PURPOSE, *_signed(b"responder", opener_nonce, responder_nonce, opener, responder))
        writer.write(CHALLENGE + responder_nonce + tag)
        await writer.drain()
        proof = await asyncio.wait_for(reader.readexactly(MAGIC_BYTES + TAG_BYTES), timeout_s)
    except asyncio.TimeoutError:
        return Refusal(
            message=f"the private swarm's handshake did not complete within {timeout_s} s",
            cause=Cause.UNREACHABLE,
            strike=False,
        ), b""
    signed = _signed(b"opener", opener_nonce, responder_nonce, opener, responder)
    if proof[:MAGIC_BYTES] != PROOF or not key.verify(proof[MAGIC_BYTES:], PURPOSE, *signed):
        return Refusal(
            message=f"wrong proof of the private swarm's key: you hold another swarm key than peer "
            f"{responder[-8:]}; {START_WITH_KEY}",
            cause=Cause.UNAUTHORIZED,
            strike=True,
        ), b""
    return None, b""
