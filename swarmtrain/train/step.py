"""One optimizer step, as one trainer runs it: its share of the microbatches, then the commit.

Flow. A trainer feeds its share of the step: the positions its shard holds (`shards`; all of
them for a trainer alone), each microbatch under an id with the trainer's peer id and its
position (`authority.microbatch_id`), its loss scaled by 1 / the step's microbatches so the
stages' gradient sums add up to the step's mean. At most `window` are in flight. Each goes to
the stage-0 replica the router expects to finish it first (static schedule: round-robin,
with the whole route fixed by `schedule.static`); stages chain it on, replaying failed hops
themselves. A call that fails here bans that replica and the microbatch is replayed (marked
as a replay) from the trainer, which holds its input (`hop.Hop`, the same loop the stages
use). Every microbatch ends completed or dropped with a cause (`StepLedger`).

Commit. One trainer commits each step over every trainer's share (`committer.StepCommit`);
a trainer alone commits its own steps (`TrainerStep.run`), and with others `team.Team`
decides who commits. The commit may ask this trainer to replay microbatches a dead replica
took with it (`replay`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from dataclasses import replace

import torch

from swarmtrain.errors import RemoteError
from swarmtrain.schedule import StepLedger
from swarmtrain.schedule.accounting import Repair
from swarmtrain.schedule.static import assign
from swarmtrain.train.authority import microbatch_id
from swarmtrain.train.committer import SOLO, Deferred, StepCommit, StepFailedError
from swarmtrain.train.hop import Hop, HopFailedError, HopFailure
from swarmtrain.train.optim import lr_at
from swarmtrain.train.run_length import finished_error, is_finished
from swarmtrain.train.step_account import Committed, Share
from swarmtrain.train.step_result import StepResult
from swarmtrain.train.trainer_context import TrainerContext
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import NO_PREFERENCE, ForwardMeta

logger = logging.getLogger(__name__)

__all__ = ["Microbatch", "StepFailedError", "StepResult", "TrainerContext", "TrainerStep"]

_epochs = itertools.count()


def next_epoch() -> int:
    """A number no other microbatch id of this process uses (a retried step's, a score pass's)."""
    return next(_epochs)


Microbatch = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""(inputs, named loss inputs)."""


class TrainerStep:
    """One trainer's part of one optimizer step (see the module docstring).

    `microbatches[i]` is fed at position `positions[i]` of a step of `total` microbatches
    (default: all of them, positions 0..len - 1). `await run()` feeds and commits them alone;
    with other trainers, `await flow()`, then the team commits (`team.Team.settle`).
    """

    def __init__(
        self,
        ctx: TrainerContext,
        step: int,
        microbatches: list[Microbatch],
        *,
        positions: tuple[int, ...] | None = None,
        total: int | None = None,
    ):
        self.ctx = ctx
        self.step = step
        self.microbatches = microbatches
        self.positions = tuple(range(len(microbatches))) if positions is None else positions
        self.total = len(microbatches) if total is None else total
        assert len(self.positions) == len(microbatches) and max(self.positions, default=0) < self.total
        epoch = next_epoch()
        self.ids = [microbatch_id(ctx.trainer_id, step, epoch, n) for n in self.positions]
        self.ledger = StepLedger(issued=tuple(self.ids))
        self.timeouts = 0
        self.started = time.monotonic()
        self._hops = ctx.stage0_hops()

    # flow

    async def _send(
        self,
        i: int,
        *,
        replay: bool = False,
        prefer: tuple[str | None, ...] = (),
        needed_by: tuple[int, ...] = (),
    ) -> None:
        """Get this trainer's `i`-th microbatch through the pipeline once; record its loss and route."""
        ctx, mb, n = self.ctx, self.ids[i], self.positions[i]
        x, loss_inputs = self.microbatches[i]
        meta = ForwardMeta(
            loss_scale=1.0 / self.total,
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
                microbatches=self.total,
            )

        def build(target: str, is_replay: bool, budget_s: float) -> Frame:
            return ctx.stage0_frame(
                mb, self.step, x, loss_inputs, replace(meta, replay=is_replay, budget_s=budget_s)
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

    async def flow(self) -> None:
        """Feed every microbatch of this trainer's share; each ends completed or dropped.
        StepFailedError when one can neither complete nor be dropped."""
        if is_finished(self.step, self.ctx.max_steps):
            raise finished_error(self.ctx.run_id, self.ctx.max_steps)
        window = asyncio.Semaphore(self.ctx.window)

        async def one(i: int) -> None:
            async with window:
                await self._send(i)

        await _all(one(i) for i in range(len(self.microbatches)))
        unaccounted = self.ledger.unaccounted()
        assert not unaccounted, f"microbatches {unaccounted} neither completed nor dropped"

    async def replay(self, repair: Repair) -> None:
        """Send microbatch `repair.mb` again, steered as the commit asks (a replica died with it)."""
        self.ledger.replay("lost with a replica (repaired at commit)")
        self.ledger.losses.pop(repair.mb, None)
        await self._send(
            self.ids.index(repair.mb), replay=True, prefer=repair.prefer, needed_by=repair.needed_by
        )

    def share(self) -> Share:
        """This trainer's part of the step, as the committer counts it."""
        done = [self.ids.index(mb) for mb in self.ledger.losses]
        x0 = self.microbatches[0][0] if self.microbatches else torch.zeros(0)
        samples = sum(self.microbatches[i][0].shape[0] for i in done)
        tokens = samples if x0.is_floating_point() else sum(self.microbatches[i][0].numel() for i in done)
        routes = [self.ledger.routes[mb] for mb in self.ledger.losses]
        return Share(
            trainer=self.ctx.trainer_id,
            issued=tuple(self.ids),
            losses=dict(self.ledger.losses),
            dropped=dict(self.ledger.dropped),
            samples=samples,
            tokens=tokens,
            replays=sum(self.ledger.replays.values()),
            work={k: dict(Counter(r[k] for r in routes)) for k in range(self.ctx.num_stages)},
        )

    # the whole step

    async def run(self) -> StepResult:
        """Feed and commit the step alone; RunFinishedError if the run's last step was applied
        already, StepFailedError if the step cannot complete."""
        await self.flow()
        try:
            committed = await StepCommit(self.ctx, self.step, self, SOLO, self.total).run()
        except Deferred as e:
            raise StepFailedError(f"step {self.step}: {e}, yet this trainer feeds the run alone") from None
        return self.result(committed)

    def result(self, committed: Committed) -> StepResult:
        """This trainer's StepResult of the step `committed` (by it or by another trainer)."""
        return StepResult(
            step=self.step,
            loss=committed.loss,
            samples=committed.samples,
            tokens=committed.tokens,
            seconds=time.monotonic() - self.started,
            replays=max(committed.replays, sum(self.ledger.replays.values())),
            dropped=committed.dropped,
            completed=len(committed.counted),
            adopted=committed.adopted,
            replay_causes=dict(self.ledger.replays),
            dropped_causes=dict(committed.dropped_causes),
            work=committed.work,
            window=self.ctx.window,
            timeouts=self.timeouts,
            replicas_equal=committed.replicas_equal,
            replicas_compared=committed.compared,
            lr=lr_at(self.ctx.optimizer, self.step, self.ctx.max_steps),
            grad_norm=committed.grad_norm,
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
