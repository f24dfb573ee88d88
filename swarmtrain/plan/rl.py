"""Joint planning of an RL run (pure): which peers train and which sample.

In an RL run the stage peers train the policy through the pipeline and the rollout peers
sample completions for them. Training is compute-bound and sampling memory-bandwidth-bound,
so a peer's worth differs between the two (a consumer card is far further behind a
data-centre one at the first than at the second). Each peer's probe measures both: matmul
FLOP/s (`PeerCapacity.flops_per_s`, through the cost model a stage replica's token rate) and
the tokens per second it decodes the run's policy at (`PeerCapacity.decode_tokens_per_s`, 0
when it cannot sample). The run goes at the slower of its two halves:

    consumed  C = pipeline tokens/s (`evaluate`) / RLDemand.tokens_per_sample
    produced  P = sum over rollout peers of decode_tokens_per_s / RLDemand.decode_tokens_per_sample
    samples/s   = min(C, P)

`split_rl` picks the split from scratch: it orders the peers by how much better they are at
training than at sampling (FLOP/s over decode tokens/s, then FLOP/s), gives the first k the
stages (each joining as a stage peer would, `serving_stage`) and the rest the rollouts, and
keeps the k that maximizes min(C, P): production matches consumption. A peer that fits no
stage samples; one that cannot sample trains; one that can do neither is a trainer (it
drives steps; `swarmtrain train`).

A running swarm is not re-split from scratch: `join_role` is the role a new peer takes, and
`best_role_move` the one role change (one peer, stage to rollout or back) that raises
samples/s most, never taking a stage's last replica. `RoleRebalancer` makes a move only when
its gain clears `min_gain` (10%) at `patience` (3) consecutive checks, as stage moves do
(`swarmtrain.plan.rebalance`). Every peer computes the same move from the same records, so
peers do not switch in a herd.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swarmtrain.errors import ConfigError
from swarmtrain.plan.cost_model import BlockCost, CostModel, PeerCapacity, PlanConfig, usable_memory
from swarmtrain.plan.join import serving_stage
from swarmtrain.plan.planner import Plan, evaluate
from swarmtrain.plan.rebalance import RebalanceConfig, should_move

ROLES = ("stage", "rollout", "trainer")


@dataclass(frozen=True, kw_only=True)
class RLDemand:
    """What one trained sample costs each half of an RL run."""

    tokens_per_sample: float
    """Positions a sample puts through the pipeline (its padded sequence length)."""
    decode_tokens_per_sample: float
    """Tokens a rollout peer decodes per sample (the task's completion budget)."""

    def __post_init__(self):
        for name in ("tokens_per_sample", "decode_tokens_per_sample"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"RLDemand: {name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RLSplit:
    """Roles for every peer of an RL run and the rates the model predicts for them."""

    plan: Plan
    """The stage peers' layout (`plan.trainers` is empty: see `rollouts` and `trainers`)."""
    rollouts: tuple[str, ...]
    """Peers that sample, sorted."""
    trainers: tuple[str, ...]
    """Peers that fit no stage and cannot sample, sorted: they can only drive steps."""
    consumed_samples_per_s: float
    """Samples per second the stages can train on (0 while a stage has no replica)."""
    produced_samples_per_s: float
    """Samples per second the rollout peers can sample."""

    @property
    def samples_per_s(self) -> float:
        """What the run achieves: the slower half."""
        return min(self.consumed_samples_per_s, self.produced_samples_per_s)

    def role(self, peer_id: str) -> str:
        """'stage', 'rollout' or 'trainer'; ConfigError for a peer the split does not name."""
        if peer_id in self.plan.assignments:
            return "stage"
        if peer_id in self.rollouts:
            return "rollout"
        if peer_id in self.trainers:
            return "trainer"
        raise ConfigError(f"peer {peer_id!r} is not in this RL split")


@dataclass(frozen=True, kw_only=True)
class RoleMove:
    """One peer's change of role and what the model predicts it does to the run."""

    peer_id: str
    to_role: str
    """'stage' or 'rollout'."""
    current_samples_per_s: float
    moved_samples_per_s: float


def can_sample(peer: PeerCapacity) -> bool:
    """The peer measured a decode rate: it holds two copies of the policy and samples."""
    return peer.decode_tokens_per_s > 0


def fits_a_stage(peer: PeerCapacity, plan: Plan, costs: Sequence[BlockCost], config: PlanConfig) -> bool:
    """The peer has the memory for at least one of `plan`'s stages."""
    model = CostModel(costs, config)
    b = plan.stage_bounds
    return any(
        model.stage_memory(b[k], b[k + 1]) <= usable_memory(peer, config) for k in range(plan.num_stages)
    )


def rl_rates(
    plan: Plan,
    rollouts: Iterable[str],
    costs: Sequence[BlockCost],
    peers: Iterable[PeerCapacity],
    config: PlanConfig,
    demand: RLDemand,
) -> tuple[float, float]:
    """(consumed, produced) samples per second of the stage layout `plan` and the rollout peers
    `rollouts`; `peers` must hold every peer either names."""
    by_id = {p.peer_id: p for p in peers}
    missing = (set(plan.assignments) | set(rollouts)) - set(by_id)
    if missing:
        raise ConfigError(f"no capacity given for peers {sorted(missing)}")
    stage_peers = [by_id[p] for p in plan.assignments]
    consumed = evaluate(plan, costs, stage_peers, config).throughput_tokens_per_s / demand.tokens_per_sample
    produced = sum(by_id[p].decode_tokens_per_s for p in set(rollouts)) / demand.decode_tokens_per_sample
    return consumed, produced


def _empty_plan(stage_bounds: Sequence[int]) -> Plan:
    n = len(stage_bounds) - 1
    return Plan(
        stage_bounds=tuple(stage_bounds),
        assignments={},
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0,) * n,
    )


def _with(plan: Plan, peer_id: str, stage: int | None) -> Plan:
    """`plan` with `peer_id` on `stage` (None: off every stage)."""
    assignments = {p: s for p, s in plan.assignments.items() if p != peer_id}
    if stage is not None:
        assignments[peer_id] = stage
    return Plan(
        stage_bounds=plan.stage_bounds,
        assignments=assignments,
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0,) * plan.num_stages,
    )


def _fill(
    stage_bounds: Sequence[int], costs: Sequence[BlockCost], peers: list[PeerCapacity], config: PlanConfig
) -> Plan:
    """The layout `peers` reach joining one by one as stage peers, strongest first."""
    plan, placed = _empty_plan(stage_bounds), []
    for peer in sorted(peers, key=lambda p: (-p.flops_per_s, p.peer_id)):
        plan = _with(plan, peer.peer_id, serving_stage(plan, costs, placed, config, peer))
        placed.append(peer)
    return plan


def split_rl(
    stage_bounds: Sequence[int],
    costs: Sequence[BlockCost],
    peers: Iterable[PeerCapacity],
    config: PlanConfig,
    demand: RLDemand,
) -> RLSplit:
    """The split of `peers` between stages and rollouts that maximizes samples/s (see the
    module docstring); ties go to the split with more total rate, then fewer stage peers."""
    peers = sorted(peers, key=lambda p: p.peer_id)
    if len({p.peer_id for p in peers}) != len(peers):
        raise ConfigError("split_rl: peer ids must be unique")
    template = _empty_plan(stage_bounds)
    fits = {p.peer_id: fits_a_stage(p, template, costs, config) for p in peers}
    trainers = tuple(p.peer_id for p in peers if not fits[p.peer_id] and not can_sample(p))
    must_train = [p for p in peers if fits[p.peer_id] and not can_sample(p)]
    must_sample = [p for p in peers if not fits[p.peer_id] and can_sample(p)]
    either = sorted(
        (p for p in peers if fits[p.peer_id] and can_sample(p)),
        key=lambda p: (-p.flops_per_s / p.decode_tokens_per_s, -p.flops_per_s, p.peer_id),
    )
    best, best_key = None, None
    for k in range(len(either) + 1):
        plan = _fill(stage_bounds, costs, must_train + either[:k], config)
        rollouts = tuple(sorted(p.peer_id for p in must_sample + either[k:]))
        consumed, produced = rl_rates(plan, rollouts, costs, peers, config, demand)
        key = (min(consumed, produced), consumed + produced, -k)
        if best_key is None or key > best_key:
            best_key = key
            best = RLSplit(
                plan=plan,
                rollouts=rollouts,
                trainers=trainers,
                consumed_samples_per_s=consumed,
                produced_samples_per_s=produced,
            )
    return best


def join_role(
    plan: Plan,
    rollouts: Iterable[str],
    costs: Sequence[BlockCost],
    peers: Iterable[PeerCapacity],
    config: PlanConfig,
    demand: RLDemand,
    new_peer: PeerCapacity,
) -> str:
    """The role a peer joining the swarm (`plan`'s stage peers, `rollouts`) takes: 'stage',
    'rollout' or 'trainer' (it can do neither).

    A stage with no replica comes first when the peer fits one: the run cannot train without
    it. Otherwise the role that raises samples/s most; on a tie, the slower half's role.
    """
    peers = [p for p in peers if p.peer_id != new_peer.peer_id]
    rollouts = [r for r in rollouts if r != new_peer.peer_id]
    plan = _with(plan, new_peer.peer_id, None)
    fits = fits_a_stage(new_peer, plan, costs, config)
    if not fits:
        return "rollout" if can_sample(new_peer) else "trainer"
    if not can_sample(new_peer) or any(not plan.replicas(k) for k in range(plan.num_stages)):
        return "stage"
    consumed, produced = rl_rates(plan, rollouts, costs, peers, config, demand)
    everyone = [*peers, new_peer]
    staged = _with(plan, new_peer.peer_id, serving_stage(plan, costs, peers, config, new_peer))
    as_stage = min(rl_rates(staged, rollouts, costs, everyone, config, demand))
    as_rollout = min(rl_rates(plan, [*rollouts, new_peer.peer_id], costs, everyone, config, demand))
    if as_stage != as_rollout:
        return "stage" if as_stage > as_rollout else "rollout"
    return "stage" if consumed <= produced else "rollout"


def best_role_move(
    plan: Plan,
    rollouts: Iterable[str],
    costs: Sequence[BlockCost],
    peers: Iterable[PeerCapacity],
    config: PlanConfig,
    demand: RLDemand,
    movable: Iterable[str],
) -> RoleMove | None:
    """The change of role by one of `movable` that raises samples/s most, or None when none
    raises it. A stage peer may become a rollout peer (if it can sample, and never a stage's
    last replica); a rollout peer may become a stage peer (if it fits a stage: the stage a
    joining peer would take). Ties go to the lowest peer id."""
    peers = list(peers)
    rollouts = sorted(set(rollouts))
    by_id = {p.peer_id: p for p in peers}
    current = min(rl_rates(plan, rollouts, costs, peers, config, demand))
    best: RoleMove | None = None
    for peer_id in sorted(set(movable)):
        peer = by_id.get(peer_id)
        if peer is None:
            continue
        if peer_id in plan.assignments:
            if not can_sample(peer) or len(plan.replicas(plan.assignments[peer_id])) < 2:
                continue
            moved = min(
                rl_rates(_with(plan, peer_id, None), [*rollouts, peer_id], costs, peers, config, demand)
            )
            to_role = "rollout"
        elif peer_id in rollouts:
            if not fits_a_stage(peer, plan, costs, config):
                continue
            others = [by_id[p] for p in plan.assignments]
            staged = _with(plan, peer_id, serving_stage(plan, costs, others, config, peer))
            left = [r for r in rollouts if r != peer_id]
            moved = min(rl_rates(staged, left, costs, peers, config, demand))
            to_role = "stage"
        else:
            continue
        if moved > current and (best is None or moved > best.moved_samples_per_s):
            best = RoleMove(
                peer_id=peer_id, to_role=to_role, current_samples_per_s=current, moved_samples_per_s=moved
            )
    return best


class RoleRebalancer:
    """Hysteresis over successive checks of one peer's role, as `Rebalancer` for stage moves.

    Feed it each check's `best_role_move` as `peer_id` sees it; `observe` returns the role to
    take now, or None. A check counts when the move is this peer's and clears `min_gain`; any
    other check starts the count again. Deterministic, no clock, no I/O.
    """

    def __init__(self, config: RebalanceConfig | None = None):
        self.config = config or RebalanceConfig()
        self._streak: tuple[str | None, int] = (None, 0)

    @property
    def streak(self) -> int:
        """Consecutive checks (so far) at which the same move of this peer was worth making."""
        return self._streak[1]

    def observe(self, peer_id: str, move: RoleMove | None) -> str | None:
        if (
            move is None
            or move.peer_id != peer_id
            or not should_move(move.current_samples_per_s, move.moved_samples_per_s, self.config.min_gain)
        ):
            self._streak = (None, 0)
            return None
        role, count = self._streak
        count = count + 1 if role == move.to_role else 1
        if count >= self.config.patience:
            self._streak = (None, 0)
            return move.to_role
        self._streak = (move.to_role, count)
        return None
