"""Serving a forward: compute in ready-queue order, hop on by readiness, answer with the gradient.

A forward request carries a microbatch: its input `x` and its named loss inputs (targets,
and whatever else the run's loss takes), which travel unchanged to the last stage. The stage
queues its forward on the compute thread (`schedule.runtime`), sends the output on to the
replica of the next stage it expects to finish soonest (`hop.Hop`: a failed hop is banned
and replayed to another replica from the output this stage still holds), and waits for that
call's reply: the gradient of its output. It queues the backward and answers upstream with
the gradient of its input. The last stage runs forward, loss and backward as one task.

Blame. What is provably the request's fault strikes the caller (BadFrameError): a shape or
dtype the stage does not expect and input activations out of bounds (`bounds`), both
checked before any compute; an index out of range of the model's tables is the microbatch's
(struck at stage 0, whose caller built it; REFUSED further on). Anything else that
fails in this replica's own compute (out of memory, a device error) is its own failure
(OWN_FAILURE, retryable elsewhere). A reply from the next stage is that replica's fault when
its gradient has the wrong shape or is out of bounds: it is struck and the microbatch
replayed on another. A refusal of this stage's output by the next stage (bad frame, banned)
is about this replica, not the microbatch, and is answered as OWN_FAILURE too; only REFUSED
(the microbatch itself, e.g. a non-finite loss) passes upstream as final.

A replay (`ForwardMeta.replay`) is marked, so replicas keep its parameter gradient apart
until the commit decides which copy counts (`schedule.accounting`). Each stage also keeps,
until the step commits, the input gradient it returned for each microbatch and the input it
came from (`ReplayCache`): when an upstream replica dies mid-backward and the microbatch is
replayed to a sibling, an identical input is answered from the cache, so the backward is
replayed from the nearest peer that still holds its input instead of recomputing the rest of
the pipeline. A commit's repair names the stages that lost the work (`needed_by`): from
those on, stages recompute.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from swarmtrain.errors import BadFrameError, Cause, RemoteError
from swarmtrain.schedule import Task
from swarmtrain.schedule.static import expected_orders
from swarmtrain.train.bounds import admit_frame, tensor_norm
from swarmtrain.train.context import StageContext
from swarmtrain.train.hop import Hop, HopContext, HopFailedError, HopFailure
from swarmtrain.wire.frames import Frame, all_finite
from swarmtrain.wire.messages import MEMBER_PROOF, ForwardMeta, Readiness, ResultMeta

logger = logging.getLogger(__name__)

HOP_MARGIN_S = 0.5
"""Time a stage keeps for itself when it passes the remaining budget downstream."""
INPUT = "x"
"""The tensor name of a stage's input; every other tensor of a forward is a loss input."""
SCORES = "scores"
"""The tensor name of a score pass's answer (`ForwardMeta.score`)."""


@dataclass
class _Answered:
    x: torch.Tensor
    result: ResultMeta
    grad: torch.Tensor | None


@dataclass
class ServeCounters:
    """What a replica did, over its life (it may serve several stages in turn)."""

    served: int = 0
    """Microbatches answered."""
    failed: int = 0
    """Microbatches refused or failed."""
    replayed: int = 0
    """Hops replayed to another replica downstream."""
    scored: int = 0
    """Score passes answered (`ForwardMeta.score`; not in `served`)."""


class ReplayCache:
    """The answers a stage gave during the current step, by microbatch (see the module docstring)."""

    def __init__(self):
        self._answers: dict[str, _Answered] = {}
        self._step = -1
        self.hits = 0

    def clear(self) -> None:
        self._answers.clear()

    def at_step(self, step: int) -> None:
        if step != self._step:
            self._answers.clear()
            self._step = step

    def get(self, mb: str, x: torch.Tensor) -> _Answered | None:
        """The answer kept for `mb`, if it came from an identical input."""
        kept = self._answers.get(mb)
        if kept is not None and kept.x.shape == x.shape and torch.equal(kept.x, x):
            self.hits += 1
            return kept
        return None

    def put(self, mb: str, x: torch.Tensor, result: ResultMeta, grad: torch.Tensor | None) -> None:
        self._answers[mb] = _Answered(x=x, result=result, grad=grad)


def split_tensors(frame: Frame) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A forward frame's input and named loss inputs; BadFrameError without an input."""
    x = frame.tensors.get(INPUT)
    if x is None:
        raise BadFrameError(f"a forward frame needs its input tensor {INPUT!r}")
    return x, {k: v for k, v in frame.tensors.items() if k != INPUT}


class ForwardServer:
    """Serves forward requests for one stage replica (see the module docstring)."""

    def __init__(self, ctx: StageContext, counters: ServeCounters | None = None):
        self.ctx = ctx
        self.cache = ReplayCache()
        self.counters = counters or ServeCounters()
        self._hops = HopContext(
            router=ctx.router,
            transport=ctx.transport,
            handler=ctx.handler,
            candidates=self._next_replicas,
            wait_for_replica=ctx.refresh,
        )

    async def _next_replicas(self) -> list[str]:
        return self.ctx.replicas(self.ctx.stage + 1)

    async def on_forward(self, frame: Frame, caller: str) -> Frame:
        """Serve one microbatch; the reply carries the loss, the route and the input gradient.

        Raises BadFrameError for a malformed request, RemoteError (with its cause) when this
        stage cannot serve it now or the pipeline after it failed (see Blame above).
        """
        ctx = self.ctx
        started = time.monotonic()
        meta = ForwardMeta.from_meta(frame.meta, ignore=frozenset({MEMBER_PROOF}))
        x, loss_inputs = split_tensors(frame)
        ctx.runner.check_inputs(x, loss_inputs)
        if x.is_floating_point():
            admit_frame(
                ctx.runner.bounds.activations, tensor_norm(x), f"input activations of stage {ctx.stage}"
            )
        if meta.score:
            return await self._score(frame, meta, x, loss_inputs, started)
        self._check_step(frame.step)
        self.cache.at_step(frame.step)
        if meta.slots:
            if len(meta.slots) != ctx.num_stages:
                raise BadFrameError(
                    f"forward meta slots name {len(meta.slots)} stages, the run has {ctx.num_stages}"
                )
            orders = expected_orders(meta.slots[ctx.stage], meta.slot_counts[ctx.stage], meta.microbatches)
            ctx.scheduler.expect(frame.step, orders, ctx.num_stages - ctx.stage)
        # The cache may answer only when no stage from here on lacks the work.
        usable = meta.replay and all(k < ctx.stage for k in meta.needed_by)
        kept = self.cache.get(frame.mb_id, x) if usable else None
        if kept is not None:
            result, grad_x = replace(kept.result, replays=0), kept.grad
        else:
            deadline = started + meta.budget_s
            with self._blame(frame):
                result, grad_x = await self._compute(frame, meta, x, loss_inputs, deadline)
            self.cache.put(frame.mb_id, x, result, grad_x)
        tensors, codecs = {}, {}
        if grad_x is not None:
            tensors["grad"] = grad_x
            codec = ctx.codec_for("gradients", caller, grad_x.nbytes)
            if codec != "none":
                codecs["grad"] = codec
        return self._reply(frame, result, started, tensors, codecs)

    def _reply(
        self, frame: Frame, result: ResultMeta, started: float, tensors: dict, codecs: dict | None = None
    ) -> Frame:
        ctx = self.ctx
        ready = Readiness.of(ctx.scheduler.readiness())
        reply = replace(result, service_s=time.monotonic() - started, **ready.to_meta())
        return Frame(
            kind="result",
            run_id=ctx.run_id,
            mb_id=frame.mb_id,
            stage=ctx.stage,
            step=frame.step,
            tensors=tensors,
            codecs=codecs or {},
            meta=reply.to_meta(),
        )

    @contextlib.contextmanager
    def _blame(self, frame: Frame):
        """Map a failure of this replica's compute (or of the pipeline after it) to its cause."""
        ctx = self.ctx
        try:
            yield
        except RemoteError:
            raise
        except IndexError as e:  # only a microbatch's token ids and targets index the model's tables
            problem = f"an index in microbatch {frame.mb_id} is out of range: {e}"
            if ctx.stage == 0:  # the caller built it
                raise BadFrameError(problem) from None
            raise RemoteError(problem, cause=Cause.REFUSED) from None  # the caller only relayed it
        except Exception as e:  # out of memory, a device error: this replica's, not the caller's
            logger.warning("stage %d failed on microbatch %s: %r", ctx.stage, frame.mb_id, e)
            raise RemoteError(
                f"stage {ctx.stage} failed to compute microbatch {frame.mb_id}: {e!r}",
                cause=Cause.OWN_FAILURE,
            ) from None

    async def _score(self, frame: Frame, meta: ForwardMeta, x, loss_inputs: dict, started: float) -> Frame:
        """A score pass (`ForwardMeta.score`): forward only on the parameters of exactly
        `frame.step`, as bookkeeping on the compute thread (it keeps nothing, so it takes no
        part in the queue's order, the readiness figures or fault injection); the reply
        carries the last stage's scores. A replica at another step refuses it (WRONG_STEP,
        not retryable: the scores would not be of the step asked for)."""
        ctx, runner = self.ctx, self.ctx.runner
        if frame.step > runner.step:
            ctx.on_behind()
        with self._blame(frame):
            if ctx.is_last:
                loss, scores = await ctx.scheduler.call(runner.score_last, frame.step, x, loss_inputs)
                result = ResultMeta(loss=loss, route=(ctx.peer_id,))
            else:
                out = await ctx.scheduler.call(runner.score_forward, frame.step, x)
                hop = await self._hop(frame, meta, out, loss_inputs, started + meta.budget_s)
                scores, downstream = hop.reply.tensors[SCORES], hop.result
                result = ResultMeta(
                    loss=downstream.loss,
                    route=(ctx.peer_id, *downstream.route),
                    replays=len(hop.failures) + downstream.replays,
                )
        return self._reply(frame, result, started, {SCORES: scores})

    def _check_step(self, step: int) -> None:
        runner = self.ctx.runner
        if step == runner.step:
            return
        if runner.from_seed and runner.num_pending == 0 and not runner.has_gradients:
            runner.step = step  # a stage nobody served starts from the seed at the run's step
            return
        if step > runner.step:
            self.ctx.on_behind()
        raise RemoteError(
            f"stage {self.ctx.stage} is at step {runner.step}, not {step}", cause=Cause.WRONG_STEP
        )

    async def _compute(
        self, frame: Frame, meta: ForwardMeta, x, loss_inputs: dict, deadline: float
    ) -> tuple[ResultMeta, torch.Tensor | None]:
        """(the result from here on, the input gradient) for one microbatch."""
        ctx, mb = self.ctx, frame.mb_id
        runner, sched = ctx.runner, ctx.scheduler

        def task(kind: str) -> Task:
            return Task(kind=kind, mb_id=mb, step=frame.step, order=meta.order)

        if ctx.is_last:
            fn = partial(runner.forward_loss_backward, replay=meta.replay)
            loss, grad_x = await sched.run(task("loss"), fn, mb, x, loss_inputs, meta.loss_scale)
            return ResultMeta(loss=loss, route=(ctx.peer_id,)), grad_x
        out = await sched.run(task("forward"), runner.forward, mb, x)
        try:
            hop = await self._hop(frame, meta, out, loss_inputs, deadline)
            fn = partial(runner.backward, replay=meta.replay)
            grad_x = await sched.run(task("backward"), fn, mb, hop.reply.tensors["grad"])
        finally:
            runner.drop(mb)
            sched.wake()
        downstream = hop.result
        result = ResultMeta(
            loss=downstream.loss,
            route=(ctx.peer_id, *downstream.route),
            replays=len(hop.failures) + downstream.replays,
        )
        return result, grad_x

    async def _hop(
        self, frame: Frame, meta: ForwardMeta, out: torch.Tensor, loss_inputs: dict, deadline: float
    ):
        """Send the output on to a replica of the next stage (see `hop.Hop`)."""
        ctx, nxt = self.ctx, self.ctx.stage + 1

        def build(target: str, replay: bool, budget_s: float) -> Frame:
            codec = ctx.codec_for("activations", target, out.nbytes)
            signed = ctx.membership_proof()  # our latest record, for a next stage whose view lacks us
            proof = {} if signed is None else {MEMBER_PROOF: signed}
            forward = replace(meta, budget_s=budget_s, replay=replay)
            return Frame(
                kind="forward",
                run_id=frame.run_id,
                mb_id=frame.mb_id,
                stage=nxt,
                step=frame.step,
                tensors={INPUT: out, **loss_inputs},
                codecs={} if codec == "none" else {INPUT: codec},
                meta=forward.to_meta() | proof,
            )

        def replayed(failure: HopFailure) -> None:
            self.counters.replayed += 1
            logger.info(
                "replaying microbatch %s to another replica of stage %d: %s", frame.mb_id, nxt, failure
            )

        hop = Hop(
            build=build,
            deadline=deadline - HOP_MARGIN_S,
            timeout_s=deadline - HOP_MARGIN_S - time.monotonic(),
            order=meta.order,
            nbytes=out.nbytes,
            prefer=meta.preferred(nxt),
            replay=meta.replay,
            route_len=ctx.num_stages - nxt,
            expect_grad=not meta.score,
            check=scores_check(loss_inputs["targets"].shape) if meta.score else self._grad_check(out),
            on_failure=replayed,
        )
        try:
            return await hop.send(self._hops)
        except HopFailedError as e:
            raise RemoteError(
                f"stage {nxt} did not complete microbatch {frame.mb_id} in time ({e})",
                cause=Cause.UNREACHABLE,
            ) from None
        except RemoteError as e:
            if e.cause == Cause.REFUSED or (meta.score and not e.retryable):
                raise  # the microbatch itself, or a score pass the next stage cannot take at this step
            raise RemoteError(  # our frame was refused (bad, banned): this replica's failure
                f"stage {nxt} refused stage {ctx.stage}'s output of microbatch {frame.mb_id}: {e}",
                cause=Cause.OWN_FAILURE,
            ) from None

    def _grad_check(self, out: torch.Tensor) -> Callable[[Frame], None]:
        """The check of a reply's gradient: its replica's fault unless it fits `out` and the bounds."""
        bound = self.ctx.runner.bounds.grads_in

        def check(reply: Frame) -> None:
            grad = reply.tensors["grad"]
            if grad.shape != out.shape or grad.dtype != out.dtype:
                raise BadFrameError(
                    f"the reply's gradient is {tuple(grad.shape)} {grad.dtype}, "
                    f"the output it belongs to was {tuple(out.shape)} {out.dtype}"
                )
            admit_frame(bound, tensor_norm(grad), "the reply's gradient")

        return check


def scores_check(shape: tuple[int, ...]) -> Callable[[Frame], None]:
    """The check of a score pass's reply: float32 'scores' of the targets' `shape`, all finite
    (otherwise the replying replica's fault)."""

    def check(reply: Frame) -> None:
        scores = reply.tensors.get(SCORES)
        if scores is None:
            raise BadFrameError(f"a score pass's reply lacks its {SCORES!r}")
        if tuple(scores.shape) != tuple(shape) or scores.dtype != torch.float32:
            raise BadFrameError(
                f"a score pass's reply holds {tuple(scores.shape)} {scores.dtype} scores, "
                f"expected {tuple(shape)} torch.float32"
            )
        if not all_finite(scores):
            raise BadFrameError("a score pass's reply holds non-finite scores")

    return check
