"""One hop of a microbatch, with replay: the trainer into stage 0 and stage k into stage k+1.

Both hops are the same loop: choose the replica of the next stage the router expects to
finish first, send, and on failure ban it (capped backoff), report, and replay the
microbatch to another replica from the input this side still holds. A reply's readiness
feeds the router. The loop ends with the reply, with the microbatch refused as bad (a
RemoteError that is not retryable: the caller drops it or fails), or with `HopFailedError`
once the attempts or the time budget run out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from swarmtrain.errors import BadFrameError, Cause, PeerUnreachableError, RemoteError, SwarmError
from swarmtrain.schedule import ReadinessRouter
from swarmtrain.transport import TensorTransport
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import ResultMeta

logger = logging.getLogger(__name__)

NO_REPLICA_WAIT_S = 0.25
"""How long a hop waits before looking again when every replica of the next stage is banned or gone."""


@dataclass(kw_only=True)
class HopContext:
    """What a hop needs from the side that sends it."""

    router: ReadinessRouter
    transport: TensorTransport
    handler: str
    """The run's protocol name (`transport.handler_name`)."""
    candidates: Callable[[], Awaitable[list[str]]]
    """The next stage's replicas as this side sees them now."""
    wait_for_replica: Callable[[float], Awaitable[None]]
    """Every candidate is banned or gone: wait at most this long, then read the swarm again."""


@dataclass(frozen=True, kw_only=True)
class HopFailure:
    """One failed attempt: the replica and what went wrong."""

    target: str
    error: SwarmError

    @property
    def timed_out(self) -> bool:
        return isinstance(self.error, PeerUnreachableError) and self.error.timed_out

    @property
    def label(self) -> str:
        """The replay cause this failure is counted under (`StepLedger.replays`)."""
        e = self.error
        if isinstance(e, RemoteError):
            return "refused" if e.cause == Cause.DRAINING else "downstream failure"
        if isinstance(e, BadFrameError):
            return "bad reply"
        return "timeout" if self.timed_out else "peer unreachable"

    def __str__(self) -> str:
        return f"{self.target[-8:]}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class HopResult:
    reply: Frame
    result: ResultMeta
    target: str
    """The replica that answered."""
    failures: tuple[HopFailure, ...] = ()
    """The attempts that failed before it (each one a replay)."""


class HopFailedError(SwarmError):
    """No replica completed the hop within the attempts or the time allowed."""

    def __init__(self, message: str, failures: list[HopFailure]):
        super().__init__(message)
        self.failures = failures


@dataclass(kw_only=True)
class Hop:
    """One microbatch's hop into a stage; `await send(ctx)` runs it (see the module docstring)."""

    build: Callable[[str, bool, float], Frame]
    """(target replica, is a replay, seconds of budget to give it) -> the request frame."""
    deadline: float
    """time.monotonic() by which the hop must have its reply."""
    timeout_s: float
    """Longest wait for one attempt's reply."""
    order: int = 0
    nbytes: int = 0
    """Bytes the request carries (the router weighs the transfer)."""
    prefer: str | None = None
    """A replica that already holds this microbatch's work: it goes there while it is allowed."""
    replay: bool = False
    """The first attempt is already a replay."""
    max_attempts: int | None = None
    """Attempts at most (None: as many as the deadline allows)."""
    route_len: int = 0
    """Replicas the reply's route must name (the replying stage and every one after it)."""
    expect_grad: bool = False
    """The reply must carry the gradient of the request's input ('grad')."""
    check: Callable[[Frame], None] = field(default=lambda reply: None)
    """Raises BadFrameError when the reply's tensors are unusable (the replying replica is
    struck and the microbatch replayed); runs after the checks above."""
    on_failure: Callable[[HopFailure], None] = field(default=lambda failure: None)
    """Called on each failed attempt, before the replay."""

    async def send(self, ctx: HopContext) -> HopResult:
        failures: list[HopFailure] = []
        prefer = self.prefer
        while self.max_attempts is None or len(failures) < self.max_attempts:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                break
            candidates = await ctx.candidates()
            if prefer is not None and prefer not in candidates:
                candidates = [*candidates, prefer]  # a route names it before our view has it
            now = time.monotonic()
            target = ctx.router.choose(candidates, now, nbytes=self.nbytes, order=self.order, prefer=prefer)
            if target is None:
                await ctx.wait_for_replica(min(NO_REPLICA_WAIT_S, remaining))
                continue
            budget = min(self.timeout_s, remaining)
            request = self.build(target, self.replay or bool(failures), budget)
            ctx.router.sent(target, now)
            try:
                reply = await ctx.transport.call(target, ctx.handler, request, timeout_s=budget)
                result = self._check(reply)
            except RemoteError as e:
                ctx.router.done(target, time.monotonic(), ok=not e.retryable)
                if not e.retryable:
                    raise
                failure = HopFailure(target=target, error=e)
            except (PeerUnreachableError, BadFrameError) as e:
                if isinstance(e, BadFrameError):  # the replica's fault: it answered garbage
                    ctx.transport.strike(target, str(e))
                ctx.router.done(target, time.monotonic(), ok=False)
                failure = HopFailure(target=target, error=e)
            else:
                now = time.monotonic()
                ctx.router.done(target, now, ok=True)
                ctx.router.report(target, backlog_s=result.r_backlog, service_s=result.r_service, now=now)
                return HopResult(reply=reply, result=result, target=target, failures=tuple(failures))
            failures.append(failure)
            prefer = None
            self.on_failure(failure)
        last = str(failures[-1]) if failures else "no replica of the stage was found"
        raise HopFailedError(f"{len(failures)} attempt(s) failed, last: {last}", failures)

    def _check(self, reply: Frame) -> ResultMeta:
        result = ResultMeta.from_meta(reply.meta)
        if len(result.route) != self.route_len:
            raise BadFrameError(
                f"the reply's route names {len(result.route)} replicas, expected {self.route_len}"
            )
        if self.expect_grad and "grad" not in reply.tensors:
            raise BadFrameError("the reply lacks the gradient of its input ('grad')")
        self.check(reply)
        return result
