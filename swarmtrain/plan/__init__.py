"""Planning (pure): peer roles, stage boundaries and replicas from block costs and peer capacities.

- `cost_model`: `BlockCost`, `PeerCapacity`, `PlanConfig` and the throughput/memory model
- `planner`: `plan_swarm`, the `even_split_plan` baseline, `evaluate`
- `join`: `join_stage` (the planner's choice for a joining peer) and `serving_stage` (a peer
  that must serve a stage: an empty one first, `join_stage`'s next, the slowest per replica last)
- `rebalance`: `best_move`, `should_move` and the `Rebalancer` hysteresis
- `layout`: `propose_layout` (a re-planned layout for the peers there, against the live one)
  and the `LayoutGate` hysteresis over proposals
- `rl`: RL runs: `split_rl` (stages on the peers best at training, rollouts on the rest, so
  sampling keeps up with training), `join_role`, `best_role_move` and `RoleRebalancer`

Plain data in, plain data out: no I/O and no torch, so the simulator and the peers run the same code.
"""

from swarmtrain.plan.cost_model import (
    BlockCost,
    CostModel,
    PeerCapacity,
    PlanConfig,
    transformer_block_cost,
    usable_memory,
)
from swarmtrain.plan.join import join_stage, serving_stage
from swarmtrain.plan.layout import LayoutGate, LayoutProposal, ReplanConfig, propose_layout
from swarmtrain.plan.planner import Plan, PlanEvaluation, evaluate, even_split_plan, plan_swarm
from swarmtrain.plan.rebalance import MoveCandidate, RebalanceConfig, Rebalancer, best_move, should_move
from swarmtrain.plan.rl import (
    RLDemand,
    RLSplit,
    RoleMove,
    RoleRebalancer,
    best_role_move,
    join_role,
    split_rl,
)

__all__ = [
    "LayoutGate",
    "LayoutProposal",
    "ReplanConfig",
    "propose_layout",
    "BlockCost",
    "CostModel",
    "MoveCandidate",
    "PeerCapacity",
    "Plan",
    "PlanConfig",
    "PlanEvaluation",
    "RLDemand",
    "RLSplit",
    "RebalanceConfig",
    "Rebalancer",
    "RoleMove",
    "RoleRebalancer",
    "best_move",
    "best_role_move",
    "even_split_plan",
    "evaluate",
    "join_role",
    "join_stage",
    "plan_swarm",
    "serving_stage",
    "should_move",
    "split_rl",
    "transformer_block_cost",
    "usable_memory",
]
