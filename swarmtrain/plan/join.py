"""Joining a running plan: which stage a new peer replicates.

`join_stage` is the planner's choice, Petals-style: the stage where one more replica raises
the pipeline throughput most, or None when no stage gains from the peer (it trains).
`serving_stage` is the choice of a peer that must serve some stage whatever the planner
thinks (a stage peer started without a stage): a stage with no replica first, then
`join_stage`'s choice, then the stage with the lowest rate per replica. Both are pure, so the
stage peers and a simulator join by the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from swarmtrain.errors import ConfigError
from swarmtrain.plan.cost_model import BlockCost, CostModel, PeerCapacity, PlanConfig, usable_memory
from swarmtrain.plan.planner import Plan, evaluate, stage_members


def join_stage(
    plan: Plan,
    costs: Sequence[BlockCost],
    peers: Iterable[PeerCapacity],
    config: PlanConfig,
    new_peer: PeerCapacity,
) -> int | None:
    """The stage a joining peer should replicate, or None if it fits no stage (it trains).

    The stage where its replica raises the pipeline throughput most; on a tie (it cannot
    raise it, or the slowest stages are tied) the stage with the lowest rate, then the lowest
    index, so joining peers fill the bottleneck Petals-style. With averaging (`tokens_per_step`)
    a replica can slow its stage; such stages are skipped, and a peer that would slow every
    stage it fits gets None too. `peers` are the plan's peers.
    """
    if new_peer.peer_id in plan.assignments:
        raise ConfigError(
            f"peer {new_peer.peer_id!r} already replicates stage {plan.assignments[new_peer.peer_id]}"
        )
    model = CostModel(costs, config)
    peers = list(peers)
    totals = evaluate(plan, costs, peers, config).stage_tokens_per_s
    sums, counts, low = stage_members(plan, model, peers)
    choice, choice_key = None, None
    for s in range(plan.num_stages):
        start, stop = plan.stage_bounds[s], plan.stage_bounds[s + 1]
        if model.stage_memory(start, stop) > usable_memory(new_peer, config):
            continue
        joined = model.stage_rate(
            sums[s] + model.replica_rate(new_peer, start, stop),
            counts[s] + 1,
            min(low[s], new_peer.bandwidth_bytes_per_s),
            start,
            stop,
        )
        if joined < totals[s]:
            continue  # averaging with one more replica costs more than its tokens gain
        after = min(joined if k == s else totals[k] for k in range(plan.num_stages))
        key = (after, -totals[s], -s)
        if choice_key is None or key > choice_key:
            choice, choice_key = s, key
    return choice


def serving_stage(
    plan: Plan,
    costs: Sequence[BlockCost],
    peers: Iterable[PeerCapacity],
    config: PlanConfig,
    new_peer: PeerCapacity,
    fits: Sequence[bool] | None = None,
) -> int:
    """The stage a joining peer that must serve one takes; `plan` may be incomplete.

    `fits[k]` says whether the peer has the memory for stage k (None: as the planner's memory
    model says, `usable_memory`); it never takes a stage it does not fit. Among those:

    1. a stage with no replica, the lowest index first: the pipeline cannot run without it;
    2. else `join_stage`'s choice;
    3. else (`join_stage` says None: one more replica would slow every stage through
       averaging, or the planner's memory model fits the peer nowhere; or its choice is not
       among `fits`) the stage with the lowest predicted rate per replica, lowest index on ties.

    `peers` are the plan's peers. Raises ConfigError when the peer fits no stage, when `fits`
    does not have one entry per stage, or when the peer is in the plan already.
    """
    if new_peer.peer_id in plan.assignments:
        raise ConfigError(
            f"peer {new_peer.peer_id!r} already replicates stage {plan.assignments[new_peer.peer_id]}"
        )
    peers = list(peers)
    model = CostModel(costs, config)
    bounds = plan.stage_bounds
    if fits is None:
        fits = [
            model.stage_memory(bounds[k], bounds[k + 1]) <= usable_memory(new_peer, config)
            for k in range(plan.num_stages)
        ]
    if len(fits) != plan.num_stages:
        raise ConfigError(
            f"fits has {len(fits)} entries for a plan of {plan.num_stages} stages: give one per stage"
        )
    candidates = [k for k in range(plan.num_stages) if fits[k]]
    if not candidates:
        raise ConfigError(
            f"peer {new_peer.peer_id!r} has the memory for no stage of the plan: give it more, or make it a trainer"
        )
    counts = [len(plan.replicas(k)) for k in range(plan.num_stages)]
    empty = [k for k in candidates if counts[k] == 0]
    if empty:
        return empty[0]
    choice = join_stage(plan, costs, peers, config, new_peer)
    if choice is not None and fits[choice]:
        return choice
    totals = evaluate(plan, costs, peers, config).stage_tokens_per_s
    return min(candidates, key=lambda k: (totals[k] / counts[k], k))
