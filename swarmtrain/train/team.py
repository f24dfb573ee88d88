"""Several trainers feed one run on disjoint shards, and none of them is essential.

Every trainer runs the same step s: the step the stage replicas are at. Each feeds its
shard's positions of s (`shards`) under its own microbatch ids, so stage 0 takes each from the
trainer its id names, and replicas report fresh and held microbatches whoever sent them.

One committer per step. The committer of s is the live trainer with the lowest peer id among
those that announce themselves in the run (`members`), those other trainers named as
committers, and this one; the others are its feeders. A trainer is taken for gone once a call
to it fails (it is live again once it calls us). When views differ, the replicas settle it:
one trainer holds a step's claim (`claims`), and a trainer refused by the claim of another
leaves the step to that one (`committer.Deferred`).

Feeder. Once every microbatch of its share completed or was dropped, it reports them
(`StepReport`) to the committer, and waits (a long poll, answered within POLL_S) for the
outcome (`StepOutcome`): COMMITTED (which microbatches the step counted; this trainer's
others are dropped with their cause, and the step's summary), REPLAY (a replica died with
some of its microbatches: it replays them and reports again), ELSEWHERE (the callee does not
commit s; it names who does) or PENDING (report again). If the committer cannot be reached, it
is gone: the trainer elects again (it may commit s itself now) and reports there.

Committer. It feeds its own share, then runs `committer.StepCommit` over every share: before
it decides, it waits for the report of every trainer that feeds s (a member whose ping says it
feeds s, or whose microbatches the replicas hold), pinging each it waits for: one that cannot
be reached, or that stays silent past `wait_s`, is gone, and its microbatches are orphans
(counted when every stage holds them, else dropped with a cause). Repairs of a feeder's
microbatches go back to it (REPLAY); once applied, every feeder's poll is answered COMMITTED,
and the outcome is kept (HISTORY steps) for a report that comes late.

Dying anywhere loses no exactness: a feeder that dies before reporting leaves orphans; a
committer that dies before the apply leaves the replicas' buffers as they were (the next
committer's claim replaces it, its prepare starts the rounds afresh, its exchange attempts are
numbered past the dead one's); one that dies mid-apply leaves every replica still at s holding
its group's total, and the next committer applies it there with the same gradient scale
(`committer.StepCommit` step 1). A step counts each microbatch once in every stage, or drops
it with its cause, whoever commits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from swarmtrain.errors import BadFrameError, Cause, PeerUnreachableError, RemoteError
from swarmtrain.schedule.accounting import Repair
from swarmtrain.train.authority import trainer_of
from swarmtrain.train.committer import Deferred, StepCommit, StepFailedError
from swarmtrain.train.shards import Shard
from swarmtrain.train.step import TrainerStep
from swarmtrain.train.step_account import NOT_COUNTED, Committed, Share
from swarmtrain.train.step_result import StepResult
from swarmtrain.train.team_outcomes import (
    committed_of,
    outcome_of,
    repairs_of,
    replay_outcome,
    report_of,
    share_of,
)
from swarmtrain.train.trainer_context import TrainerContext
from swarmtrain.wire.frames import Frame, error_frame
from swarmtrain.wire.messages import PongMeta, Status, StepStatus
from swarmtrain.wire.team_messages import OutcomeKind, StepOutcome, StepReport

logger = logging.getLogger(__name__)

POLL_S = 5.0
"""Longest a report waits at the committer before it is answered PENDING (and sent again)."""
CALL_MARGIN_S = 10.0
"""A report's call may take this much longer than POLL_S before the committer counts as gone."""
PING_TIMEOUT_S = 5.0
PING_EVERY_S = 1.0
"""How often the committer pings a trainer whose report it awaits."""
HISTORY = 64
"""Committed steps whose outcome a committer keeps for late reports."""


@dataclass
class _Desk:
    """A step's reports at this trainer, and what it answers them."""

    shares: dict[str, Share] = field(default_factory=dict)
    shards: dict[str, Shard] = field(default_factory=dict)
    replays: dict[str, list[Repair]] = field(default_factory=dict)
    """Repairs a feeder has yet to be told of..."""
    replaying: set[str] = field(default_factory=set)
    """...and feeders told to replay, whose reports are stale until they report again."""
    since: dict[str, float] = field(default_factory=dict)
    """When this trainer began waiting for each feeder."""
    committed: Committed | None = None
    elsewhere: str | None = None
    """This trainer does not commit the step: who does ('' if it does not know)."""
    refused: set[str] = field(default_factory=set)
    """Trainers whose report was refused (their shard overlaps another's): none of their
    microbatches of the step counts."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    version: int = 0
    """Reports taken so far: a commit decides on a prepare that began after the last of them."""


class Team:
    """One trainer's side of the team (see the module docstring)."""

    def __init__(
        self,
        ctx: TrainerContext,
        *,
        shard: Shard,
        total: int,
        members: Callable[[], Awaitable[list[str]]],
        authorized: Callable[[str], bool],
        wait_s: float,
    ):
        """`members()`: the other trainers that announce themselves in the run now;
        `authorized(peer)`: whether the run authorizes it as a trainer; `total`: the run's
        microbatches per step; `wait_s`: longest wait for the report of a trainer that feeds."""
        self.ctx = ctx
        self.me = ctx.trainer_id
        self.shard = shard
        self.total = total
        self.members = members
        self.authorized = authorized
        self.wait_s = wait_s
        self.step = -1
        """The step this trainer feeds (what its pong says)."""
        self.feeding = False
        self._gone: dict[str, float] = {}
        self._hints: set[str] = set()
        self._desks: dict[int, _Desk] = {}
        self._pings: dict[str, tuple[float, int, bool]] = {}
        """trainer -> (when pinged, the step asked about, whether its pong said it feeds it)."""

    def _desk(self, step: int) -> _Desk:
        if step not in self._desks:
            self._desks[step] = _Desk()
            for old in [s for s in self._desks if s < step - HISTORY]:
                del self._desks[old]
        return self._desks[step]

    def gone(self) -> frozenset[str]:
        return frozenset(self._gone)

    def _mark_gone(self, trainer: str, why: str) -> None:
        if trainer not in self._gone:
            logger.warning("trainer %s is gone (%s)", trainer[-8:], why)
        self._gone[trainer] = time.monotonic()
        self._hints.discard(trainer)

    # serving the other trainers

    async def handle(self, frame: Frame, caller: str) -> Frame:
        """What this trainer serves other trainers: 'ping' and 'report'."""
        ctx = self.ctx
        if frame.run_id != ctx.run_id or not self.authorized(caller):
            ctx.transport.strike(caller, "not a trainer of this run")
            return error_frame(
                ctx.run_id, "this trainer serves only the trainers of its run", cause=Cause.UNAUTHORIZED
            )
        self._gone.pop(caller, None)  # it calls: it is alive
        if frame.kind == "ping":
            pong = PongMeta(state="serving" if self.feeding else "draining")
            return Frame(kind="pong", run_id=ctx.run_id, step=self.step, meta=pong.to_meta())
        if frame.kind != "report":
            return error_frame(
                ctx.run_id, f"trainers do not take {frame.kind!r} frames", cause=Cause.BAD_FRAME
            )
        try:
            return await self._on_report(frame, caller)
        except BadFrameError as e:
            ctx.transport.strike(caller, str(e))
            return error_frame(ctx.run_id, f"bad step report: {e}", cause=Cause.BAD_FRAME)
        except RemoteError as e:
            return error_frame(ctx.run_id, str(e), cause=e.cause)

    async def _on_report(self, frame: Frame, caller: str) -> Frame:
        report = StepReport.from_meta(frame.meta)
        if any(trainer_of(mb) != caller for mb in report.issued):
            raise BadFrameError("a report names microbatches of another trainer")
        if not set(report.completed) | set(report.dropped) <= set(report.issued):
            raise BadFrameError("a report completes or drops microbatches it did not issue")
        step, shard = frame.step, Shard(report.shard, report.shards)
        desk = self._desk(step)
        for other, theirs in ((self.me, self.shard), *desk.shards.items()):
            if other != caller and theirs.overlaps(shard, self.total):
                desk.refused.add(caller)
                raise RemoteError(
                    f"trainer {caller[-8:]} feeds shard {shard}, which overlaps shard {theirs} of trainer "
                    f"{other[-8:]}: give every trainer of the run its own --shard",
                    cause=Cause.REFUSED,
                )
        async with desk.changed:
            desk.shares[caller] = share_of(caller, report)
            desk.shards[caller] = shard
            desk.replaying.discard(caller)
            desk.since.pop(caller, None)
            desk.version += 1
            desk.changed.notify_all()
            if self._outcome(desk, caller, step=step, peek=True).kind == OutcomeKind.PENDING:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        desk.changed.wait_for(
                            lambda: (
                                self._outcome(desk, caller, step=step, peek=True).kind != OutcomeKind.PENDING
                            )
                        ),
                        POLL_S,
                    )
            outcome = self._outcome(desk, caller, step=step)
        return Frame(kind="outcome", run_id=self.ctx.run_id, step=step, meta=outcome.to_meta())

    def _outcome(self, desk: _Desk, caller: str, *, step: int = -1, peek: bool = False) -> StepOutcome:
        """The answer to `caller`'s report of `step` now (`peek`: change nothing, kind only)."""
        if desk.committed is not None:
            return (
                StepOutcome(kind=OutcomeKind.COMMITTED)
                if peek
                else outcome_of(desk.committed, self.ctx.num_stages)
            )
        if caller in desk.replays:
            if peek:
                return StepOutcome(kind=OutcomeKind.REPLAY)
            desk.replaying.add(caller)
            return replay_outcome(desk.replays.pop(caller))
        if desk.elsewhere is not None:
            return StepOutcome(kind=OutcomeKind.ELSEWHERE, committer=desk.elsewhere)
        if not self.feeding or self.step > step >= 0:  # not in this step: it will not commit it
            return StepOutcome(kind=OutcomeKind.ELSEWHERE)
        return StepOutcome(kind=OutcomeKind.PENDING)

    async def _set(self, step: int, **changes) -> None:
        desk = self._desk(step)
        async with desk.changed:
            for name, value in changes.items():
                setattr(desk, name, value)
            desk.changed.notify_all()

    # the committer's side (`committer.Team`)

    async def shares(self, step: int, seen: set[str]) -> dict[str, Share] | None:
        desk = self._desk(step)
        expected = set(seen) | set(desk.shares) | set(desk.replays) | desk.replaying
        for member in await self.members():
            if member not in self._gone and member != self.me and await self._feeds(member, step):
                expected.add(member)
        waiting = [
            t
            for t in expected - {self.me} - set(self._gone) - desk.refused
            if t not in desk.shares or t in desk.replays or t in desk.replaying
        ]
        now = time.monotonic()
        for t in waiting:
            if now - desk.since.setdefault(t, now) > self.wait_s:
                self._mark_gone(t, f"no report of step {step} in {self.wait_s:.0f} s")
            elif not await self._alive(t):
                self._mark_gone(t, "it does not answer")
        if any(t not in self._gone for t in waiting):
            return None
        return dict(desk.shares)

    def version(self, step: int) -> int:
        return self._desk(step).version

    def excluded(self, step: int) -> frozenset[str]:
        return frozenset(self._desk(step).refused)

    async def replay(self, step: int, trainer: str, repairs: list[Repair]) -> None:
        await self._set(step, replays=self._desk(step).replays | {trainer: repairs})

    async def _ping(self, trainer: str) -> Frame | None:
        request = Frame(kind="ping", run_id=self.ctx.run_id)
        try:
            return await self.ctx.transport.call(trainer, self.ctx.handler, request, timeout_s=PING_TIMEOUT_S)
        except (RemoteError, PeerUnreachableError, BadFrameError):
            return None

    async def _feeds(self, trainer: str, step: int) -> bool:
        """Whether `trainer` says it feeds `step` (or is just done with the one before); pinged
        at most every PING_EVERY_S."""
        at, asked, feeds = self._pings.get(trainer, (-math.inf, -1, False))
        if time.monotonic() - at < PING_EVERY_S and asked == step:
            return feeds
        pong = await self._ping(trainer)
        if pong is None:
            self._mark_gone(trainer, "it does not answer")
            feeds = False
        else:
            feeds = PongMeta.from_meta(pong.meta).state == "serving" and pong.step in (step - 1, step)
        self._pings[trainer] = (time.monotonic(), step, feeds)
        return feeds

    async def _alive(self, trainer: str) -> bool:
        at, _, _ = self._pings.get(trainer, (-math.inf, -1, False))
        if time.monotonic() - at < PING_EVERY_S:
            return True
        alive = await self._ping(trainer) is not None
        self._pings[trainer] = (time.monotonic(), -1, False)
        return alive

    # this trainer's step

    async def elect(self) -> str:
        """The committer of the step as this trainer sees it: the lowest live trainer."""
        members = set(await self.members())
        return min(({self.me} | members | self._hints) - set(self._gone))

    async def run_step(self, own: TrainerStep) -> StepResult:
        """Feed this trainer's share of `own.step`, then commit it or report it (see the module
        docstring); StepFailedError when the step cannot complete."""
        step = own.step
        self.step, self.feeding = step, True
        try:
            await own.flow()
        except StepFailedError as e:
            counted = await self._applied(step)
            if counted is None:
                raise
            logger.warning("step %d was committed without this trainer's whole share (%s)", step, e)
            return own.result(_without(own, counted))
        force = False
        while True:
            committer = self.me if force else await self.elect()
            force = False
            if committer == self.me:
                await self._set(step, elsewhere=None)
                try:
                    committed = await StepCommit(own.ctx, step, own, self, self.total).run()
                except Deferred as e:
                    logger.info("step %d: %s; reporting to it", step, e)
                    if e.holder:
                        self._hints.add(e.holder)
                    await self._set(step, elsewhere=e.holder)
                    if not e.holder:
                        await asyncio.sleep(POLL_S / 10)
                    continue
                await self._set(step, committed=committed)
                return own.result(committed)
            await self._set(step, elsewhere=committer)
            outcome = await self._report(committer, own)
            if outcome is None:
                continue
            if outcome.kind == OutcomeKind.COMMITTED:
                for peer in outcome.applied_by:
                    self.ctx.known_step[peer] = step + 1
                return own.result(committed_of(step, outcome))
            if outcome.kind == OutcomeKind.REPLAY:
                for repair in repairs_of(outcome):
                    await own.replay(repair)
            elif outcome.kind == OutcomeKind.ELSEWHERE:
                self._hints.discard(committer)
                if outcome.committer in ("", self.me):
                    force = True  # the callee leaves the step to this trainer, or knows no one
                else:
                    self._hints.add(outcome.committer)

    async def _report(self, committer: str, own: TrainerStep) -> StepOutcome | None:
        """One report of `own`'s share to `committer`; its outcome, None if it is gone."""
        report = report_of(own.share(), self.shard)
        frame = Frame(kind="report", run_id=self.ctx.run_id, step=own.step, meta=report.to_meta())
        try:
            reply = await self.ctx.transport.call(
                committer, self.ctx.handler, frame, timeout_s=POLL_S + CALL_MARGIN_S
            )
            return StepOutcome.from_meta(reply.meta)
        except PeerUnreachableError as e:
            if e.timed_out and await self._ping(committer) is not None:
                return None  # slow, not gone: report again
            self._mark_gone(committer, str(e))
            return None
        except RemoteError as e:
            raise StepFailedError(
                f"step {own.step}: trainer {committer[-8:]} refused this trainer's report: {e}"
            ) from None
        except BadFrameError as e:
            self._mark_gone(committer, f"it answered a bad outcome: {e}")
            return None

    async def _applied(self, step: int) -> frozenset[str] | None:
        """What `step` counted, if every replica that answers is past it (the run went on
        without this trainer's share); None if some replica is not."""
        replicas = await self.ctx.all_replicas()
        status = Frame(kind="step", run_id=self.ctx.run_id, step=step, meta=Status().to_meta())
        steps, counted = [], frozenset()
        for k, peers in replicas.items():
            for peer in peers:
                try:
                    reply = await self.ctx.transport.call(
                        peer, self.ctx.handler, replace(status, stage=k), timeout_s=PING_TIMEOUT_S
                    )
                    found = StepStatus.from_meta(reply.meta)
                except (RemoteError, PeerUnreachableError, BadFrameError):
                    continue
                steps.append(reply.step)
                if found.applied_step == step:
                    counted = frozenset(found.counted)
        return counted if steps and min(steps) > step else None


def _without(own: TrainerStep, counted: frozenset[str]) -> Committed:
    """What a trainer knows of its step the run committed without waiting for its share."""
    missed = sum(mb not in counted for mb in own.ids)
    mine = counted & set(own.ids)
    return Committed(step=own.step, counted=mine, dropped_causes={NOT_COUNTED: missed} if missed else {})
