"""What trainers of one run tell each other about a step, from and to the protocol's own
records: a share as a `StepReport`, a committed step as a COMMITTED `StepOutcome`, the repairs
of a REPLAY outcome (`swarmtrain.train.team`)."""

from __future__ import annotations

import math

from swarmtrain.schedule.accounting import Repair
from swarmtrain.train.shards import Shard
from swarmtrain.train.step_account import Committed, Share
from swarmtrain.wire.messages import NO_PREFERENCE
from swarmtrain.wire.team_messages import OutcomeKind, StepOutcome, StepReport, work_lists, work_of


def report_of(share: Share, shard: Shard) -> StepReport:
    """A feeder's share of a step as it reports it."""
    stages, peers, counts = work_lists(share.work)
    return StepReport(
        shard=shard.index,
        shards=shard.count,
        issued=share.issued,
        completed=tuple(share.losses),
        losses=tuple(share.losses.values()),
        dropped=tuple(share.dropped),
        causes=tuple(share.dropped.values()),
        samples=share.samples,
        tokens=share.tokens,
        replays=share.replays,
        work_stages=stages,
        work_peers=peers,
        work_counts=counts,
    )


def share_of(trainer: str, report: StepReport) -> Share:
    """The share a feeder's report tells of."""
    return Share(
        trainer=trainer,
        issued=report.issued,
        losses=dict(zip(report.completed, report.losses)),
        dropped=dict(zip(report.dropped, report.causes)),
        samples=report.samples,
        tokens=report.tokens,
        replays=report.replays,
        work=work_of(report.work_stages, report.work_peers, report.work_counts),
    )


def replay_outcome(repairs: list[Repair]) -> StepOutcome:
    """A REPLAY outcome asking for `repairs`."""
    return StepOutcome(
        kind=OutcomeKind.REPLAY,
        replay=tuple(r.mb for r in repairs),
        prefer=tuple(p or NO_PREFERENCE for r in repairs for p in r.prefer),
        needed_by=tuple(sum(1 << k for k in r.needed_by) for r in repairs),
    )


def outcome_of(committed: Committed, num_stages: int) -> StepOutcome:
    """A committed step as a feeder learns it."""
    stages, peers, counts = work_lists(committed.work)
    return StepOutcome(
        kind=OutcomeKind.COMMITTED,
        counted=tuple(sorted(committed.counted)),
        loss=None if math.isnan(committed.loss) else committed.loss,
        completed=len(committed.counted),
        adopted=committed.adopted,
        causes=tuple(committed.dropped_causes),
        cause_counts=tuple(committed.dropped_causes.values()),
        samples=committed.samples,
        tokens=committed.tokens,
        grad_norm=committed.grad_norm,
        replicas_equal=committed.replicas_equal,
        compared=tuple(committed.compared.get(k, 0) for k in range(num_stages)),
        applied_by=committed.applied_by,
        work_stages=stages,
        work_peers=peers,
        work_counts=counts,
    )


def committed_of(step: int, outcome: StepOutcome) -> Committed:
    """The Committed a COMMITTED outcome tells of."""
    return Committed(
        step=step,
        counted=frozenset(outcome.counted),
        adopted=outcome.adopted,
        loss=math.nan if outcome.loss is None else outcome.loss,
        dropped_causes=dict(zip(outcome.causes, outcome.cause_counts)),
        samples=outcome.samples,
        tokens=outcome.tokens,
        work=work_of(outcome.work_stages, outcome.work_peers, outcome.work_counts),
        grad_norm=outcome.grad_norm,
        replicas_equal=outcome.replicas_equal,
        compared={k: n for k, n in enumerate(outcome.compared) if n},
        applied_by=outcome.applied_by,
    )


def repairs_of(outcome: StepOutcome) -> list[Repair]:
    """The repairs a REPLAY outcome asks for."""
    stages = len(outcome.prefer) // len(outcome.replay) if outcome.replay else 0
    return [
        Repair(
            mb=mb,
            prefer=tuple(p or None for p in outcome.prefer[i * stages : (i + 1) * stages]),
            needed_by=tuple(k for k in range(stages) if bits >> k & 1),
        )
        for i, (mb, bits) in enumerate(zip(outcome.replay, outcome.needed_by))
    ]
