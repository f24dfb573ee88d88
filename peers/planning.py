"""From a model and measured peers to a plan: the bridge between the cost model (torch) and
the pure planner in `swarmtrain.plan`."""

from __future__ import annotations

from swarmtrain.model import build_model
from swarmtrain.model.costs import block_costs
from swarmtrain.plan import BlockCost, PeerCapacity, Plan, PlanConfig, plan_swarm

LOOPBACK_BYTES_PER_S = 500 * 2**20
"""Bandwidth assumed between peers of one machine (hivemind binary streams on loopback)."""


def planner_costs(
    model: str, model_config: dict, *, microbatch_size: int, optimizer: str = "adamw"
) -> list[BlockCost]:
    """Per-block costs as the planner wants them (its param_bytes counts weights and gradients)."""
    return [
        BlockCost(
            flops_per_token=r.flops_per_token,
            param_bytes=r.param_bytes + r.grad_bytes,
            optimizer_bytes=r.optimizer_bytes,
            activation_bytes_per_token=r.activation_bytes_per_token,
            boundary_bytes_per_token=r.boundary_bytes_per_token,
        )
        for r in block_costs(model, model_config, microbatch_size=microbatch_size, optimizer=optimizer)
    ]


def plan_for_peers(
    model: str,
    model_config: dict,
    peers: list[PeerCapacity],
    *,
    microbatch_size: int,
    max_in_flight: int,
    microbatches_per_step: int,
    max_stages: int | None = None,
) -> Plan:
    """Stage boundaries and replicas for `peers`, maximising predicted pipeline throughput
    (replicas cost a gradient all-reduce per step, which the planner weighs)."""
    meta = build_model(model, model_config, device="meta")
    tokens_per_sample = meta.input_shape[0] if meta.input_shape else 1
    config = PlanConfig(
        tokens_in_flight=tokens_per_sample * microbatch_size * max_in_flight,
        tokens_per_step=tokens_per_sample * microbatch_size * microbatches_per_step,
        max_stages=max_stages,
    )
    costs = planner_costs(model, model_config, microbatch_size=microbatch_size)
    return plan_swarm(costs, peers, config)
