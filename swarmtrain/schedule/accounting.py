"""Every microbatch accounted for, and each stage's gradient counted exactly once (pure).

`StepLedger` follows one step's microbatches: each ends `completed` (its loss came back) or
`dropped` with a cause; replays are counted by cause on the way. A step may commit only
when nothing is unaccounted for.

Replicas of a stage add a microbatch's parameter gradient to their buffer on its first
("fresh") pass only. A replayed microbatch (sent again after a failure, possibly to another
replica) may already be in some replica's buffer, so a replica keeps a replay's gradient
apart ("held"). At the step boundary every replica reports both sets and
`plan_stage_commit` decides, per stage: each completed microbatch counts once, from the
buffer that has it, else from one held copy; held copies nobody needs are discarded; a
microbatch no live replica has is `missing` and must be replayed before the step; a stage
whose buffers cannot be made exact (a microbatch in two buffers, or a buffer holding one
that did not complete) must discard the step's gradients and replay it whole.
`decide_commit` turns every stage's plan into the round's one decision: wait, abort, repair
or exchange.

Several trainers feed a step, and one commits it. A microbatch of a trainer that left before
it reported is an orphan (`orphans`): when every stage holds its gradient (fresh or held in
some live replica) it went through the whole pipeline and counts, with no loss known;
otherwise it is still on its way or stranded, and once it settles or the wait runs out it is
left uncompleted, so a stage that holds it must discard (abort) and its other microbatches
be replayed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True, kw_only=True)
class ReplicaReport:
    """One replica's answer to 'prepare': where its gradients of the step come from."""

    peer: str
    fresh: frozenset[str]
    """Microbatches whose gradients are in its buffer."""
    held: frozenset[str]
    """Replayed microbatches whose gradients it keeps apart."""


@dataclass(frozen=True, kw_only=True)
class StageCommitPlan:
    take: dict[str, tuple[str, ...]]
    """Per replica: the held microbatches to fold into its buffer (the others are discarded)."""
    fresh: dict[str, tuple[str, ...]]
    """Per replica: its buffer's microbatches, as reported (it must still hold exactly these)."""
    missing: tuple[str, ...]
    """Completed microbatches no replica holds: replay them before committing."""
    conflicts: tuple[str, ...]
    """Microbatches that make the buffers inexact: the stage must discard the step's gradients."""

    @property
    def ready(self) -> bool:
        return not self.missing and not self.conflicts


def plan_stage_commit(completed: set[str], reports: list[ReplicaReport]) -> StageCommitPlan:
    """Decide where each of `completed` comes from in one stage; see the module docstring."""
    owner: dict[str, str] = {}
    conflicts = set()
    for r in sorted(reports, key=lambda r: r.peer):
        for mb in r.fresh:
            if mb in owner or mb not in completed:
                conflicts.add(mb)
            owner.setdefault(mb, r.peer)
    take: dict[str, list[str]] = {r.peer: [] for r in reports}
    for r in sorted(reports, key=lambda r: r.peer):
        for mb in sorted(r.held):
            if mb in completed and mb not in owner:
                owner[mb] = r.peer
                take[r.peer].append(mb)
    missing = sorted(completed - set(owner))
    return StageCommitPlan(
        take={p: tuple(v) for p, v in take.items()},
        fresh={r.peer: tuple(sorted(r.fresh)) for r in reports},
        missing=tuple(missing),
        conflicts=tuple(sorted(conflicts)),
    )


@dataclass(kw_only=True)
class StepLedger:
    """One step's microbatches: issued, completed (with loss and route), replayed, dropped."""

    issued: tuple[str, ...]
    losses: dict[str, float] = field(default_factory=dict)
    routes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The peers (one per stage) each completed microbatch went through last."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Dropped microbatch -> cause."""
    replays: Counter = field(default_factory=Counter)
    """Replays by cause (a microbatch may be replayed several times)."""

    def complete(self, mb: str, loss: float, route: tuple[str, ...]) -> None:
        self.losses[mb] = loss
        self.routes[mb] = route

    def replay(self, cause: str, count: int = 1) -> None:
        if count:
            self.replays[cause] += count

    def drop(self, mb: str, cause: str) -> None:
        self.dropped[mb] = cause

    @property
    def completed(self) -> set[str]:
        return set(self.losses)

    def unaccounted(self) -> list[str]:
        """Issued microbatches that neither completed nor were dropped (must be empty to commit)."""
        return [mb for mb in self.issued if mb not in self.losses and mb not in self.dropped]

    def routed_to(self, stage: int) -> set[str]:
        """Peers of `stage` that completed microbatches went through."""
        return {r[stage] for r in self.routes.values() if len(r) > stage}


class CommitAction(StrEnum):
    """What the trainer does next in a step's commit round (`decide_commit`)."""

    WAIT = "wait"
    """Some stage has no live replica: wait for one, then prepare again."""
    ABORT = "abort"
    """Some stage's buffers cannot be made exact: discard its gradients, replay, prepare again."""
    REPAIR = "repair"
    """Microbatches were lost with a dead replica: replay them, then prepare again."""
    EXCHANGE = "exchange"
    """Every stage counts every completed microbatch exactly once: exchange, then apply."""


@dataclass(frozen=True, kw_only=True)
class CommitDecision:
    action: CommitAction
    plans: dict[int, StageCommitPlan]
    """Per stage with live replicas: its plan (`plan_stage_commit`)."""
    stages: tuple[int, ...] = ()
    """WAIT: the stages with no live replica; ABORT: the stages to discard."""
    repairs: tuple[Repair, ...] = ()
    """REPAIR: each microbatch to replay, in issue order."""


@dataclass(frozen=True, kw_only=True)
class Repair:
    """One microbatch to replay at commit time."""

    mb: str
    prefer: tuple[str | None, ...]
    """Per stage: a live replica that holds the work already (None: any), so stages that still
    have it are steered to it and add nothing twice."""
    needed_by: tuple[int, ...]
    """The stages that lack it: they must recompute it."""


def decide_commit(
    issued: tuple[str, ...], completed: set[str], reports: dict[int, list[ReplicaReport]]
) -> CommitDecision:
    """One commit round's decision from every stage's replica reports (pure).

    `reports` maps each stage to the reports of its live replicas (an empty list: none
    answered). Stages with no live replica come first (wait), then inexact buffers (abort),
    then lost microbatches (repair); only then may the stages exchange.
    """
    empty = tuple(k for k, rs in sorted(reports.items()) if not rs)
    if empty:
        return CommitDecision(action=CommitAction.WAIT, plans={}, stages=empty)
    plans = {k: plan_stage_commit(completed, rs) for k, rs in reports.items()}
    conflicted = tuple(k for k, plan in sorted(plans.items()) if plan.conflicts)
    if conflicted:
        return CommitDecision(action=CommitAction.ABORT, plans=plans, stages=conflicted)
    lacking = {mb for plan in plans.values() for mb in plan.missing}
    if not lacking:
        return CommitDecision(action=CommitAction.EXCHANGE, plans=plans)
    stages = sorted(reports)
    repairs = []
    for mb in (m for m in issued if m in lacking):
        prefer = tuple(
            next(
                (r.peer for r in sorted(reports[k], key=lambda r: r.peer) if mb in r.fresh or mb in r.held),
                None,
            )
            for k in stages
        )
        needed_by = tuple(k for k in stages if mb in plans[k].missing)
        repairs.append(Repair(mb=mb, prefer=prefer, needed_by=needed_by))
    return CommitDecision(action=CommitAction.REPAIR, plans=plans, repairs=tuple(repairs))


def orphans(
    reports: dict[int, list[ReplicaReport]], is_orphan: Callable[[str], bool]
) -> tuple[frozenset[str], frozenset[str]]:
    """The orphans among the microbatches the replicas hold (`is_orphan(mb)`: its trainer left):
    (those every stage holds: they count; those only some stages hold)."""
    held = {k: set().union(*(r.fresh | r.held for r in rs)) for k, rs in reports.items()}
    found = {mb for mbs in held.values() for mb in mbs if is_orphan(mb)}
    complete = frozenset(mb for mb in found if all(mb in mbs for mbs in held.values()))
    return complete, frozenset(found - complete)
