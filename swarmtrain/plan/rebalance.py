"""Rebalancing with hysteresis: move a peer to another stage only for a large, lasting gain.

Petals users complain of churn when servers hop between block spans on every small change,
and a move is not free: the peer downloads its new stage's parameters and optimizer state.
So a move is recommended only when the predicted gain exceeds `min_gain` at `patience`
consecutive checks, for the same move, and never when it would take a stage's last replica.
The caller decides when a check happens; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swarmtrain.errors import ConfigError
from swarmtrain.plan.cost_model import BlockCost, CostModel, PeerCapacity, PlanConfig, usable_memory
from swarmtrain.plan.planner import Plan, evaluate, stage_members


@dataclass(frozen=True, kw_only=True)
class RebalanceConfig:
    """When a stage peer should move to another stage."""

    min_gain: float = 0.10
    """Smallest relative throughput gain worth a move: 0.10 moves only for more than +10%."""
    patience: int = 3
    """Consecutive checks the same move must keep that gain before it is recommended."""

    def __post_init__(self):
        if (
            isinstance(self.min_gain, bool)
            or not isinstance(self.min_gain, (int, float))
            or not self.min_gain >= 0
        ):
            raise ConfigError(f"RebalanceConfig: min_gain must be a number >= 0, got {self.min_gain!r}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ConfigError(f"RebalanceConfig: patience must be an integer >= 1, got {self.patience!r}")


@dataclass(frozen=True, kw_only=True)
class MoveCandidate:
    """One peer's best alternative to its current stage, as seen at one check."""

    peer_id: str
    """The stage peer that would move."""
    from_stage: int
    """Stage it replicates now."""
    to_stage: int
    """Stage it would replicate instead."""
    from_stage_replicas: int
    """Replicas `from_stage` has now, this peer included; `Rebalancer` never moves the last one."""
    current_tokens_per_s: float
    """Predicted pipeline throughput as things are."""
    moved_tokens_per_s: float
    """Predicted pipeline throughput after the move."""


def should_move(current_tokens_per_s: float, moved_tokens_per_s: float, min_gain: float) -> bool:
    """True iff the move's predicted throughput beats the current one by more than `min_gain`.

    From a stalled pipeline (current 0) any positive throughput is a gain worth taking.
    """
    return moved_tokens_per_s > current_tokens_per_s * (1.0 + min_gain) and moved_tokens_per_s > 0


def best_move(
    plan: Plan, costs: Sequence[BlockCost], peers: Iterable[PeerCapacity], config: PlanConfig, peer_id: str
) -> MoveCandidate | None:
    """The stage `peer_id` could move to that would raise predicted throughput most, or None.

    None when no stage it fits would do better than staying; in particular for a stage's
    last replica, whose leaving would stall the pipeline. Ties go to the lower stage index.
    Both stages' rates follow `CostModel.stage_rate`, averaging included when configured.
    """
    peers = list(peers)
    if peer_id not in plan.assignments:
        raise ConfigError(f"peer {peer_id!r} replicates no stage of the plan: use join_stage for a new peer")
    evaluation = evaluate(plan, costs, peers, config)  # raises if the plan's peers are not all given
    model = CostModel(costs, config)
    peer = next(p for p in peers if p.peer_id == peer_id)
    bounds = plan.stage_bounds
    totals = list(evaluation.stage_tokens_per_s)
    sums, counts, low = stage_members(plan, model, peers)
    here = plan.assignments[peer_id]
    others = [  # the bandwidths of `here`'s other replicas, for its slowest link once peer_id leaves
        p.bandwidth_bytes_per_s
        for p in peers
        if p.peer_id != peer_id and plan.assignments.get(p.peer_id) == here
    ]
    totals[here] = model.stage_rate(
        sums[here] - evaluation.replica_tokens_per_s[peer_id],
        counts[here] - 1,
        min(others, default=float("inf")),
        bounds[here],
        bounds[here + 1],
    )
    current = evaluation.throughput_tokens_per_s
    best_stage, best_rate = None, current
    for s in range(plan.num_stages):
        start, stop = bounds[s], bounds[s + 1]
        if s == here or model.stage_memory(start, stop) > usable_memory(peer, config):
            continue
        joined = model.stage_rate(
            sums[s] + model.replica_rate(peer, start, stop),
            counts[s] + 1,
            min(low[s], peer.bandwidth_bytes_per_s),
            start,
            stop,
        )
        moved = min(joined if k == s else t for k, t in enumerate(totals))
        if moved > best_rate:
            best_stage, best_rate = s, moved
    if best_stage is None:
        return None
    return MoveCandidate(
        peer_id=peer_id,
        from_stage=here,
        to_stage=best_stage,
        from_stage_replicas=len(plan.replicas(here)),
        current_tokens_per_s=current,
        moved_tokens_per_s=best_rate,
    )


class Rebalancer:
    """Hysteresis over successive checks: which observed moves have lasted long enough.

    Feed it every check's candidate for each peer (None when a peer has no better stage);
    `observe` returns the move to make now, or None. Deterministic, no clock, no I/O.
    """

    def __init__(self, config: RebalanceConfig | None = None):
        self.config = config or RebalanceConfig()
        self._streaks: dict[str, tuple[tuple[int, int], int]] = {}

    def streak(self, peer_id: str) -> int:
        """Consecutive checks (so far) at which `peer_id`'s current candidate move was worth making."""
        return self._streaks.get(peer_id, ((0, 0), 0))[1]

    def observe(self, peer_id: str, candidate: MoveCandidate | None) -> MoveCandidate | None:
        """Record one check for `peer_id`; return the move to make now, or None.

        A check counts towards a move if the candidate clears `min_gain`; a check without one,
        or with a different move (another source or target stage), starts the count again. A
        move is returned once its count reaches `patience` and its source stage would keep a
        replica (until then the count keeps growing); the count then resets, since the caller
        re-plans after moving.
        """
        if candidate is not None and candidate.peer_id != peer_id:
            raise ConfigError(f"a move for peer {candidate.peer_id!r} was observed as peer {peer_id!r}'s")
        if candidate is None or not should_move(
            candidate.current_tokens_per_s, candidate.moved_tokens_per_s, self.config.min_gain
        ):
            self._streaks.pop(peer_id, None)
            return None
        move = (candidate.from_stage, candidate.to_stage)
        previous, count = self._streaks.get(peer_id, (move, 0))
        count = count + 1 if previous == move else 1
        if count >= self.config.patience and candidate.from_stage_replicas >= 2:
            self._streaks.pop(peer_id, None)
            return candidate
        self._streaks[peer_id] = (move, count)
        return None

    def forget(self, peer_id: str) -> None:
        """Drop `peer_id`'s history (it left the swarm, or moved by other means)."""
        self._streaks.pop(peer_id, None)
