"""Tensor frames over hivemind P2P binary streams.

One stream per request: the caller opens a stream to a peer's handler, writes one frame and
reads one reply frame; every call has a timeout. The serving side reads and validates the
request (size limit, header, tensors) before its handler sees it, and answers a bad frame
with an error reply instead of failing: a misbehaving peer costs us one reply, and after
`max_strikes` bad frames it is banned for `ban_s` seconds. A request's bytes count against
its sender's budget (`max_peer_bytes_in_flight`) as they arrive, and a frame that stalls
half-sent is a strike too.

In a private swarm (a `SwarmKey`) every stream opens with the handshake of
`swarmtrain.transport.handshake`: the served side reads no frame until the caller has proved
it holds the key, and the caller sends none until the served side has.

Frames may carry compressed tensors (`Frame.codecs`); importing this module registers the
codecs, so every peer can read them. Byte counters count what went on the wire, and
`raw_bytes_sent` what that would have been uncompressed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

import swarmtrain.compress  # noqa: F401  (registers the codecs frames may carry)
from swarmtrain.errors import BadFrameError, Cause, PeerUnreachableError, RemoteError
from swarmtrain.transport.budget import PeerBudget
from swarmtrain.transport.handshake import accept_stream, open_stream
from swarmtrain.trust.swarmkey import SwarmKey
from swarmtrain.wire.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    PREFIX,
    Frame,
    error_frame,
    read_frame,
    write_frame,
)

logger = logging.getLogger(__name__)

LINGER_S = 10.0
"""How long a served stream waits for the caller to close after the reply (reading and dropping
the rest of a request it refused before reading it all)."""

Handler = Callable[[Frame, str], Awaitable[Frame]]
"""A served handler: (request frame, caller's base58 peer id) -> reply frame."""


async def _drain(reader: asyncio.StreamReader) -> None:
    """Read and drop what comes until the other side closes."""
    while await reader.read(2**16):
        pass


def handler_name(run_id: str) -> str:
    """The libp2p protocol name a run's stage peers serve; another run's id finds no handler."""
    return f"/swarmtrain/{run_id}/1"


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Limits of one peer's frame transport."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest payload accepted in one frame (requests and replies)."""
    read_timeout_s: float = 30.0
    """A request must arrive whole within this time (after the private swarm's handshake, whose
    every message must too); a frame whose prefix came but not the rest is a strike."""
    max_strikes: int = 3
    """Bad frames from one peer before it is banned."""
    ban_s: float = 60.0
    """How long a banned peer's requests are refused."""
    max_peer_bytes_in_flight: int | None = None
    """Most bytes one peer's requests may hold here at once, counted as they arrive and freed
    once answered; a peer over it is refused with a strike. None: room for four of the
    largest frames (4 x (max_frame_bytes + the largest header))."""

    def __post_init__(self):
        if self.max_frame_bytes < 1 or self.read_timeout_s <= 0 or self.max_strikes < 1 or self.ban_s < 0:
            raise ValueError(f"invalid transport limits: {self}")
        largest = self.max_frame_bytes + PREFIX.size + MAX_HEADER_BYTES
        if self.max_peer_bytes_in_flight is None:
            object.__setattr__(self, "max_peer_bytes_in_flight", 4 * largest)
        elif self.max_peer_bytes_in_flight < largest:
            raise ValueError(
                f"max_peer_bytes_in_flight is {self.max_peer_bytes_in_flight} bytes, less than one of the "
                f"largest frames ({largest} bytes: max_frame_bytes {self.max_frame_bytes}, its prefix and "
                f"the largest header)"
            )


class TensorTransport:
    """Serve and call frame handlers over one hivemind P2P instance (shared with the DHT)."""

    def __init__(
        self,
        p2p: P2P | None,
        config: TransportConfig | None = None,
        *,
        peer_id: str | None = None,
        swarm_key: SwarmKey | None = None,
    ):
        self.p2p = p2p
        self.config = config or TransportConfig()
        self.peer_id: str = peer_id if p2p is None else p2p.peer_id.to_base58()
        self.swarm_key = swarm_key
        """The private swarm's key (None: an open swarm, no handshake)."""
        self.budget = PeerBudget(self.config.max_peer_bytes_in_flight)
        """Bytes each peer's requests hold here now (`budget.total_bytes`, `budget.peak_bytes`)."""
        self._strikes: dict[str, int] = {}
        self._banned_until: dict[str, float] = {}
        self.bytes_sent = 0
        """Tensor payload bytes sent, as on the wire (compressed)."""
        self.bytes_received = 0
        """Tensor payload bytes received, as on the wire."""
        self.raw_bytes_sent = 0
        """Tensor bytes sent before compression."""

    # serving

    def is_banned(self, peer: str) -> bool:
        return self._banned_until.get(peer, 0.0) > time.monotonic()

    def strikes(self, peer: str) -> int:
        """Strikes against `peer` since it was last banned."""
        return self._strikes.get(peer, 0)

    def strike(self, peer: str, reason: str) -> None:
        """Count one bad frame against `peer`; ban it once it has `max_strikes`."""
        self._strikes[peer] = self._strikes.get(peer, 0) + 1
        logger.warning("bad frame from %s: %s (strike %d)", peer[-8:], reason, self._strikes[peer])
        if self._strikes[peer] >= self.config.max_strikes:
            self._banned_until[peer] = time.monotonic() + self.config.ban_s
            self._strikes[peer] = 0
            logger.warning(
                "banned peer %s for %.0f s after repeated bad frames", peer[-8:], self.config.ban_s
            )

    async def serve(self, name: str, handler: Handler) -> None:
        """Register `handler` under protocol `name` on this peer."""

        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            try:
                refusal, first = await self._admit(peer, reader, writer)
                reply = refusal or await self._answer(peer, reader, handler, first=first)
                if reply is not None:
                    self._count_sent(reply, await write_frame(writer, reply))
                    # Close only once the caller has closed its side: closing first can make
                    # the daemon reset the stream and cut off the tail of the reply. A refused
                    # caller may still be sending its request: what comes is read and dropped.
                    await asyncio.wait_for(_drain(reader), LINGER_S)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                logger.debug("stream from %s broke: %r", peer[-8:], e)
            except asyncio.CancelledError:  # this peer is shutting down: the caller sees the stream close
                pass  # (re-raised, the stream reader's callback would print it as an error)
            finally:
                writer.close()

        await self.p2p.add_binary_stream_handler(name, on_stream)

    def _banned(self, peer: str) -> Frame | None:
        """The refusal a banned peer gets, or None."""
        if not self.is_banned(peer):
            return None
        left = self._banned_until[peer] - time.monotonic()
        return error_frame(
            "", f"this peer bans you for another {left:.0f} s after repeated bad frames", cause=Cause.BANNED
        )

    async def _admit(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[Frame | None, bytes]:
        """Before any frame: (a refusal to send, or None and the bytes of the request read so far)."""
        if banned := self._banned(peer):
            return banned, b""
        refusal, first = await accept_stream(
            reader,
            writer,
            self.swarm_key,
            opener=peer,
            responder=self.peer_id,
            timeout_s=self.config.read_timeout_s,
        )
        if refusal is None:
            return None, first
        if refusal.strike:
            self.strike(peer, refusal.message)
        return error_frame("", refusal.message, cause=refusal.cause, retryable=refusal.retryable), b""

    async def _answer(
        self, peer: str, reader: asyncio.StreamReader, handler: Handler, *, first: bytes = b""
    ) -> Frame | None:
        if banned := self._banned(peer):
            return banned
        timeout_s = self.config.read_timeout_s
        with self.budget.hold(peer) as hold:  # the request's bytes, until it is answered
            try:
                request = await asyncio.wait_for(
                    read_frame(
                        reader, max_frame_bytes=self.config.max_frame_bytes, charge=hold.charge, first=first
                    ),
                    timeout_s,
                )
            except BadFrameError as e:
                self.strike(peer, str(e))
                return error_frame("", f"bad frame: {e}", cause=Cause.BAD_FRAME)
            except asyncio.TimeoutError:
                if not hold.nbytes:
                    return error_frame(
                        "", f"request did not arrive within {timeout_s} s", cause=Cause.UNREACHABLE
                    )
                # its prefix promised a frame that did not come: it held our memory and a stream
                message = (
                    f"frame stalled: {hold.nbytes} bytes of it arrived within {timeout_s} s, then no more"
                )
                self.strike(peer, message)
                return error_frame("", message, cause=Cause.UNREACHABLE)
            self.bytes_received += request.wire_nbytes
            try:
                return await handler(request, peer)
            except Exception as e:  # a bug here must cost one reply, not the caller's stream
                logger.exception("handler failed on a %s frame from %s", request.kind, peer[-8:])
                return error_frame(
                    request.run_id, f"internal error on this peer: {e!r}", cause=Cause.OWN_FAILURE
                )

    def _count_sent(self, frame: Frame, wire_nbytes: int) -> None:
        self.bytes_sent += wire_nbytes
        self.raw_bytes_sent += frame.raw_nbytes()

    # calling

    async def call(self, peer: str, name: str, request: Frame, *, timeout_s: float) -> Frame:
        """Send `request` to `peer`'s handler `name` and return its reply.

        Raises PeerUnreachableError when no reply arrives within `timeout_s` or the stream
        breaks, RemoteError when the peer answers with an error frame, BadFrameError when
        the reply is malformed.
        """
        if timeout_s <= 0:
            raise PeerUnreachableError(f"no time left to call {peer[-8:]}")
        try:
            return await asyncio.wait_for(self._call(peer, name, request), timeout_s)
        except asyncio.TimeoutError:
            raise PeerUnreachableError(
                f"peer {peer[-8:]} did not answer within {timeout_s:.1f} s", timed_out=True
            ) from None
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            raise PeerUnreachableError(f"connection to peer {peer[-8:]} broke: {e!r}") from None

    async def _call(self, peer: str, name: str, request: Frame) -> Frame:
        try:
            _info, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), name)
        except Exception as e:  # p2pd reports unreachable peers and unknown protocols as plain errors
            raise PeerUnreachableError(f"cannot open a stream to peer {peer[-8:]}: {e}") from None
        try:
            preamble = b""
            if self.swarm_key is not None:
                opened = await open_stream(
                    reader,
                    writer,
                    self.swarm_key,
                    opener=self.peer_id,
                    responder=peer,
                    timeout_s=self.config.read_timeout_s,
                )
                if isinstance(opened, Frame):  # refused before the request
                    return self._received(peer, opened)
                preamble = opened
            self._count_sent(request, await write_frame(writer, request, preamble=preamble))
            reply = await read_frame(reader, max_frame_bytes=self.config.max_frame_bytes)
        finally:
            writer.close()
        return self._received(peer, reply)

    def _received(self, peer: str, reply: Frame) -> Frame:
        """Count a reply's bytes; an error reply becomes RemoteError with its cause."""
        self.bytes_received += reply.wire_nbytes
        if reply.kind == "error":
            raise RemoteError(
                reply.error_text(),
                cause=reply.error_cause(),
                peer=peer,
                retryable=bool(reply.meta.get("retryable", True)),
            )
        return reply
