"""When a stage lost its last replica: how far the run goes back (pure, for the trainer).

A stage whose every replica died comes back from the newest checkpoint of it in the swarm
(`swarmtrain.peers.checkpoints.bring_back`), at that checkpoint's step S while the other stages
are at the run's step T > S. Going on would pair layers from different points of training, so
by default the whole run goes back: every replica of every stage takes its stage's checkpoint of
step S (or is at S already), and the run goes on from that state as step T + 1. Step numbers
never go back, so a replica that missed the rollback is simply behind, and catches up from one
that did not; the steps S..T-1 are reported as lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swarmtrain.wire.records import PeerRecord


@dataclass(frozen=True, kw_only=True)
class RollbackPlan:
    """Every stage goes back to checkpoint `checkpoint`; the run goes on as step `step`."""

    checkpoint: int
    step: int
    lost_stages: tuple[int, ...]
    """The stages that had no replica at the run's step."""
    sources: Mapping[int, tuple[str, ...]]
    """Per stage, peers that hold its checkpoint of that step (stage peers, archivists)."""
    stage_only: bool = False
    """Only the lost stages go back; the others keep their state (the run's explicit choice)."""

    def checkpoint_for(self, stage: int) -> int:
        """The step `stage` goes back to: the checkpoint, or where it is (`stage_only`)."""
        return self.checkpoint if not self.stage_only or stage in self.lost_stages else self.step - 1

    @property
    def lost_steps(self) -> int:
        return self.step - 1 - self.checkpoint

    def describe(self) -> str:
        stages = ", ".join(map(str, self.lost_stages))
        if self.stage_only:
            return (
                f"stage(s) {stages} lost every replica and came back alone from the checkpoint of step "
                f"{self.checkpoint}; the other stages kept their state (the run restores only lost stages)"
            )
        return (
            f"stage(s) {stages} lost every replica and came back from the checkpoint of step "
            f"{self.checkpoint}: the run went back to it, losing {self.lost_steps} step(s)"
        )


def checkpoint_holders(records: list[PeerRecord], stage: int, step: int) -> tuple[str, ...]:
    """Peers that announce a checkpoint of `stage` at `step`: its replicas that list it, and
    archivists (coordinators) that list it (they hold every stage of the steps they list)."""
    return tuple(
        sorted(
            r.peer_id
            for r in records
            if step in r.checkpoints and (r.role == "coordinator" or (r.role == "stage" and r.stage == stage))
        )
    )


def plan_rollback(
    replica_steps: Mapping[int, list[int]],
    records: list[PeerRecord],
    run_step: int,
    num_stages: int,
    *,
    stage_only: bool = False,
) -> RollbackPlan | None:
    """The rollback that makes every stage consistent again, None if none is needed or possible.

    `replica_steps[k]` is the steps of stage k's serving replicas. A stage with no replica at
    `run_step` but some behind it was lost: the run goes back to the furthest step S its
    replicas reach (the lowest over such stages), if every other stage has a replica at S or a
    checkpoint of S somewhere in the swarm."""
    lost = [k for k in range(num_stages) if replica_steps.get(k) and run_step not in replica_steps[k]]
    if not lost or any(max(replica_steps[k]) >= run_step for k in lost):
        return None
    target = min(max(replica_steps[k]) for k in lost)
    sources = {}
    for k in range(num_stages):
        holders = checkpoint_holders(records, k, target)
        if target not in replica_steps.get(k, []) and not holders and not (stage_only and k not in lost):
            return None
        sources[k] = holders
    return RollbackPlan(
        checkpoint=target, step=run_step + 1, lost_stages=tuple(lost), sources=sources, stage_only=stage_only
    )


class RollbackNeeded(Exception):
    """Raised inside a step when the run must go back (`plan`) before the step can complete."""

    def __init__(self, plan: RollbackPlan):
        super().__init__(plan.describe())
        self.plan = plan
