"""A step's commit, driven by one trainer over the microbatches of every trainer that fed it.

`StepCommit(ctx, step, own, team, total).run()` (the replicas' side is `commit.CommitParticipant`):

1. Claim every replica of every stage, at whatever step it is (`claims`): a replica another
   trainer holds answers with that trainer, and this one leaves the step to it (`Deferred`).
   The claims name the trainers found gone, whose claims pass to this one. If some replica
   applied the step already, its committer died mid-apply: apply the same gradient scale on
   every replica still at the step (each kept its group's total) and the step is done.
2. In rounds until it goes through: prepare every live replica of every stage, then wait until
   every trainer that feeds the step reported its share, or left (`Team.shares`). A trainer
   that left is an orphan's: its microbatches count when every stage holds them
   (`accounting.orphans`), and while some stage still lacks one the commit waits for it to
   settle (it may be on its way), at most a microbatch's timeout. Then act on
   `schedule.decide_commit` over every trainer's completed microbatches: wait for a stage with
   no live replica; discard a stage whose buffers cannot be made exact; replay what no live
   replica holds, each microbatch by its own trainer (stage 0 takes a microbatch only from the
   trainer its id names: `Team.replay` asks a feeder); or exchange gradients within each stage
   and, once every stage has exchanged, apply everywhere. Nothing is applied before every stage
   can apply, so a death anywhere before that costs a replay, not data. Exchange attempts are
   numbered past any an earlier committer used, so no stale gradients mix in.
3. The apply's one `grad_scale` carries total / counted (the step's mean over the microbatches
   it counted) times the clip coefficient of the whole model's gradient norm.

Every position of the step ends counted or dropped with a cause (`Committed.dropped_causes`):
dropped by its trainer, its trainer left before it counted, or no live trainer fed it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

from swarmtrain.errors import BadFrameError, Cause, PeerUnreachableError, RemoteError, SwarmError
from swarmtrain.schedule import CommitAction, ReplicaReport, decide_commit
from swarmtrain.schedule.accounting import Repair, orphans
from swarmtrain.train.authority import trainer_of
from swarmtrain.train.optim import clip_coefficient
from swarmtrain.train.step_account import Committed, Share, account
from swarmtrain.train.trainer_context import TrainerContext
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import (
    Abort,
    Applied,
    Apply,
    Claim,
    CommitRequest,
    Exchange,
    Exchanged,
    Prepare,
    Prepared,
    Status,
    StepStatus,
)

logger = logging.getLogger(__name__)

COMMIT_CALL_TIMEOUT_S = 60.0
"""Longest wait for one replica's answer to a commit phase (the exchange moves gradients)."""
SETTLE_POLL_S = 0.5
"""How often the commit looks again while a trainer's report or an orphan is awaited."""


class StepFailedError(SwarmError):
    """A step could not complete; the message says which microbatch or stage and why."""


class Deferred(SwarmError):
    """Another trainer holds the commit of the step: this one leaves it to `holder`."""

    def __init__(self, step: int, holder: str):
        super().__init__(f"trainer {holder[-8:]} commits step {step}")
        self.holder = holder


class OwnShare(Protocol):
    """The committing trainer's own part (`step.TrainerStep`)."""

    def share(self) -> Share: ...

    async def replay(self, repair: Repair) -> None:
        """Send the microbatch again as the repair asks (it must complete or be dropped)."""


class Team(Protocol):
    """The other trainers of a step, as its committer sees them (`team.Team`; `SOLO`: none)."""

    def gone(self) -> frozenset[str]:
        """Trainers found gone (their claims pass to this one, their microbatches are orphans)."""

    def excluded(self, step: int) -> frozenset[str]:
        """Trainers whose microbatches of `step` never count (their report was refused)."""

    async def shares(self, step: int, seen: set[str]) -> dict[str, Share] | None:
        """The shares the other trainers reported; None while one that feeds the step (or whose
        microbatches are in `seen`) has not reported yet and is not gone: prepare again."""

    def version(self, step: int) -> int:
        """Counts the reports taken for `step`: one taken during a prepare makes it stale."""

    async def replay(self, step: int, trainer: str, repairs: list[Repair]) -> None:
        """Ask `trainer` to replay its `repairs` (its share is awaited again)."""


class _Solo:
    def gone(self) -> frozenset[str]:
        return frozenset()

    def excluded(self, step: int) -> frozenset[str]:
        return frozenset()

    async def shares(self, step: int, seen: set[str]) -> dict[str, Share]:
        return {}

    def version(self, step: int) -> int:
        return 0

    async def replay(self, step: int, trainer: str, repairs: list[Repair]) -> None:
        raise StepFailedError(
            f"step {step}: microbatches of trainer {trainer[-8:]} need a replay, and it is gone"
        )


SOLO: Team = _Solo()
"""A step one trainer feeds alone."""


class StepCommit:
    """One step's commit (see the module docstring); `await run()` returns what it counted."""

    def __init__(self, ctx: TrainerContext, step: int, own: OwnShare, team: Team, total: int):
        self.ctx = ctx
        self.step = step
        self.own = own
        self.team = team
        self.total = total
        """The step's microbatches (the run's microbatches per step)."""
        self.grad_norm: float | None = None
        self.digests: dict[int, dict[str, str]] = {}
        self._attempts = 0
        """Exchange attempts start here (past any an earlier committer of the step used)."""
        self._routed: dict[int, set[str]] = {}
        """Per stage, replicas completed microbatches went through: prepared even before the
        trainer's view of the swarm lists them."""

    async def _call(self, peer: str, stage: int, request: CommitRequest) -> Frame:
        frame = Frame(
            kind="step", run_id=self.ctx.run_id, stage=stage, step=self.step, meta=request.to_meta()
        )
        return await self.ctx.transport.call(peer, self.ctx.handler, frame, timeout_s=COMMIT_CALL_TIMEOUT_S)

    def _deferred(self, e: RemoteError) -> bool:
        return e.cause == Cause.CLAIMED

    # 1. claims

    async def _claim(self) -> Committed | None:
        """Claim every replica; the step as applied if an earlier committer applied it somewhere."""
        replicas = await self.ctx.all_replicas()
        claim = Claim(replaces=tuple(sorted(self.team.gone())))
        found: list[tuple[int, str, int, StepStatus]] = []

        async def ask(k: int, peer: str) -> None:
            try:
                reply = await self._call(peer, k, claim)
                found.append((k, peer, reply.step, StepStatus.from_meta(reply.meta)))
            except (RemoteError, PeerUnreachableError, BadFrameError) as e:
                logger.info("stage %d replica %s did not answer the claim: %s", k, peer[-8:], e)

        await asyncio.gather(*(ask(k, p) for k, peers in replicas.items() for p in peers))
        for _, _, at, status in found:
            if at == self.step and status.committer not in ("", self.ctx.trainer_id):
                raise Deferred(self.step, status.committer)
        self._attempts = max((s.next_attempt for _, _, at, s in found if at == self.step), default=0)
        applied = [s for _, _, at, s in found if at == self.step + 1 and s.applied_step == self.step]
        if not applied:
            return None
        done = applied[0]
        laggards = {}
        for k, peer, at, _ in found:
            if at == self.step:
                laggards.setdefault(k, []).append(peer)
        logger.warning(
            "step %d was applied on some replicas only (its committer left mid-apply): applying it on %d more",
            self.step,
            sum(map(len, laggards.values())),
        )
        await self._apply_all(laggards, Apply(grad_scale=done.applied_scale, digest=self.ctx.verify_replicas))
        applied_by = sorted(p for _, p, at, s in found if at == self.step + 1 and s.applied_step == self.step)
        return self._account(frozenset(done.counted), applied_by)

    # 2. rounds

    async def _prepare(self) -> dict[int, list[ReplicaReport]]:
        """Every reachable replica of every stage at this step, with what it holds."""
        ctx = self.ctx
        replicas = await ctx.replicas(refresh=True)
        now = time.monotonic()
        for k, peers in self.own.share().work.items():
            self._routed.setdefault(k, set()).update(peers)
        groups = {  # a replica that just failed us is left out: it is most likely dead
            k: {
                p
                for p in set(replicas.get(k, [])) | self._routed.get(k, set())
                if not ctx.router.bans.is_banned(p, now)
            }
            for k in range(ctx.num_stages)
        }
        reports: dict[int, list[ReplicaReport]] = {k: [] for k in range(ctx.num_stages)}
        deferred: list[Deferred] = []

        async def ask(k: int, peer: str) -> None:
            try:
                reply = await self._call(peer, k, Prepare())
                prepared = Prepared.from_meta(reply.meta)
            except RemoteError as e:
                if self._deferred(e):
                    deferred.append(await self._holder(peer, k))
                    return
                ctx.router.done(peer, time.monotonic(), ok=False)
                logger.info("stage %d replica %s left the commit: %s", k, peer[-8:], e)
                return
            except (PeerUnreachableError, BadFrameError) as e:
                ctx.router.done(peer, time.monotonic(), ok=False)
                logger.info("stage %d replica %s left the commit: %s", k, peer[-8:], e)
                return
            if reply.step == self.step:
                reports[k].append(
                    ReplicaReport(peer=peer, fresh=frozenset(prepared.fresh), held=frozenset(prepared.held))
                )

        await asyncio.gather(*(ask(k, p) for k, peers in groups.items() for p in peers))
        if deferred:
            raise deferred[0]
        return reports

    async def _holder(self, peer: str, stage: int) -> Deferred:
        """The Deferred of a replica that refused us as claimed by another trainer."""
        try:
            status = StepStatus.from_meta((await self._call(peer, stage, Status())).meta)
            return Deferred(self.step, status.committer)
        except (RemoteError, PeerUnreachableError, BadFrameError):
            return Deferred(self.step, "")

    async def run(self) -> Committed:
        """Commit the step; Deferred when another trainer holds it, StepFailedError when it
        cannot be committed."""
        finished = await self._claim()
        if finished is not None:
            return finished
        ctx, rounds, settle_until = self.ctx, 0, None
        while rounds < ctx.max_retries + 3:
            version = self.team.version(self.step)
            reports = await self._prepare()
            seen = {trainer_of(mb) for rs in reports.values() for r in rs for mb in r.fresh | r.held}
            others = await self.team.shares(self.step, {t for t in seen if t and t != ctx.trainer_id})
            if others is None:
                await asyncio.sleep(SETTLE_POLL_S)
                continue
            if self.team.version(self.step) != version:
                continue  # a report came during the prepare: its microbatches may be missing from it
            shares = {ctx.trainer_id: self.own.share(), **others}
            for share in others.values():
                for k, peers in share.work.items():
                    self._routed.setdefault(k, set()).update(peers)
            gone, excluded = self.team.gone(), self.team.excluded(self.step)
            live = {t: s for t, s in shares.items() if t not in gone and t not in excluded}
            complete, partial = orphans(reports, _not_of(frozenset(live)))
            refused = frozenset(mb for mb in complete | partial if trainer_of(mb) in excluded)
            complete, partial = complete - refused, partial - refused
            if partial and settle_until is None:
                settle_until = time.monotonic() + ctx.microbatch_timeout_s
            if partial and time.monotonic() < settle_until:
                await asyncio.sleep(SETTLE_POLL_S)  # a gone trainer's microbatches may be on their way
                continue
            completed = {mb for s in live.values() for mb in s.losses} | complete
            if not completed:
                dropped = {mb: why for s in live.values() for mb, why in s.dropped.items()}
                raise StepFailedError(f"step {self.step}: every microbatch was dropped: {dropped}")
            issued = tuple(mb for s in live.values() for mb in s.issued) + tuple(
                sorted(complete | partial | refused)
            )
            decision = decide_commit(issued, completed, reports)
            if decision.action != CommitAction.EXCHANGE:
                rounds += 1
                await self._act(decision, reports, live)
                await asyncio.sleep(min(0.25 * 2**rounds, 2.0))
                continue
            sq_norms = await self._exchange(decision.plans, reports, self._attempts + rounds)
            if sq_norms is None:
                rounds += 1
                continue
            counted = frozenset(completed)
            committed_by = {k: [r.peer for r in rs] for k, rs in reports.items()}
            await self._apply(committed_by, sq_norms, len(counted))
            applied_by = sorted(p for peers in committed_by.values() for p in peers)
            return self._account(
                counted, applied_by, shares=shares.values(), adopted=complete, stranded=partial
            )
        raise StepFailedError(f"step {self.step} could not be committed after {rounds} rounds")

    async def _act(self, decision, reports: dict[int, list[ReplicaReport]], live: dict[str, Share]) -> None:
        """Carry out a round's WAIT, ABORT or REPAIR decision."""
        if decision.action == CommitAction.WAIT:
            logger.warning(
                "stage(s) %s have no live replica at step %d: waiting", list(decision.stages), self.step
            )
            await self.ctx.replicas(refresh=True, wait_for_all=True)
        elif decision.action == CommitAction.ABORT:
            logger.warning(
                "stage(s) %s hold inexact gradients: discarding and replaying", list(decision.stages)
            )
            await asyncio.gather(
                *(self._call(r.peer, k, Abort()) for k in decision.stages for r in reports[k]),
                return_exceptions=True,
            )
        else:
            logger.warning(
                "commit of step %d: %d microbatch(es) lost with a replica; replaying them",
                self.step,
                len(decision.repairs),
            )
            by_trainer: dict[str, list[Repair]] = {}
            for repair in decision.repairs:
                by_trainer.setdefault(trainer_of(repair.mb), []).append(repair)
            for trainer, repairs in by_trainer.items():
                if trainer == self.ctx.trainer_id:
                    for repair in repairs:
                        await self.own.replay(repair)
                elif trainer in live:
                    await self.team.replay(self.step, trainer, repairs)

    async def _exchange(
        self, plans, reports: dict[int, list[ReplicaReport]], attempt: int
    ) -> dict[int, list[float | None]] | None:
        """Every replica's exchange; per stage, the squared norms of its group's total (None: a
        round to plan again). StepFailedError when a stage refuses to commit."""
        calls, stages = [], []
        for k, rs in reports.items():
            group = tuple(sorted(q.peer for q in rs))
            for r in rs:
                request = Exchange(
                    fresh=plans[k].fresh[r.peer], take=plans[k].take[r.peer], group=group, attempt=attempt
                )
                calls.append(self._call(r.peer, k, request))
                stages.append(k)
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            deferred = next((e for e in errors if isinstance(e, RemoteError) and self._deferred(e)), None)
            if deferred is not None:
                raise Deferred(self.step, "")
            refused = next((e for e in errors if isinstance(e, RemoteError) and not e.retryable), None)
            if refused is not None:
                raise StepFailedError(f"step {self.step}: a stage refused to commit: {refused}")
            logger.warning("commit of step %d: exchange failed (%s); planning again", self.step, errors[0])
            return None
        sq_norms: dict[int, list[float | None]] = {}
        for k, reply in zip(stages, results):
            sq_norms.setdefault(k, []).append(Exchanged.from_meta(reply.meta).grad_sq_norm)
        return sq_norms

    async def _apply(
        self, committed_by: dict[int, list[str]], sq_norms: dict[int, list[float | None]], counted: int
    ) -> None:
        """Every stage has exchanged: step every replica (a dead one is simply gone).

        `sq_norms`: per stage, its replicas' squared norms of the group total (equal: the
        replicas hold the same total; the largest counts)."""
        scale = self.total / counted
        per_stage = [None if None in sq else max(sq) for sq in sq_norms.values()]
        if None not in per_stage:
            self.grad_norm = scale * math.sqrt(sum(per_stage))
        elif self.ctx.optimizer.max_grad_norm > 0:
            raise StepFailedError(
                f"step {self.step}: a stage did not report its gradient norm, which clipping needs "
                "(is every stage peer of this swarmtrain version?)"
            )
        clip = clip_coefficient(self.grad_norm or 0.0, self.ctx.optimizer.max_grad_norm)
        await self._apply_all(
            committed_by, Apply(grad_scale=float(scale * clip), digest=self.ctx.verify_replicas)
        )

    async def _apply_all(self, replicas: dict[int, list[str]], request: Apply) -> None:
        ctx = self.ctx
        self.digests = {k: {} for k in replicas}

        async def apply(k: int, peer: str) -> None:
            for attempt in range(3):
                try:
                    reply = await self._call(peer, k, request)
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

        await asyncio.gather(*(apply(k, p) for k, peers in replicas.items() for p in peers))

    def _replicas_equal(self) -> tuple[bool | None, dict[int, int]]:
        """The verdict on the digests (see StepResult.replicas_equal) and how many were compared."""
        if not self.ctx.verify_replicas:
            return None, {}
        compared = {k: len(d) for k, d in self.digests.items()}
        groups = [set(d.values()) for d in self.digests.values() if len(d) >= 2]
        if not groups:
            return None, compared
        return all(len(g) == 1 for g in groups), compared

    def _account(self, counted: frozenset[str], applied_by: list[str], **kw) -> Committed:
        equal, compared = self._replicas_equal()
        return account(
            step=self.step,
            total=self.total,
            counted=counted,
            shares=kw.pop("shares", None) or [self.own.share()],
            gone=self.team.gone(),
            grad_norm=self.grad_norm,
            replicas_equal=equal,
            compared=compared,
            applied_by=tuple(applied_by),
            **kw,
        )


def _not_of(trainers: frozenset[str]):
    """Whether a microbatch is of none of `trainers` (an orphan, when they are the live ones)."""
    return lambda mb: trainer_of(mb) not in trainers
