"""One optimizer step, driven by a trainer: send every microbatch, then commit every stage.

Flow. At most `window` microbatches are in flight. Each goes to the stage-0 replica the
router expects to finish it first (static schedule: round-robin, with the whole route fixed
by `schedule.static`); stages chain it on, replaying failed hops themselves. A call that
fails here bans that replica and the microbatch is replayed (marked as a replay) from the
trainer, which holds its input (`hop.Hop`, the same loop the stages use). Every microbatch
ends completed or dropped with a cause (`StepLedger`).

Commit (`commit.CommitParticipant` is the replicas' side), in rounds until it goes through:
prepare every live replica of every stage, then act on `schedule.decide_commit`: wait for a
stage with no live replica; discard a stage whose buffers cannot be made exact (its
microbatches replay); replay what no live replica holds (a replica died with it), steering
each stage to the replica that already has the work; or exchange gradients within each
stage and, once every stage has exchanged, apply everywhere. Nothing is applied before every
stage can apply, so a death anywhere before that costs a replay, not data. Each stage's
exchange reply gives its gradient total's squared norm; the apply's one `grad_scale` carries
the dropped-microbatch rescale times the clip coefficient of the whole model's gradient norm.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import torch

from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError, SwarmError
from swarmtrain.schedule import CommitAction, ReadinessRouter, ReplicaReport, StepLedger, decide_commit
from swarmtrain.schedule.static import assign
from swarmtrain.train.authority import microbatch_id
from swarmtrain.train.hop import Hop, HopContext, HopFailedError, HopFailure
from swarmtrain.train.optim import clip_coefficient, lr_at
from swarmtrain.train.run_length import finished_error, is_finished
from swarmtrain.train.step_result import StepResult
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import (
    NO_PREFERENCE,
    Abort,
    Applied,
    Apply,
    CommitRequest,
    Exchange,
    Exchanged,
    ForwardMeta,
    Prepare,
    Prepared,
)
from swarmtrain.wire.records import OptimizerConfig

logger = logging.getLogger(__name__)

_epochs = itertools.count()
COMMIT_CALL_TIMEOUT_S = 60.0
"""Longest wait for one replica's answer to a commit phase (the exchange moves gradients)."""

Microbatch = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""(inputs, named loss inputs)."""


class StepFailedError(SwarmError):
    """A step could not complete; the message says which microbatch or stage and why."""


@dataclass(kw_only=True)
class TrainerContext:
    """What a step needs from the trainer that runs it."""

    run_id: str
    trainer_id: str
    """The trainer's peer id: its microbatch ids carry it (`authority.microbatch_id`), and stage 0
    serves a microbatch only to the trainer its id names."""
    num_stages: int
    static: bool
    """The run's schedule is the static baseline (fixed round-robin routes)."""
    router: ReadinessRouter
    transport: TensorTransport
    replicas: Callable[..., Awaitable[dict[int, list[str]]]]
    """`await replicas(refresh=False, wait_for_all=False)`: each stage's live replicas at this
    step; `refresh` reads the swarm again, `wait_for_all` waits until every stage has one."""
    wait_for_replica: Callable[[float], Awaitable[None]]
    """Every replica of stage 0 is banned or gone: wait at most this long, then look again."""
    known_step: dict[str, int]
    """Per replica, the step its last commit reply said it is at (updated by the step)."""
    microbatch_timeout_s: float
    max_retries: int
    max_dropped_fraction: float
    verify_replicas: bool
    window: int
    """Microbatches in flight at once."""
    optimizer: OptimizerConfig
    """The run's optimizer settings: the learning-rate schedule and gradient clipping."""
    max_steps: int
    """The run's step count (0: none); no step at or past it is run."""

    @property
    def handler(self) -> str:
        return handler_name(self.run_id)


class TrainerStep:
    """One optimizer step (see the module docstring); `await run()` returns its StepResult."""

    def __init__(self, ctx: TrainerContext, step: int, microbatches: list[Microbatch]):
        self.ctx = ctx
        self.step = step
        self.microbatches = microbatches
        epoch = next(_epochs)
        self.ids = [microbatch_id(ctx.trainer_id, step, epoch, n) for n in range(len(microbatches))]
        self.ledger = StepLedger(issued=tuple(self.ids))
        self.timeouts = 0
        self.digests: dict[int, dict[str, str]] = {}
        self.grad_norm: float | None = None
        self._hops = HopContext(
            router=ctx.router,
            transport=ctx.transport,
            handler=ctx.handler,
            candidates=self._stage0,
            wait_for_replica=ctx.wait_for_replica,
        )

    async def _stage0(self) -> list[str]:
        return (await self.ctx.replicas()).get(0, [])

    # flow

    async def _send(
        self,
        n: int,
        *,
        replay: bool = False,
        prefer: tuple[str | None, ...] = (),
        needed_by: tuple[int, ...] = (),
    ) -> None:
        """Get microbatch `n` through the pipeline once; record its loss and route."""
        ctx, mb = self.ctx, self.ids[n]
        x, loss_inputs = self.microbatches[n]
        meta = ForwardMeta(
            loss_scale=1.0 / len(self.microbatches),
            budget_s=ctx.microbatch_timeout_s,
            order=n,
            prefer=tuple(p or NO_PREFERENCE for p in prefer),
            needed_by=needed_by,
        )
        if ctx.static and not prefer:
            static = assign(n, await ctx.replicas(), ctx.num_stages)
            meta = replace(
                meta,
                prefer=static.prefer,
                slots=static.slots,
                slot_counts=static.slot_counts,
                microbatches=len(self.microbatches),
            )

        def build(target: str, is_replay: bool, budget_s: float) -> Frame:
            return Frame(
                kind="forward",
                run_id=ctx.run_id,
                mb_id=mb,
                stage=0,
                step=self.step,
                tensors={"x": x, **loss_inputs},
                meta=replace(meta, replay=is_replay, budget_s=budget_s).to_meta(),
            )

        def failed(failure: HopFailure) -> None:
            self.timeouts += failure.timed_out
            self.ledger.replay(failure.label)
            logger.warning("replaying microbatch %d of step %d: %s", n, self.step, failure)

        hop = Hop(
            build=build,
            deadline=time.monotonic() + ctx.microbatch_timeout_s * (ctx.max_retries + 1),
            timeout_s=ctx.microbatch_timeout_s,
            order=n,
            prefer=meta.preferred(0),
            replay=replay,
            max_attempts=ctx.max_retries + 1,
            route_len=ctx.num_stages,
            on_failure=failed,
        )
        try:
            result = (await hop.send(self._hops)).result
        except RemoteError as e:  # the microbatch itself was refused: drop it, or fail the step
            if self._may_drop():
                self.ledger.drop(mb, str(e))
                return
            raise StepFailedError(f"step {self.step}, microbatch {n}: {e}") from None
        except HopFailedError as e:
            raise StepFailedError(f"step {self.step}, microbatch {n}: {e}") from None
        self.ledger.complete(mb, result.loss, result.route)
        self.ledger.replay("hop failure (replayed by a stage)", result.replays)

    def _may_drop(self) -> bool:
        allowed = int(self.ctx.max_dropped_fraction * len(self.ids))
        return len(self.ledger.dropped) < allowed

    async def _flow(self) -> None:
        window = asyncio.Semaphore(self.ctx.window)

        async def one(n: int) -> None:
            async with window:
                await self._send(n)

        await _all(one(n) for n in range(len(self.microbatches)))

    # commit

    async def _call_stage(self, peer: str, stage: int, request: CommitRequest) -> Frame:
        frame = Frame(
            kind="step", run_id=self.ctx.run_id, stage=stage, step=self.step, meta=request.to_meta()
        )
        return await self.ctx.transport.call(peer, self.ctx.handler, frame, timeout_s=COMMIT_CALL_TIMEOUT_S)

    async def _prepare(self) -> dict[int, list[ReplicaReport]]:
        """Every reachable replica of every stage at this step, with what it holds."""
        ctx = self.ctx
        replicas = await ctx.replicas(refresh=True)
        now = time.monotonic()
        groups = {  # a replica that just failed us is left out: it is most likely dead
            k: {
                p
                for p in set(replicas.get(k, [])) | self.ledger.routed_to(k)
                if not ctx.router.bans.is_banned(p, now)
            }
            for k in range(ctx.num_stages)
        }
        reports: dict[int, list[ReplicaReport]] = {k: [] for k in range(ctx.num_stages)}

        async def ask(k: int, peer: str) -> None:
            try:
                reply = await self._call_stage(peer, k, Prepare())
                prepared = Prepared.from_meta(reply.meta)
            except (RemoteError, PeerUnreachableError, BadFrameError) as e:
                ctx.router.done(peer, time.monotonic(), ok=False)
                logger.info("stage %d replica %s left the commit: %s", k, peer[-8:], e)
                return
            if reply.step == self.step:
                reports[k].append(
                    ReplicaReport(peer=peer, fresh=frozenset(prepared.fresh), held=frozenset(prepared.held))
                )

        await asyncio.gather(*(ask(k, p) for k, peers in groups.items() for p in peers))
        return reports

    async def _commit(self) -> None:
        ctx = self.ctx
        for attempt in range(ctx.max_retries + 3):
            if attempt:
                await asyncio.sleep(min(0.25 * 2**attempt, 2.0))
            reports = await self._prepare()
            decision = decide_commit(self.ledger.issued, self.ledger.completed, reports)
            if decision.action == CommitAction.WAIT:
                logger.warning(
                    "stage(s) %s have no live replica at step %d: waiting", list(decision.stages), self.step
                )
                await ctx.replicas(refresh=True, wait_for_all=True)
                continue
            if decision.action == CommitAction.ABORT:
                logger.warning(
                    "stage(s) %s hold inexact gradients: discarding and replaying", list(decision.stages)
                )
                await asyncio.gather(
                    *(self._call_stage(r.peer, k, Abort()) for k in decision.stages for r in reports[k]),
                    return_exceptions=True,
                )
                continue
            if decision.action == CommitAction.REPAIR:
                logger.warning(
                    "commit of step %d: %d microbatch(es) lost with a replica; replaying them",
                    self.step,
                    len(decision.repairs),
                )
                self.ledger.replay("lost with a replica (repaired at commit)", len(decision.repairs))
                for repair in decision.repairs:
                    del self.ledger.losses[repair.mb]
                    await self._send(
                        self.ids.index(repair.mb),
                        replay=True,
                        prefer=repair.prefer,
                        needed_by=repair.needed_by,
                    )
                continue
            plans = decision.plans
            calls = [
                self._exchange(
                    r.peer,
                    k,
                    Exchange(
                        fresh=plans[k].fresh[r.peer],
                        take=plans[k].take[r.peer],
                        group=tuple(sorted(q.peer for q in rs)),
                        attempt=attempt,
                    ),
                )
                for k, rs in reports.items()
                for r in rs
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            errors = [e for e in results if isinstance(e, BaseException)]
            if errors:
                refused = next((e for e in errors if isinstance(e, RemoteError) and not e.retryable), None)
                if refused is not None:
                    raise StepFailedError(f"step {self.step}: a stage refused to commit: {refused}")
                logger.warning(
                    "commit of step %d: exchange failed (%s); planning again", self.step, errors[0]
                )
                continue
            sq_norms: dict[int, list[float | None]] = {}
            for k, sq_norm in zip([k for k, rs in reports.items() for _ in rs], results):
                sq_norms.setdefault(k, []).append(sq_norm)
            await self._apply({k: [r.peer for r in rs] for k, rs in reports.items()}, sq_norms)
            return
        raise StepFailedError(f"step {self.step} could not be committed after {attempt + 1} rounds")

    async def _exchange(self, peer: str, stage: int, request: Exchange) -> float | None:
        """One replica's exchange; returns the squared norm of its group's gradient total."""
        reply = await self._call_stage(peer, stage, request)
        return Exchanged.from_meta(reply.meta).grad_sq_norm

    async def _apply(
        self, committed_by: dict[int, list[str]], sq_norms: dict[int, list[float | None]]
    ) -> None:
        """Every stage has exchanged: step every replica (a dead one is simply gone).

        `sq_norms`: per stage, its replicas' squared norms of the group total (equal: the
        replicas hold the same total; the largest counts)."""
        ctx = self.ctx
        dropped = len(self.ledger.dropped)
        scale = len(self.ids) / (len(self.ids) - dropped) if dropped else 1.0
        per_stage = [None if None in sq else max(sq) for sq in sq_norms.values()]
        if None not in per_stage:
            self.grad_norm = scale * math.sqrt(sum(per_stage))
        elif ctx.optimizer.max_grad_norm > 0:
            raise StepFailedError(
                f"step {self.step}: a stage did not report its gradient norm, which clipping needs "
                "(is every stage peer of this swarmtrain version?)"
            )
        clip = clip_coefficient(self.grad_norm or 0.0, ctx.optimizer.max_grad_norm)
        self.digests = {k: {} for k in committed_by}
        request = Apply(grad_scale=float(scale * clip), digest=ctx.verify_replicas)

        async def apply(k: int, peer: str) -> None:
            for attempt in range(3):
                try:
                    reply = await self._call_stage(peer, k, request)
                    applied = Applied.from_meta(reply.meta)
                except (PeerUnreachableError, BadFrameError) as e:
                    logger.warning(
                        "replica %s of stage %d did not apply step %d: %s", peer[-8:], k, self.step, e
                    )
                    await asyncio.sleep(0.5 * (attempt + 1))
                    continue
                except RemoteError as e:
                    logger.warning(
                        "replica %s of stage %d refused to apply step %d: %s", peer[-8:], k, self.step, e
                    )
                    return
                ctx.known_step[peer] = reply.step
                if applied.digest is not None:
                    self.digests[k][peer] = applied.digest
                return

        await asyncio.gather(*(apply(k, p) for k, peers in committed_by.items() for p in peers))

    def _replicas_equal(self) -> tuple[bool | None, dict[int, int]]:
        """The verdict on the digests (see StepResult.replicas_equal) and how many were compared."""
        if not self.ctx.verify_replicas:
            return None, {}
        compared = {k: len(d) for k, d in self.digests.items()}
        groups = [set(d.values()) for d in self.digests.values() if len(d) >= 2]
        if not groups:
            return None, compared
        return all(len(g) == 1 for g in groups), compared

    async def run(self) -> StepResult:
        """Run the step; RunFinishedError if the run's last step was applied already."""
        if is_finished(self.step, self.ctx.max_steps):
            raise finished_error(self.ctx.run_id, self.ctx.max_steps)
        started = time.monotonic()
        await self._flow()
        if not self.ledger.losses:
            raise StepFailedError(f"step {self.step}: every microbatch was dropped: {self.ledger.dropped}")
        unaccounted = self.ledger.unaccounted()
        assert not unaccounted, f"microbatches {unaccounted} neither completed nor dropped"
        await self._commit()
        done = [self.ids.index(mb) for mb in self.ledger.losses]
        x0 = self.microbatches[0][0]
        samples = sum(self.microbatches[n][0].shape[0] for n in done)
        tokens = samples if x0.is_floating_point() else sum(self.microbatches[n][0].numel() for n in done)
        routes = self.ledger.routes.values()
        work = {k: dict(Counter(r[k] for r in routes)) for k in range(self.ctx.num_stages)}
        equal, compared = self._replicas_equal()
        return StepResult(
            step=self.step,
            loss=sum(self.ledger.losses.values()) / len(self.ledger.losses),
            samples=samples,
            tokens=tokens,
            seconds=time.monotonic() - started,
            replays=sum(self.ledger.replays.values()),
            dropped=len(self.ledger.dropped),
            completed=len(self.ledger.losses),
            replay_causes=dict(self.ledger.replays),
            dropped_causes=dict(Counter(self.ledger.dropped.values())),
            work=work,
            window=self.ctx.window,
            timeouts=self.timeouts,
            replicas_equal=equal,
            replicas_compared=compared,
            lr=lr_at(self.ctx.optimizer, self.step, self.ctx.max_steps),
            grad_norm=self.grad_norm,
        )


async def _all(jobs) -> None:
    """Run `jobs` together; the first failure cancels the rest and is raised."""
    tasks = [asyncio.create_task(job) for job in jobs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
