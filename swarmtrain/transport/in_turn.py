"""Ask peers in turn until one answers: the one loop behind every 'any holder will do' request
(a replica's state, a checkpoint, a policy version's weights)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError, SwarmError
from swarmtrain.transport.streams import TensorTransport
from swarmtrain.wire.frames import Frame

T = TypeVar("T")

FAILURES = (RemoteError, PeerUnreachableError, BadFrameError)
"""What makes `ask_in_turn` go on to the next peer."""


@dataclass
class Answer(Generic[T]):
    """What `ask_in_turn` found: the peer that answered and its answer (None, None if none
    did), and every failure on the way, in order."""

    peer: str | None = None
    value: T | None = None
    failures: list[tuple[str, SwarmError]] = field(default_factory=list)

    @property
    def answered(self) -> bool:
        return self.peer is not None

    def reasons(self) -> str:
        """The failures, one clause each: '…peer: why; …peer: why' ('nobody was asked' if none)."""
        return "; ".join(f"{peer[-8:]}: {e}" for peer, e in self.failures) or "nobody was asked"


async def ask_in_turn(
    transport: TensorTransport,
    peers: Iterable[str],
    name: str,
    request: Frame,
    *,
    timeout_s: float,
    take: Callable[[str, Frame], Awaitable[T]] | None = None,
) -> Answer[T]:
    """Send `request` to each of `peers` in order until one answers and `take(peer, reply)`
    (default: the reply itself) accepts it; a RemoteError, PeerUnreachableError or
    BadFrameError from the call or from `take` moves on to the next peer. Never raises those:
    the caller decides what no answer means."""
    answer: Answer[T] = Answer()
    for peer in peers:
        try:
            reply = await transport.call(peer, name, request, timeout_s=timeout_s)
            value = reply if take is None else await take(peer, reply)
        except FAILURES as e:
            answer.failures.append((peer, e))
            continue
        answer.peer, answer.value = peer, value
        return answer
    return answer
