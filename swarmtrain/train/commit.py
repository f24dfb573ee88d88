"""A stage replica's side of the step commit: claim, prepare, exchange, apply (and abort).

A trainer drives every stage's replicas through the commit together (`committer.StepCommit`).
Several trainers may feed a run, so the step's commit is first claimed: one trainer holds it
and the phases below are served to it alone (`claims.StepClaim`); a Claim or a Status
answers with where the replica is (`StepStatus`): the claim's holder, whether it holds its
group's total, the exchange attempts used, and the step it last applied, with its gradient
scale and the microbatches it counted, so a trainer that takes over from one that died can
finish an apply it left half done.

1. prepare: a replica reports which microbatches' gradients are in its buffer ("fresh")
   and which replays it holds apart ("held"), and accepts gradients again.
2. exchange (once every stage's microbatches are each accounted for exactly once): the
   replica checks its buffer still holds exactly what it reported, closes the step, folds
   in the held copies the plan gives it, and swaps its gradient sum with the other replicas
   of its stage (`averaging`). The group's total is kept aside, not yet applied: if a replica
   dies now, the trainer plans again and nothing is double counted.
   Values: a received sum must fit this stage's parameters and its norm bound
   (`bounds.exchange`), or it is refused, the sender struck, and this replica's exchange
   fails at once (retryable: the trainer plans again). A group total that the optimizer
   could not square in fp32 refuses the commit (REFUSED), before any stage applies. The
   reply gives the total's squared norm: the trainer sums them over the stages into the whole
   model's gradient norm, and clips it through the apply's `grad_scale`.
3. apply (only once every stage has exchanged): write the total, step the optimizer. Every
   replica adds the same tensors in the same order, so replicas stay bit-identical; with
   `digest` the reply carries a hash of the parameters to prove it.
An apply that arrives twice (its reply was lost) is answered again without stepping twice.
"""

from __future__ import annotations

import asyncio
import time

import torch

from swarmtrain.compress.exchange import compress_for_exchange
from swarmtrain.compress.feedback import ErrorFeedback
from swarmtrain.errors import BadFrameError, Cause, PeerUnreachableError, RemoteError
from swarmtrain.train.averaging import GradientInbox, check_like, group_sum
from swarmtrain.train.bounds import SQUARE_SAFE, admit_frame, tensor_norm
from swarmtrain.train.claims import StepClaim
from swarmtrain.train.context import StageContext
from swarmtrain.train.serving import ReplayCache
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import (
    Abort,
    Applied,
    Apply,
    Claim,
    CommitRequest,
    Exchange,
    Exchanged,
    GradsMeta,
    Prepare,
    Prepared,
    Status,
    StepStatus,
)

EXCHANGE_TIMEOUT_S = 30.0
EXCHANGE_EMA = 0.2
"""Weight of the newest exchange in `CommitParticipant.exchange_s`."""


class CommitParticipant:
    """The commit protocol of one stage replica (see the module docstring)."""

    def __init__(self, ctx: StageContext, cache: ReplayCache):
        self.ctx = ctx
        self.cache = cache
        """The forward server's replay cache: cleared once the step is applied or aborted."""
        self.inbox = GradientInbox()
        self.feedback = ErrorFeedback()
        """Error-feedback residuals of the averaging codec, per parameter."""
        self._total: tuple[int, list[torch.Tensor] | None] | None = None
        """(step, the group's gradient total or None for a replica alone) once exchanged."""
        self._group: tuple[int, int, frozenset[str]] | None = None
        """(step, attempt, the group) of the last exchange asked of this replica."""
        self.claim = StepClaim()
        self._applied: tuple[int, float, tuple[str, ...]] | None = None
        """(step, grad_scale, the microbatches counted) of the last step applied."""
        self.exchange_s = 0.0
        """Moving average of the seconds an exchange with the other replicas takes (0: none yet)."""
        self._exchanges = 0

    def reset(self) -> None:
        """The replica's state was replaced (taken from another replica): forget the step."""
        self.inbox = GradientInbox()
        self.feedback = ErrorFeedback()
        self._total = None
        self._group = None
        self._applied = None

    @property
    def exchanged(self) -> bool:
        """This step's gradients are in the group's total: leaving now loses nothing."""
        return self._total is not None and self._total[0] == self.ctx.runner.step

    def exchange_group(self, step: int, attempt: int) -> frozenset[str] | None:
        """The group the exchange of `step`'s round `attempt` named, None until it was asked."""
        group = self._group
        return group[2] if group is not None and group[:2] == (step, attempt) else None

    def _done(self, step: int, meta: dict | None = None) -> Frame:
        ctx = self.ctx
        return Frame(kind="step_done", run_id=ctx.run_id, stage=ctx.stage, step=step, meta=meta or {})

    def status(self) -> Frame:
        """This replica's StepStatus (see the module docstring)."""
        step, group, applied = self.ctx.runner.step, self._group, self._applied
        status = StepStatus(
            committer=self.claim.holder_of(step),
            exchanged=self.exchanged,
            next_attempt=group[1] + 1 if group is not None and group[0] == step else 0,
            applied_step=None if applied is None else applied[0],
            applied_scale=None if applied is None else applied[1],
            counted=() if applied is None else applied[2],
        )
        return self._done(step, status.to_meta())

    def _refuse_claimed(self, step: int) -> RemoteError:
        return RemoteError(
            f"trainer {self.claim.holder_of(step)[-8:]} commits step {step} on this replica",
            cause=Cause.CLAIMED,
        )

    async def on_step(self, frame: Frame, caller: str) -> Frame:
        """Answer one commit request of trainer `caller`; RemoteError (with its cause) when this
        replica cannot (CLAIMED: another trainer commits the step)."""
        request = CommitRequest.parse(frame.meta)
        runner, scheduler = self.ctx.runner, self.ctx.scheduler
        if isinstance(request, (Status, Claim)):  # after the phases queued before it (an apply, say)
            await scheduler.call(lambda: None)
        current = frame.step == runner.step
        if isinstance(request, Status):
            return self.status()
        if isinstance(request, Claim):
            if current:
                self.claim.take(frame.step, caller, request.replaces)
            return self.status()
        applied_already = (
            isinstance(request, Apply) and runner.step == frame.step + 1 and not runner.has_gradients
        )
        if current and not applied_already:
            holds = (
                self.claim.take(frame.step, caller)
                if isinstance(request, Prepare)
                else self.claim.allows(frame.step, caller)
            )
            if not holds:
                raise self._refuse_claimed(frame.step)
        if isinstance(request, Prepare):
            await scheduler.call(runner.reopen)
            self._total = None
            fresh, held = runner.report()
            return self._done(
                runner.step, Prepared(fresh=tuple(sorted(fresh)), held=tuple(sorted(held))).to_meta()
            )
        if isinstance(request, Abort):
            await scheduler.call(runner.discard_step)
            self._total = None
            self.cache.clear()
            return self._done(runner.step)
        if isinstance(request, Exchange):
            return await self._on_exchange(frame.step, request)
        assert isinstance(request, Apply)
        return await self._on_apply(frame.step, request)

    async def _on_exchange(self, step: int, request: Exchange) -> Frame:
        ctx = self.ctx
        if ctx.peer_id not in request.group:
            raise BadFrameError("an exchange must name a group with this replica in it")
        self._group = (step, request.attempt, frozenset(request.group))
        self._total = None
        await ctx.scheduler.call(
            lambda: ctx.runner.fold(step, fresh=set(request.fresh), take=list(request.take))
        )
        others = [q for q in request.group if q != ctx.peer_id]
        started = time.monotonic()
        total = await self._exchange(step, request.attempt, others) if others else None
        if others:
            self._timed_exchange(time.monotonic() - started)
        norm, _ = await ctx.scheduler.call(tensor_norm, ctx.runner.grads() if total is None else total)
        if not norm < SQUARE_SAFE:  # NaN fails too
            raise RemoteError(
                f"the gradient total of step {step} has norm {norm:.3g}, beyond what the "
                f"optimizer can square in fp32 ({SQUARE_SAFE:.3g}): refused to commit",
                cause=Cause.REFUSED,
            )
        self._total = (step, total)
        return self._done(ctx.runner.step, Exchanged(grad_sq_norm=norm * norm).to_meta())

    async def _on_apply(self, step: int, request: Apply) -> Frame:
        ctx = self.ctx
        runner = ctx.runner
        if runner.step == step + 1 and not runner.has_gradients:
            pass  # applied already; only the reply was lost
        elif self._total is None or self._total[0] != step:
            raise RemoteError(
                f"step {step} was not exchanged on this replica", cause=Cause.OWN_FAILURE, retryable=False
            )
        else:
            total = self._total[1]
            counted = tuple(sorted(runner.report()[0]))
            await ctx.scheduler.call(lambda: runner.apply_step(step, total, grad_scale=request.grad_scale))
            self._applied = (step, request.grad_scale, counted)
            self._total = None
            self.cache.clear()
            ctx.on_applied()
        digest = await ctx.scheduler.call(runner.param_digest) if request.digest else None
        return self._done(runner.step, Applied(digest=digest).to_meta())

    def _timed_exchange(self, seconds: float) -> None:
        """Fold one exchange's seconds into `exchange_s`; the first (cold: connections, buffers)
        is replaced by the second, as the readiness estimator does with compute."""
        self._exchanges += 1
        if self._exchanges <= 2:
            self.exchange_s = seconds
        else:
            self.exchange_s += EXCHANGE_EMA * (seconds - self.exchange_s)

    async def _exchange(self, step: int, attempt: int, others: list[str]) -> list[torch.Tensor]:
        """Send this replica's gradient sum to `others`, take theirs; returns the group's total."""
        ctx = self.ctx
        banned = [q[-8:] for q in others if ctx.transport.is_banned(q)]
        if banned:  # its gradients would be refused unread: do not wait for them
            raise RemoteError(
                f"this replica bans replica(s) {', '.join(banned)} of its group: plan the commit again",
                cause=Cause.REFUSED,
                retryable=True,
            )
        grads = ctx.runner.grads()
        codec = ctx.codec_for("averaging", others[0], sum(g.nbytes for g in grads))
        feedback = self.feedback if ctx.compression.error_feedback else None
        # Every replica adds, for itself too, what the others decode from its frame: the sums
        # stay bit-identical whatever the codec (swarmtrain.compress.exchange).
        sent, local = await ctx.scheduler.call(lambda: compress_for_exchange(grads, codec, feedback))
        frame = Frame(
            kind="grads",
            run_id=ctx.run_id,
            stage=ctx.stage,
            step=step,
            tensors=sent,
            meta=GradsMeta(attempt=attempt).to_meta(),
        )
        sends = [ctx.transport.call(q, ctx.handler, frame, timeout_s=EXCHANGE_TIMEOUT_S) for q in others]
        results = await asyncio.gather(
            *sends, self.inbox.take((step, attempt), others, EXCHANGE_TIMEOUT_S), return_exceptions=True
        )
        if isinstance(results[-1], RemoteError) and results[-1].cause == Cause.REFUSED:
            raise results[-1]  # this replica refused a contribution: say so, not "unreachable"
        for result in results:
            if isinstance(result, (RemoteError, PeerUnreachableError, BadFrameError)):
                raise RemoteError(f"gradient exchange failed: {result}", cause=Cause.UNREACHABLE)
            if isinstance(result, BaseException):
                raise result
        return group_sum(ctx.peer_id, local, results[-1])

    async def on_grads(self, frame: Frame, sender: str) -> Frame:
        """Take another replica's gradient sum for the exchange in progress."""
        ctx = self.ctx
        meta = GradsMeta.from_meta(frame.meta)
        if frame.step != ctx.runner.step:
            raise RemoteError(
                f"stage {ctx.stage} is at step {ctx.runner.step}, not {frame.step}", cause=Cause.WRONG_STEP
            )
        grads = [frame.tensors.get(str(i)) for i in range(len(frame.tensors))]
        if any(g is None for g in grads):
            raise BadFrameError("a grads frame names its tensors 0..N-1")
        key = (frame.step, meta.attempt)
        try:
            check_like(sender, grads, ctx.runner.grads())
            norm = await ctx.scheduler.call(tensor_norm, grads)
            admit_frame(ctx.runner.bounds.exchange, norm, f"gradients of step {frame.step}")
        except BadFrameError as e:
            await self.inbox.refuse(key, sender, str(e))
            raise
        await self.inbox.put(key, sender, grads, ctx.runner.grads())
        return Frame(kind="result", run_id=ctx.run_id, stage=ctx.stage, step=frame.step)
