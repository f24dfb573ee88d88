"""Planning (pure): peer roles, stage boundaries and replicas from block costs and peer capacities.

- `cost_model`: `BlockCost`, `PeerCapacity`, `PlanConfig` and the throughput/memory model
- `planner`: `plan_swarm`, the `even_split_plan` baseline, `evaluate`
- `join`: `join_stage` (the planner's choice for a joining peer) and `serving_stage` (a peer
  that must serve a stage: an empty one first, `join_stage`'s next, the slowest per replica last)
- `rebalance`: `best_move`, `should_move` and the `Rebalancer` hysteresis

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
from swarmtrain.plan.planner import Plan, PlanEvaluation, evaluate, even_split_plan, plan_swarm
from swarmtrain.plan.rebalance import MoveCandidate, RebalanceConfig, Rebalancer, best_move, should_move

__all__ = [
    "BlockCost",
    "CostModel",
    "MoveCandidate",
    "PeerCapacity",
    "Plan",
    "PlanConfig",
    "PlanEvaluation",
    "RebalanceConfig",
    "Rebalancer",
    "best_move",
    "even_split_plan",
    "evaluate",
    "join_stage",
    "plan_swarm",
    "serving_stage",
    "should_move",
    "transformer_block_cost",
    "usable_memory",
]
