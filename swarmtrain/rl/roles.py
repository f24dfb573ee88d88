"""Roles in an RL run as the DHT shows it: which a `--role auto` peer takes, and when it switches.

The pure planner (`swarmtrain.plan.rl`) on the run's records: stage peers that are joining
or serving hold the stages (`placement.layout_plan`), serving rollout peers sample; every
peer's capacity is what its record announces (`placement.peer_capacity`: flops_per_s for
training, decode_tokens_per_s for sampling). Peers started with `--role auto` announce
`role_auto` in their capacity: only they are moved. A record whose capacity does not parse
is left out rather than trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.plan import PeerCapacity, RebalanceConfig
from swarmtrain.plan.rl import RLDemand, RoleRebalancer, best_role_move, join_role
from swarmtrain.rl.registry import TaskSources, build_task
from swarmtrain.train.placement import (
    layout_plan,
    manifest_costs,
    manifest_plan_config,
    peer_capacity,
    sample_positions,
)
from swarmtrain.wire.records import PeerRecord, RunManifest

logger = logging.getLogger(__name__)

AUTO_KEY = "role_auto"
"""Capacity key a `--role auto` peer announces (True): the planner may switch its role."""


def rl_demand(manifest: RunManifest, tasks: TaskSources = TaskSources()) -> RLDemand:
    """What a sample costs this run: its model's sequence length to train, its task's
    completion budget to decode."""
    if manifest.rl is None:
        raise ConfigError(f"run {manifest.run_id!r} is not an RL run: it has no roles to plan")
    task = build_task(manifest.rl.task, manifest.rl.task_options, tasks)
    return RLDemand(
        tokens_per_sample=sample_positions(manifest.model, manifest.model_config),
        decode_tokens_per_sample=task.max_new_tokens,
    )


def probe_prompts(manifest: RunManifest) -> int:
    """Prompts a decode probe samples at once: one rollout request's worth when two rollout
    peers share a step (`RolloutFeed` asks each for its share), at most 32. Decoding a small
    policy costs per step more than per row, so the rate depends on the batch: probe the one
    the run will ask for."""
    per_step = manifest.rl.prompts_per_step(
        manifest.batch.microbatch_size * manifest.batch.microbatches_per_step
    )
    return max(1, min(32, -(-per_step // 2)))


def _capacity(record: PeerRecord) -> PeerCapacity | None:
    try:
        return peer_capacity(record.peer_id, record.capacity)
    except (ConfigError, TypeError, ValueError) as e:
        logger.debug("ignoring the capacity of peer %s: %s", record.peer_id, e)
        return None


class RoleView:
    """The run's stage layout, rollout peers and capacities as one snapshot of records shows them."""

    def __init__(self, manifest: RunManifest, records: Iterable[PeerRecord], *, leave_out: str | None = None):
        stages, rollouts, peers, movable = [], [], [], set()
        for r in records:
            if r.peer_id == leave_out or r.state == "draining":
                continue
            live_stage = r.role == "stage" and 0 <= r.stage < manifest.num_stages
            live_rollout = r.role == "rollout" and r.state == "serving"
            if not (live_stage or live_rollout):
                continue
            cap = _capacity(r)
            if cap is None:
                continue
            (stages if live_stage else rollouts).append(r)
            peers.append(cap)
            if r.capacity.get(AUTO_KEY) is True:
                movable.add(r.peer_id)
        self.plan = layout_plan(manifest, stages)
        self.rollouts = tuple(sorted(r.peer_id for r in rollouts))
        self.peers = peers
        self.movable = movable


def choose_role(
    manifest: RunManifest,
    records: Iterable[PeerRecord],
    capacity: Mapping[str, Any],
    *,
    peer_id: str,
    tasks: TaskSources = TaskSources(),
) -> str:
    """The role ('stage', 'rollout' or 'trainer') a `--role auto` peer with `capacity` takes on
    joining: always 'stage' for a run that is not RL, else `swarmtrain.plan.rl.join_role`."""
    if manifest.rl is None:
        return "stage"
    view = RoleView(manifest, records, leave_out=peer_id)
    return join_role(
        view.plan,
        view.rollouts,
        manifest_costs(manifest),
        view.peers,
        manifest_plan_config(manifest),
        rl_demand(manifest, tasks),
        peer_capacity(peer_id, capacity),
    )


class RoleChecker:
    """Decide, check by check, whether this `--role auto` peer should take the other role.

    Every auto peer computes the same best move (`best_role_move`) from the same records, so
    only the one peer it names counts towards switching, and only after the gain clears
    `min_gain` at `patience` checks in a row (`RoleRebalancer`). A stage's last replica never
    leaves it; a stage that lost every replica is refilled by the rollout peer that trains best.
    """

    def __init__(
        self,
        manifest: RunManifest,
        *,
        tasks: TaskSources = TaskSources(),
        min_gain: float = 0.1,
        patience: int = 3,
    ):
        self.manifest = manifest
        self.costs = manifest_costs(manifest)
        self.config = manifest_plan_config(manifest)
        self.demand = rl_demand(manifest, tasks)
        self.rebalancer = RoleRebalancer(RebalanceConfig(min_gain=min_gain, patience=patience))

    def check(self, me: str, records: Iterable[PeerRecord]) -> str | None:
        """The role to take now ('stage' or 'rollout'), or None (stay)."""
        view = RoleView(self.manifest, records)
        if me not in view.movable:
            return self.rebalancer.observe(me, None)
        move = best_role_move(
            view.plan, view.rollouts, self.costs, view.peers, self.config, self.demand, view.movable
        )
        return self.rebalancer.observe(me, move)
