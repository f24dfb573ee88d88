"""Re-planning a running swarm's layout, and when a new layout is worth having (pure).

`propose_layout` plans the peers that are there (the planner, with the live layout's stage
count) and compares the plan with the live layout under the same throughput model. It is a
function of the peers' capacities alone, whatever their order: every peer that reads the same
DHT view reaches the same proposal, so no single peer has to decide. `LayoutGate` is the
hysteresis a move needs (as `Rebalancer` is for one peer's move): the same proposal must beat
the live layout by more than `min_gain` at `patience` consecutive checks, so a small gain, or
one that lasts a check or two (a peer passing through, a hiccup in measured speeds), never
moves the swarm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swarmtrain.plan.cost_model import BlockCost, PeerCapacity, PlanConfig
from swarmtrain.plan.planner import Plan, evaluate, plan_swarm
from swarmtrain.plan.rebalance import should_move
from swarmtrain.wire.layout_record import ReplanConfig  # noqa: F401  (re-exported: the gate's rule)


@dataclass(frozen=True, kw_only=True)
class LayoutProposal:
    """A layout for the peers that are there, and what the throughput model says of it."""

    stage_bounds: tuple[int, ...]
    assignments: dict[str, int]
    """Stage of each peer the proposal gives one (sorted by peer id; treat as read-only)."""
    current_tokens_per_s: float
    """Predicted pipeline rate of the live layout."""
    planned_tokens_per_s: float
    """Predicted pipeline rate of this one."""

    @property
    def gain(self) -> float:
        """Relative predicted gain over the live layout (inf from a stalled one)."""
        if self.current_tokens_per_s <= 0:
            return math.inf if self.planned_tokens_per_s > 0 else 0.0
        return self.planned_tokens_per_s / self.current_tokens_per_s - 1.0

    @property
    def key(self) -> tuple:
        """What makes two proposals the same layout."""
        return self.stage_bounds, tuple(self.assignments.items())

    def to_dict(self) -> dict:
        return {
            "stage_bounds": list(self.stage_bounds),
            "assignments": dict(self.assignments),
            "current_tokens_per_s": self.current_tokens_per_s,
            "planned_tokens_per_s": self.planned_tokens_per_s,
            "gain": self.gain if math.isfinite(self.gain) else None,  # JSON has no inf
        }


def propose_layout(
    costs: Sequence[BlockCost], peers: Iterable[PeerCapacity], config: PlanConfig, live: Plan
) -> LayoutProposal | None:
    """The planner's layout for `peers` with `live`'s stage count, against `live` (the stages
    and assignments the swarm has; every peer it assigns must be among `peers`). None when the
    planner would keep the live layout as it is."""
    peers = sorted(peers, key=lambda p: p.peer_id)
    count = live.num_stages
    current = evaluate(live, costs, peers, config).throughput_tokens_per_s
    plan = plan_swarm(costs, peers, dataclasses.replace(config, min_stages=count, max_stages=count))
    if plan.stage_bounds == tuple(live.stage_bounds) and plan.assignments == dict(live.assignments):
        return None
    return LayoutProposal(
        stage_bounds=plan.stage_bounds,
        assignments=dict(sorted(plan.assignments.items())),
        current_tokens_per_s=current,
        planned_tokens_per_s=plan.throughput_tokens_per_s,
    )


class LayoutGate:
    """Hysteresis over successive checks' proposals. Deterministic, no clock, no I/O."""

    def __init__(self, config: ReplanConfig | None = None):
        self.config = config or ReplanConfig()
        self._key: tuple | None = None
        self.streak = 0
        """Consecutive checks (so far) at which the current proposal cleared `min_gain`."""

    def observe(self, proposal: LayoutProposal | None) -> LayoutProposal | None:
        """Record one check; the proposal to move to now, or None. A check without a proposal,
        or with one under `min_gain`, starts the count again, as does a different proposal."""
        if proposal is None or not should_move(
            proposal.current_tokens_per_s, proposal.planned_tokens_per_s, self.config.min_gain
        ):
            self._key, self.streak = None, 0
            return None
        self.streak = self.streak + 1 if proposal.key == self._key else 1
        self._key = proposal.key
        return proposal if self.streak >= self.config.patience else None
