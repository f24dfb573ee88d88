"""Frames between peers of one process, with deterministic fault injection.

`MemoryNetwork` connects `MemoryTransport`s by peer id on one event loop. A call encodes the
request exactly as a stream would, and the callee reads it through the same validation as
`TensorTransport` (limits, header, codecs, NaN checks, strikes and bans); the reply comes back
the same way. So the protocol code (`swarmtrain.train`) runs over it unchanged, and tests can
run a whole swarm in one process, in seconds.

Faults are rules on the network, each matching calls by sender, receiver and frame, each
applied to the first `times` matching calls:
- `kill(peer)`: the peer is gone. Calls to it fail at once (the connection breaks), calls it
  was serving break for their callers, and its own calls in flight break too.
- `lose_reply(match)`: the callee does the work, the reply never arrives; the caller times out.
- `delay(match, seconds)`: the request reaches the callee `seconds` late (a slow link or peer).
- `duplicate(match)`: the callee receives the request twice; the caller gets the first reply.
- `hold(match)`: the request waits until `released.set()`: a test can reorder frames at will.
- `on_delivery(match, fn)`: `fn()` runs just before the request is delivered (kill a peer
  at an exact point of the protocol, say).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmtrain.errors import PeerUnreachableError
from swarmtrain.transport.streams import Handler, TensorTransport, TransportConfig
from swarmtrain.wire.frames import Frame, encode_frame, read_frame

Match = Callable[[str, str, Frame], bool]
"""(sender, receiver, request) -> whether a fault applies to this call."""


@dataclass(kw_only=True)
class Fault:
    kind: str
    match: Match
    times: int = 1
    delay_s: float = 0.0
    released: asyncio.Event = field(default_factory=asyncio.Event)
    action: Callable[[], None] | None = None
    hits: int = 0
    """Calls it applied to so far."""


def frame_is(
    kind: str, *, stage: int | None = None, phase: str | None = None, mb_id: str | None = None
) -> Match:
    """A match on the request: its kind, and optionally its stage, commit phase or microbatch."""

    def match(_sender: str, _receiver: str, frame: Frame) -> bool:
        return (
            frame.kind == kind
            and (stage is None or frame.stage == stage)
            and (phase is None or frame.meta.get("phase") == phase)
            and (mb_id is None or frame.mb_id == mb_id)
        )

    return match


def _on_the_wire(frame: Frame) -> tuple[bytes, int]:
    """`frame`'s bytes as a stream would carry them, and its payload bytes."""
    prefix, header, *payload = encode_frame(frame)
    return b"".join([prefix, header, *(bytes(b) for b in payload)]), sum(b.nbytes for b in payload)


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


class MemoryNetwork:
    """Peers of one process by id, and the faults between them (see the module docstring)."""

    def __init__(self):
        self.transports: dict[str, MemoryTransport] = {}
        self.dead: set[str] = set()
        self.faults: list[Fault] = []
        self._serving: dict[str, set[asyncio.Task]] = {}
        """Per peer: the calls it serves now (cancelled when it is killed, and with them the
        calls it makes from them)."""

    def transport(self, peer_id: str, config: TransportConfig | None = None) -> MemoryTransport:
        t = MemoryTransport(self, peer_id, config)
        self.transports[peer_id] = t
        return t

    # faults

    def add(self, kind: str, match: Match, *, times: int = 1, delay_s: float = 0.0, action=None) -> Fault:
        fault = Fault(kind=kind, match=match, times=times, delay_s=delay_s, action=action)
        self.faults.append(fault)
        return fault

    def lose_reply(self, match: Match, *, times: int = 1) -> Fault:
        return self.add("lose_reply", match, times=times)

    def delay(self, match: Match, seconds: float, *, times: int = 1) -> Fault:
        return self.add("delay", match, times=times, delay_s=seconds)

    def duplicate(self, match: Match, *, times: int = 1) -> Fault:
        return self.add("duplicate", match, times=times)

    def hold(self, match: Match, *, times: int = 1) -> Fault:
        return self.add("hold", match, times=times)

    def on_delivery(self, match: Match, fn: Callable[[], None], *, times: int = 1) -> Fault:
        return self.add("call", match, times=times, action=fn)

    def kill(self, peer: str) -> None:
        """The peer dies: it answers nothing more, and every call it serves or makes breaks."""
        self.dead.add(peer)
        for task in self._serving.pop(peer, set()):
            task.cancel()

    def _faults_for(self, sender: str, receiver: str, frame: Frame) -> list[Fault]:
        hit = []
        for fault in self.faults:
            if fault.hits < fault.times and fault.match(sender, receiver, frame):
                fault.hits += 1
                hit.append(fault)
        return hit

    # delivery

    def _serve(self, receiver: str, sender: str, name: str, request: bytes) -> asyncio.Task:
        task = asyncio.create_task(self.transports[receiver].answer(sender, name, request))
        self._serving.setdefault(receiver, set()).add(task)
        task.add_done_callback(lambda t: self._serving.get(receiver, set()).discard(t))
        return task

    async def deliver(self, sender: str, receiver: str, name: str, request: Frame, data: bytes) -> Frame:
        """Hand `request` (encoded as `data`) to `receiver`'s handler `name`; its reply."""
        faults = self._faults_for(sender, receiver, request)
        for f in faults:
            if f.kind == "call":
                f.action()
        if sender in self.dead:
            raise PeerUnreachableError(f"peer {sender[-8:]} is dead")
        callee = self.transports.get(receiver)
        if receiver in self.dead or callee is None or name not in callee.handlers:
            raise PeerUnreachableError(f"cannot open a stream to peer {receiver[-8:]}: no such peer")
        kinds = {f.kind for f in faults}
        for f in faults:
            if f.kind == "delay":
                await asyncio.sleep(f.delay_s)
            elif f.kind == "hold":
                await f.released.wait()
        task = self._serve(receiver, sender, name, data)
        if "duplicate" in kinds:
            self._serve(receiver, sender, name, data)
        try:
            reply = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the callee or the caller was killed mid-call
                raise PeerUnreachableError(f"connection to peer {receiver[-8:]} broke") from None
            raise
        if "lose_reply" in kinds:
            await asyncio.Event().wait()  # the caller's timeout ends this call
        return reply


class MemoryTransport(TensorTransport):
    """A `TensorTransport` whose calls go through a `MemoryNetwork` instead of libp2p."""

    def __init__(self, network: MemoryNetwork, peer_id: str, config: TransportConfig | None = None):
        super().__init__(None, config, peer_id=peer_id)
        self.network = network
        self.handlers: dict[str, Handler] = {}

    async def serve(self, name: str, handler: Handler) -> None:
        self.handlers[name] = handler

    async def answer(self, sender: str, name: str, request: bytes) -> Frame:
        """Read an encoded request as it would come off a stream and answer it (the serving side)."""
        reply, _whole = await self._answer(sender, _reader(request), self.handlers[name])
        assert reply is not None
        data, nbytes = _on_the_wire(reply)
        self._count_sent(reply, nbytes)
        return await read_frame(_reader(data), max_frame_bytes=self.config.max_frame_bytes)

    async def _call(self, peer: str, name: str, request: Frame) -> Frame:
        data, nbytes = _on_the_wire(request)
        self._count_sent(request, nbytes)
        reply = await self.network.deliver(self.peer_id, peer, name, request, data)
        return self._received(peer, reply)
