"""A stage replica's request handler: every frame kind it serves, and every refusal as a cause.

`StageService.handle(frame, caller)` is what the transport calls for each request:
- 'ping' -> 'pong' (state, counters, readiness);
- 'forward' -> 'result' (`serving.ForwardServer`), refused while the replica drains;
- 'step' -> 'step_done' (`commit.CommitParticipant`), 'grads' -> 'result' (the exchange);
- 'state' -> 'state_data': parameters and optimizer state, for a joining or lagging replica
  (`take_state` is the other side);
- 'weights' -> 'weights_data': parameters at a policy version, for rollout peers
  (`policy_serving`; `swarmtrain.rl.weights` is the other side).
Before any of that (but 'ping'), the caller must be one the run authorizes for the request
(`authority`: its trainers, the replicas of this stage or of the one before): anyone else is
refused as UNAUTHORIZED, struck, and leaves no trace. A frame for another run or a stage that
does not exist strikes the caller; a malformed request is refused as BAD_FRAME and strikes
it; a failure of this replica or of the pipeline after it is answered with its cause, so the
caller can replay elsewhere.
"""

from __future__ import annotations

import asyncio
import logging

from swarmtrain.errors import BadFrameError, Cause, PeerUnreachableError, RemoteError
from swarmtrain.train.authority import Refusal
from swarmtrain.train.commit import CommitParticipant
from swarmtrain.train.context import StageContext
from swarmtrain.train.policy_serving import serve_weights
from swarmtrain.train.serving import ForwardServer, ServeCounters
from swarmtrain.transport.in_turn import ask_in_turn
from swarmtrain.wire.frames import Frame, error_frame
from swarmtrain.wire.messages import (
    MEMBER_PROOF,
    CommitRequest,
    GradsMeta,
    PongMeta,
    Readiness,
    Relayout,
    Rollback,
    StateRequest,
    WeightsRequest,
)

logger = logging.getLogger(__name__)

STATE_TIMEOUT_S = 60.0
"""Longest wait for a replica's state (all of a stage's parameters and optimizer state)."""


class StageService:
    """Dispatch one stage replica's requests (see the module docstring)."""

    def __init__(self, ctx: StageContext, counters: ServeCounters | None = None):
        self.ctx = ctx
        self.counters = counters or ServeCounters()
        self.forward = ForwardServer(ctx, self.counters)
        self.commit = CommitParticipant(ctx, self.forward.cache)
        self.in_flight = 0

    def _error(self, message: str, cause: Cause, **kw) -> Frame:
        return error_frame(self.ctx.run_id, message, cause=cause, stage=self.ctx.stage, **kw)

    async def handle(self, frame: Frame, caller: str) -> Frame:
        ctx = self.ctx
        if frame.run_id != ctx.run_id:
            ctx.transport.strike(caller, f"frame for run {frame.run_id!r}")
            return self._error(f"this peer serves run {ctx.run_id!r}, not {frame.run_id!r}", Cause.WRONG_RUN)
        if frame.kind == "ping":
            ready = Readiness.of(ctx.scheduler.readiness())
            pong = PongMeta(
                state="draining" if ctx.is_draining() else "serving",
                served=self.counters.served,
                failed=self.counters.failed,
                in_flight=self.in_flight,
                **ready.to_meta(),
            )
            return Frame(
                kind="pong", run_id=ctx.run_id, stage=ctx.stage, step=ctx.runner.step, meta=pong.to_meta()
            )
        if frame.stage != ctx.stage:
            exists = 0 <= frame.stage < ctx.num_stages  # routing may lag a move by a heartbeat
            if not exists:
                ctx.transport.strike(caller, f"frame for stage {frame.stage}")
            return self._error(
                f"this peer serves stage {ctx.stage}, not {frame.stage}",
                Cause.WRONG_STAGE if exists else Cause.BAD_FRAME,
            )
        try:
            refused = await self._authorize(frame, caller)
            if refused is not None:
                message = f"stage {ctx.stage} refused {_what(frame)}: {refused.reason}"
                if refused.pending:  # perhaps a peer that joined moments ago: ask again, no strike
                    message += " (as far as this peer's view of the run goes; it may not have the caller yet)"
                else:
                    ctx.transport.strike(caller, refused.reason)
                return self._error(message, Cause.UNAUTHORIZED, mb_id=frame.mb_id, retryable=refused.pending)
            if frame.kind == "forward":
                return await self._forward(frame, caller)
            if frame.kind == "step":
                request = CommitRequest.parse(frame.meta)
                if isinstance(request, Rollback):
                    return await self._rollback(frame.step, request)
                if isinstance(request, Relayout):
                    return await self._relayout(frame.step, request.layout)
                return await self.commit.on_step(frame, caller)
            if frame.kind == "grads":
                return await self.commit.on_grads(frame, caller)
            if frame.kind == "state":
                return await self._state(StateRequest.from_meta(frame.meta).checkpoint)
            if frame.kind == "weights":
                return await serve_weights(ctx, WeightsRequest.from_meta(frame.meta))
        except BadFrameError as e:
            ctx.transport.strike(caller, str(e))
            message = f"stage {ctx.stage} rejected {_what(frame)}: {e}"
            return self._error(message, Cause.BAD_FRAME, mb_id=frame.mb_id)
        except RemoteError as e:
            message = str(e) if frame.kind == "forward" else f"stage {ctx.stage}: {e}"
            return self._error(message, e.cause, retryable=e.retryable, mb_id=frame.mb_id)
        except PeerUnreachableError as e:
            return self._error(
                f"stage {ctx.stage + 1} unreachable: {e}", Cause.UNREACHABLE, mb_id=frame.mb_id
            )
        return self._error(f"stage peers do not take {frame.kind!r} frames", Cause.BAD_FRAME)

    async def _authorize(self, frame: Frame, caller: str) -> Refusal | None:
        """Why the run does not let `caller` make this request, None if it does."""
        group = None
        if frame.kind == "grads":
            group = self.commit.exchange_group(frame.step, GradsMeta.from_meta(frame.meta).attempt)
        proof = frame.meta.get(MEMBER_PROOF) if frame.kind == "forward" else None
        return await self.ctx.authority.check(
            frame.kind, caller, stage=self.ctx.stage, mb_id=frame.mb_id, group=group, proof=proof
        )

    async def _state(self, checkpoint: int | None) -> Frame:
        ctx, runner = self.ctx, self.ctx.runner
        if checkpoint is None:  # the step and the state it labels are read together
            step, state = await ctx.scheduler.call(lambda: (runner.step, runner.export_state()))
        else:
            step, state = (
                checkpoint,
                await asyncio.get_running_loop().run_in_executor(None, ctx.checkpoint_state, checkpoint),
            )
            if state is None:
                raise RemoteError(
                    f"this peer holds no checkpoint of step {checkpoint}", cause=Cause.OWN_FAILURE
                )
        return Frame(kind="state_data", run_id=ctx.run_id, stage=ctx.stage, step=step, tensors=state)

    async def take_state(self, replicas: list[str], *, checkpoint: int | None = None) -> int | None:
        """Download parameters and optimizer state from the first of `replicas` that answers
        (a joining replica, or one that fell behind), or their checkpoint of step `checkpoint`;
        returns the step taken, None if none did."""
        ctx = self.ctx
        meta = StateRequest(checkpoint=checkpoint).to_meta()
        request = Frame(kind="state", run_id=ctx.run_id, stage=ctx.stage, meta=meta)

        async def install(_peer: str, reply: Frame) -> int:  # BadFrameError: it does not fit
            await self.install_state(reply.tensors, reply.step)
            return reply.step

        answer = await ask_in_turn(
            ctx.transport, replicas, ctx.handler, request, timeout_s=STATE_TIMEOUT_S, take=install
        )
        for peer, e in answer.failures:
            logger.warning("could not take state from peer %s: %s", peer[-8:], e)
        if answer.answered:
            logger.info("took the state of step %d from peer %s", answer.value, answer.peer[-8:])
        return answer.value

    async def _rollback(self, step: int, request: Rollback) -> Frame:
        """Take checkpoint `request.checkpoint` (unless this replica is at that step) and go on
        from it as `step` (`swarmtrain.train.rollback`); a repeated request is answered again."""
        ctx, runner, want = self.ctx, self.ctx.runner, request.checkpoint
        if runner.step != step:
            if want > step:
                raise BadFrameError(
                    f"a rollback to checkpoint {want} cannot go on as the earlier step {step}"
                )
            if runner.step != want:
                state = await asyncio.get_running_loop().run_in_executor(None, ctx.checkpoint_state, want)
                if state is not None:
                    await self.install_state(state, want)
                elif await self.take_state(list(request.sources), checkpoint=want) is None:
                    raise RemoteError(
                        f"stage {ctx.stage} holds no checkpoint of step {want} and none of its sources "
                        "gave one",
                        cause=Cause.OWN_FAILURE,
                    )
            await ctx.scheduler.call(runner.relabel, step)
            self.commit.reset()
            self.forward.cache.clear()
            logger.warning("stage %d went back to checkpoint %d; going on as step %d", ctx.stage, want, step)
        return Frame(kind="step_done", run_id=ctx.run_id, stage=ctx.stage, step=runner.step)

    async def _relayout(self, step: int, layout: int) -> Frame:
        """Move this peer to layout `layout` at `step` (the peer does it: `ctx.on_relayout`); the
        reply names the stage it serves in the new layout."""
        ctx = self.ctx
        if ctx.on_relayout is None:
            raise RemoteError("this replica cannot move to another layout", cause=Cause.OWN_FAILURE)
        if self.in_flight or ctx.runner.num_pending or ctx.runner.step != step:
            raise RemoteError(
                f"a layout move at step {step} needs an idle replica at that step (this one is at "
                f"step {ctx.runner.step}, {self.in_flight} microbatches in flight)",
                cause=Cause.OWN_FAILURE,
            )
        stage = await ctx.on_relayout(step, layout)
        return Frame(kind="step_done", run_id=ctx.run_id, stage=stage, step=step)

    async def install_named_state(self, state: dict, step: int) -> None:
        """This replica's blocks out of `state` (by swarm name) at `step` (BadFrameError if they
        are not all there)."""
        await self.ctx.scheduler.call(self.ctx.runner.import_named_state, state, step)
        self.commit.reset()
        self.forward.cache.clear()

    async def install_state(self, state: dict, step: int) -> None:
        """Replace this replica's state with `state` at `step` (BadFrameError if it does not fit)."""
        await self.ctx.scheduler.call(self.ctx.runner.import_state, state, step)
        self.commit.reset()
        self.forward.cache.clear()

    async def _forward(self, frame: Frame, caller: str) -> Frame:
        if self.ctx.is_draining():
            raise RemoteError("this peer is leaving its stage", cause=Cause.DRAINING)
        self.in_flight += 1
        try:
            reply = await self.forward.on_forward(frame, caller)
            if frame.meta.get("score"):  # a score pass is no microbatch served
                self.counters.scored += 1
            else:
                self.counters.served += 1
            return reply
        except BaseException:
            self.counters.failed += 1
            raise
        finally:
            self.in_flight -= 1


def _what(frame: Frame) -> str:
    return f"microbatch {frame.mb_id}" if frame.kind == "forward" else f"a {frame.kind!r} frame"
