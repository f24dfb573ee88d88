"""Tensor frames over hivemind P2P binary streams.

One stream per request: the caller opens a stream to a peer's handler, writes one frame and
reads one reply frame; every call has a timeout. The serving side reads and validates the
request (size limit, header, tensors) before its handler sees it, and answers a bad frame
with an error reply instead of failing: a misbehaving peer costs us one reply, and after
`max_strikes` bad frames it is banned for `ban_s` seconds.

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
from swarmtrain.wire.frames import DEFAULT_MAX_FRAME_BYTES, Frame, error_frame, read_frame, write_frame

logger = logging.getLogger(__name__)

LINGER_S = 10.0
"""How long a served stream waits for the caller to close after the reply."""

Handler = Callable[[Frame, str], Awaitable[Frame]]
"""A served handler: (request frame, caller's base58 peer id) -> reply frame."""


def handler_name(run_id: str) -> str:
    """The libp2p protocol name a run's stage peers serve; another run's id finds no handler."""
    return f"/swarmtrain/{run_id}/1"


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Limits of one peer's frame transport."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest payload accepted in one frame (requests and replies)."""
    read_timeout_s: float = 30.0
    """A request must arrive whole within this time after its stream opens."""
    max_strikes: int = 3
    """Bad frames from one peer before it is banned."""
    ban_s: float = 60.0
    """How long a banned peer's requests are refused."""

    def __post_init__(self):
        if self.max_frame_bytes < 1 or self.read_timeout_s <= 0 or self.max_strikes < 1 or self.ban_s < 0:
            raise ValueError(f"invalid transport limits: {self}")


class TensorTransport:
    """Serve and call frame handlers over one hivemind P2P instance (shared with the DHT)."""

    def __init__(self, p2p: P2P | None, config: TransportConfig | None = None, *, peer_id: str | None = None):
        self.p2p = p2p
        self.config = config or TransportConfig()
        self.peer_id: str = peer_id if p2p is None else p2p.peer_id.to_base58()
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
                reply = await self._answer(peer, reader, handler)
                if reply is not None:
                    self._count_sent(reply, await write_frame(writer, reply))
                    # Close only once the caller has closed its side: closing first can make
                    # the daemon reset the stream and cut off the tail of the reply.
                    await asyncio.wait_for(reader.read(1), LINGER_S)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                logger.debug("stream from %s broke: %r", peer[-8:], e)
            finally:
                writer.close()

        await self.p2p.add_binary_stream_handler(name, on_stream)

    async def _answer(self, peer: str, reader: asyncio.StreamReader, handler: Handler) -> Frame | None:
        if self.is_banned(peer):
            left = self._banned_until[peer] - time.monotonic()
            return error_frame(
                "",
                f"this peer bans you for another {left:.0f} s after repeated bad frames",
                cause=Cause.BANNED,
            )
        try:
            request = await asyncio.wait_for(
                read_frame(reader, max_frame_bytes=self.config.max_frame_bytes), self.config.read_timeout_s
            )
        except BadFrameError as e:
            self.strike(peer, str(e))
            return error_frame("", f"bad frame: {e}", cause=Cause.BAD_FRAME)
        except asyncio.TimeoutError:
            return error_frame(
                "", f"request did not arrive within {self.config.read_timeout_s} s", cause=Cause.UNREACHABLE
            )
        self.bytes_received += request.wire_nbytes
        try:
            return await handler(request, peer)
        except Exception as e:  # a bug here must cost one reply, not the caller's stream
            logger.exception("handler failed on a %s frame from %s", request.kind, peer[-8:])
            return error_frame(request.run_id, f"internal error on this peer: {e!r}", cause=Cause.OWN_FAILURE)

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
            self._count_sent(request, await write_frame(writer, request))
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
