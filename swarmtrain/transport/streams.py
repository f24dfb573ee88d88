"""Tensor frames over hivemind P2P binary streams.

A call writes one request frame to a peer's handler and reads one reply frame; every call has
a timeout. A call takes a stream of its own, and once it has its reply the stream goes back to
a pool for the next call to the same peer and handler (`reuse_streams`): opening a libp2p
stream costs a round trip through both daemons and starts with a small flow-control window,
which on a slow, deep-queued link held a swarm to half of it (benchmarks/wan.py --peers swarm
measures both ways side by side). A stream with a call in flight is never shared, so a reply
belongs to the one request on its stream; a call that fails or times out closes its stream.

The serving side answers the requests of one stream in turn. It reads and validates each
(size limit, header, tensors) before its handler sees it, and answers a bad frame with an
error reply instead of failing: a misbehaving peer costs us one reply, and after
`max_strikes` bad frames it is banned for `ban_s` seconds. A request's bytes count against
its sender's budget (`max_peer_bytes_in_flight`) as they arrive, and a frame that stops
arriving half-sent (no byte for `read_timeout_s`) is a strike too.

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

import torch
from hivemind.p2p import P2P, PeerID

import swarmtrain.compress  # noqa: F401  (registers the codecs frames may carry)
from swarmtrain.errors import BadFrameError, Cause, PeerUnreachableError, RemoteError
from swarmtrain.transport.budget import PeerBudget
from swarmtrain.transport.handshake import accept_stream, open_stream
from swarmtrain.transport.pacing import Pacer
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
"""How long a served stream waits for the caller to close after refusing a request it did not
read whole (reading and dropping the rest of it)."""
SERVED_IDLE_S = 120.0
"""How long a served stream waits for the caller's next request before closing; longer than a
caller keeps an idle stream (`TransportConfig.idle_stream_s`), so that a caller rarely writes
into a stream the server is closing."""
MAX_IDLE_STREAMS = 16
"""Idle streams a caller keeps per peer and handler; more are closed after their reply."""

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
    """A request must begin within this time once its stream opens (as must every message of the
    private swarm's handshake), and each further byte of it within this time of the last: a
    frame that stops arriving half-sent is a strike. (A long frame over a slow link may take
    longer as a whole, as long as it keeps coming.)"""
    max_strikes: int = 3
    """Bad frames from one peer before it is banned."""
    ban_s: float = 60.0
    """How long a banned peer's requests are refused."""
    max_peer_bytes_in_flight: int | None = None
    """Most bytes one peer's requests may hold here at once, counted as they arrive and freed
    once answered; a peer over it is refused with a strike. None: room for four of the
    largest frames (4 x (max_frame_bytes + the largest header))."""
    reuse_streams: bool = True
    """Send a call over an idle stream to the same peer and handler when there is one (opened by
    an earlier call), and keep the stream after its reply. False: one stream per call, closed
    after its reply (how the transport worked before; kept to measure against)."""
    idle_stream_s: float = 30.0
    """An idle stream older than this is closed instead of reused."""
    uplink_bytes_per_s: float | None = None
    """Pace the frames this peer sends to this rate, one after another in the order they were
    sent (`swarmtrain.transport.pacing`); None: hand each to the daemon at once."""

    def __post_init__(self):
        if (
            self.max_frame_bytes < 1
            or self.read_timeout_s <= 0
            or self.max_strikes < 1
            or self.ban_s < 0
            or not 0 < self.idle_stream_s < SERVED_IDLE_S
            or (self.uplink_bytes_per_s is not None and not self.uplink_bytes_per_s > 0)
        ):
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


class _Stream:
    """A caller's stream to one peer's handler."""

    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def usable(self) -> bool:
        """Neither side has closed it (a server that closed an idle stream, a peer that left)."""
        return not (self.reader.at_eof() or self.writer.is_closing() or self.reader.exception())


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
        self.decode_device: torch.device | None = None
        """Where compressed tensors of frames this peer reads are decoded (a stage peer's GPU:
        only compressed bytes cross to it); None: the host."""
        self.streams_opened = 0
        """Streams this peer's calls opened (with `reuse_streams`, far fewer than calls)."""
        self._idle: dict[tuple[str, str], list[_Stream]] = {}
        rate = self.config.uplink_bytes_per_s
        self.pacer = Pacer(rate) if rate else None
        """Slots on this peer's uplink (None: frames are not paced)."""

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
                reply, first = await self._admit(peer, reader, writer)
                whole = reply is None
                while whole:  # the stream's requests in turn, until the caller closes it
                    reply, whole = await self._answer(peer, reader, handler, first=first)
                    if not whole:
                        break
                    self._count_sent(reply, await write_frame(writer, reply, pacer=self.pacer))
                    if not (first := await self._next_request(reader)):
                        return
                self._count_sent(reply, await write_frame(writer, reply, pacer=self.pacer))
                # a refused caller may still be sending its request: read and drop what comes
                # until it closes (closing first can make the daemon reset the stream and cut
                # off the tail of the refusal)
                await asyncio.wait_for(_drain(reader), LINGER_S)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                logger.debug("stream from %s broke: %r", peer[-8:], e)
            except asyncio.CancelledError:  # this peer is shutting down: the caller sees the stream close
                pass  # (re-raised, the stream reader's callback would print it as an error)
            finally:
                writer.close()

        await self.p2p.add_binary_stream_handler(name, on_stream)

    @staticmethod
    async def _next_request(reader: asyncio.StreamReader) -> bytes:
        """The first bytes of the stream's next request, or b"" once the caller closed it or left
        it idle for SERVED_IDLE_S."""
        try:
            return await asyncio.wait_for(reader.read(PREFIX.size), SERVED_IDLE_S)
        except asyncio.TimeoutError:
            return b""

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
    ) -> tuple[Frame, bool]:
        """The reply to the stream's next request, and whether the request was read whole (the
        stream can carry another)."""
        if banned := self._banned(peer):
            return banned, False
        timeout_s = self.config.read_timeout_s
        with self.budget.hold(peer) as hold:  # the request's bytes, until it is answered
            try:
                request = await self._read_request(reader, hold, first)
            except BadFrameError as e:
                self.strike(peer, str(e))
                return error_frame("", f"bad frame: {e}", cause=Cause.BAD_FRAME), False
            except asyncio.TimeoutError:
                if not hold.nbytes:
                    message = f"request did not arrive within {timeout_s} s"
                    return error_frame("", message, cause=Cause.UNREACHABLE), False
                # its prefix promised a frame that did not come: it held our memory and a stream
                message = f"frame stalled: {hold.nbytes} bytes of it arrived, then none for {timeout_s} s"
                self.strike(peer, message)
                return error_frame("", message, cause=Cause.UNREACHABLE), False
            self.bytes_received += request.wire_nbytes
            try:
                return await handler(request, peer), True
            except Exception as e:  # a bug here must cost one reply, not the caller's stream
                logger.exception("handler failed on a %s frame from %s", request.kind, peer[-8:])
                message = f"internal error on this peer: {e!r}"
                return error_frame(request.run_id, message, cause=Cause.OWN_FAILURE), True

    async def _read_request(self, reader: asyncio.StreamReader, hold, first: bytes) -> Frame:
        """Read one request frame, charging its bytes to `hold`; asyncio.TimeoutError once no
        byte of it has come for read_timeout_s."""
        timeout_s = self.config.read_timeout_s
        last_progress = time.monotonic()

        def charge(nbytes: int) -> None:
            nonlocal last_progress
            hold.charge(nbytes)
            last_progress = time.monotonic()

        max_bytes = self.config.max_frame_bytes
        reading = asyncio.ensure_future(
            read_frame(
                reader, max_frame_bytes=max_bytes, charge=charge, first=first, device=self.decode_device
            )
        )
        try:
            while not reading.done():
                wait_s = last_progress + timeout_s - time.monotonic()
                if wait_s <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait({reading}, timeout=wait_s)
            return reading.result()
        finally:
            reading.cancel()

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
        stream = self._take_idle(peer, name)
        preamble = b""
        if stream is None:
            stream, opened = await self._open(peer, name)
            if isinstance(opened, Frame):  # refused before the request
                return self._received(peer, opened)
            preamble = opened
        reusable = False
        try:
            self._count_sent(
                request, await write_frame(stream.writer, request, preamble=preamble, pacer=self.pacer)
            )
            reply = await read_frame(
                stream.reader, max_frame_bytes=self.config.max_frame_bytes, device=self.decode_device
            )
            # after an error reply the server may be dropping the rest of the stream
            reusable = self.config.reuse_streams and reply.kind != "error"
        finally:  # a call that failed or was cancelled leaves its stream in an unknown state
            if reusable:
                self._put_idle(peer, name, stream)
            else:
                stream.writer.close()
        return self._received(peer, reply)

    async def _open(self, peer: str, name: str) -> tuple[_Stream, bytes | Frame]:
        """A new stream to `peer`'s handler `name`, past the private swarm's handshake: the stream
        and the bytes to send before the first request (or the refusal the peer sent instead)."""
        try:
            _info, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), name)
        except Exception as e:  # p2pd reports unreachable peers and unknown protocols as plain errors
            raise PeerUnreachableError(f"cannot open a stream to peer {peer[-8:]}: {e}") from None
        self.streams_opened += 1
        stream = _Stream(reader, writer)
        if self.swarm_key is None:
            return stream, b""
        try:
            opened = await open_stream(
                reader,
                writer,
                self.swarm_key,
                opener=self.peer_id,
                responder=peer,
                timeout_s=self.config.read_timeout_s,
            )
        except BaseException:
            writer.close()
            raise
        if isinstance(opened, Frame):
            writer.close()
        return stream, opened

    def _take_idle(self, peer: str, name: str) -> _Stream | None:
        """The most recently used idle stream to `peer`'s handler `name` that is still open and
        young enough, closing the stale ones on the way; None if there is none."""
        idle = self._idle.get((peer, name))
        now = time.monotonic()
        while idle:
            stream = idle.pop()
            if now - stream.idle_since < self.config.idle_stream_s and stream.usable():
                return stream
            stream.writer.close()
        return None

    def _put_idle(self, peer: str, name: str, stream: _Stream) -> None:
        idle = self._idle.setdefault((peer, name), [])
        if len(idle) >= MAX_IDLE_STREAMS:
            stream.writer.close()
            return
        stream.idle_since = time.monotonic()
        idle.append(stream)

    def close_idle_streams(self) -> None:
        """Close every idle stream (a peer shutting down, or one that moved elsewhere)."""
        for idle in self._idle.values():
            for stream in idle:
                stream.writer.close()
        self._idle.clear()

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
