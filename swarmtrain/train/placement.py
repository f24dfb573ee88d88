"""Placement: from a model and measured peers to stages. The bridge between tracing a
model's costs (`swarmtrain.model.tracing`, torch) and the pure planner in `swarmtrain.plan`;
the stage peers and the launchers in `swarmtrain.peers` call it."""

from __future__ import annotations

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.model.tracing import block_costs
from swarmtrain.plan import BlockCost, PeerCapacity, Plan, PlanConfig, plan_swarm
from swarmtrain.wire.records import PeerRecord, RunManifest

LOOPBACK_BYTES_PER_S = 500 * 2**20
"""Bandwidth assumed between peers of one machine (hivemind binary streams on loopback)."""


def planner_costs(
    model: str, model_config: dict, *, microbatch_size: int, optimizer: str = "adamw"
) -> list[BlockCost]:
    """Per-block costs of the traced model, as the planner's `BlockCost`s."""
    return [
        BlockCost(
            flops_per_token=r.flops_per_token,
            weight_bytes=r.weight_bytes,
            grad_bytes=r.grad_bytes,
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


def capacity_of(record) -> PeerCapacity:
    """A peer's announced capacity (its start-up probe) as the planner's PeerCapacity."""
    cap = record.capacity or {}
    return PeerCapacity(
        peer_id=record.peer_id,
        flops_per_s=float(cap.get("flops_per_s", 1e9)),
        memory_bytes=float(cap.get("memory_bytes", 2**34)),
        bandwidth_bytes_per_s=float(cap.get("bandwidth_bytes_per_s", LOOPBACK_BYTES_PER_S)),
        is_spot=bool(cap.get("is_spot", False)),
    )


class StageRebalancer:
    """Decide, check by check, whether this stage peer should move to another stage.

    Every replica of a stage computes the same thing from the same DHT snapshot: the one
    whose move would raise predicted swarm throughput most (ties: lowest peer id) is the
    only candidate, so replicas never leave a stage in a herd; the pure `Rebalancer` then
    requires the gain to clear `min_gain` for `patience` consecutive checks, and never
    takes a stage's last replica.
    """

    def __init__(self, manifest, *, min_gain: float = 0.1, patience: int = 3):
        from swarmtrain.plan import RebalanceConfig, Rebalancer

        meta = build_model(manifest.model, manifest.model_config, device="meta")
        tokens_per_sample = meta.input_shape[0] if meta.input_shape else 1
        batch = manifest.batch
        self.manifest = manifest
        self.config = PlanConfig(
            tokens_in_flight=tokens_per_sample * batch.microbatch_size * batch.max_in_flight,
            tokens_per_step=tokens_per_sample * batch.microbatch_size * batch.microbatches_per_step,
        )
        self.costs = planner_costs(
            manifest.model,
            manifest.model_config,
            microbatch_size=batch.microbatch_size,
            optimizer=manifest.optimizer.name,
        )
        self.rebalancer = Rebalancer(RebalanceConfig(min_gain=min_gain, patience=patience))

    def check(self, me: str, records) -> int | None:
        """The stage to move to now, or None (stay). `records` are the run's peer records."""
        from swarmtrain.plan import best_move

        serving = [r for r in records if r.role == "stage" and r.state == "serving"]
        if me not in {r.peer_id for r in serving}:
            return None
        num_stages = self.manifest.num_stages
        plan = Plan(
            stage_bounds=self.manifest.stage_bounds,
            assignments={r.peer_id: r.stage for r in serving},
            trainers=(),
            throughput_tokens_per_s=0.0,
            stage_tokens_per_s=(0.0,) * num_stages,
        )
        if not plan.is_complete:
            return None
        peers = [capacity_of(r) for r in serving]
        here = plan.assignments[me]
        candidates = [best_move(plan, self.costs, peers, self.config, p) for p in sorted(plan.replicas(here))]
        candidates = [c for c in candidates if c is not None]
        best = min(candidates, key=lambda c: (-c.moved_tokens_per_s, c.peer_id), default=None)
        move = self.rebalancer.observe(me, best if best is not None and best.peer_id == me else None)
        return None if move is None else move.to_stage


def plan_emulated_peers(
    model: str,
    model_config: dict,
    slowdowns: list[float] | tuple[float, ...],
    batch,
    *,
    flops_per_s: float,
    memory_bytes: float,
) -> tuple[Plan, list[list[float]]]:
    """Plan for peers on this machine that pose as slower devices with `--slowdown F`.

    `flops_per_s` and `memory_bytes` are this machine's, as its probe measured them; peer i
    gets the flops divided by slowdowns[i] and an equal share of the memory. Returns the plan
    and, for each stage, the slowdowns of its peers (peers the plan leaves out are in
    `plan.trainers`, named 'peer{i}').
    """
    peers = [
        PeerCapacity(
            peer_id=f"peer{i}",
            flops_per_s=flops_per_s / slowdown,
            memory_bytes=memory_bytes / len(slowdowns),
            bandwidth_bytes_per_s=LOOPBACK_BYTES_PER_S,
        )
        for i, slowdown in enumerate(slowdowns)
    ]
    plan = plan_for_peers(
        model,
        model_config,
        peers,
        microbatch_size=batch.microbatch_size,
        max_in_flight=batch.max_in_flight,
        microbatches_per_step=batch.microbatches_per_step,
    )
    stages: list[list[float]] = [[] for _ in range(plan.num_stages)]
    for peer_id, stage in sorted(plan.assignments.items()):
        stages[stage].append(slowdowns[int(peer_id.removeprefix("peer"))])
    return plan, stages


def choose_stage(manifest: RunManifest, records: list[PeerRecord], fits: list[bool] | None = None) -> int:
    """The stage that needs a peer most: the lowest measured compute per block among the
    stages this peer fits (a stage with no peer first), the lowest index among ties."""
    fits = fits or [True] * manifest.num_stages
    flops = [0.0] * manifest.num_stages
    counts = [0] * manifest.num_stages
    for r in records:
        if r.role == "stage" and 0 <= r.stage < manifest.num_stages and r.state != "draining":
            counts[r.stage] += 1
            flops[r.stage] += float(r.capacity.get("flops_per_s", 1.0))
    candidates = [k for k in range(manifest.num_stages) if fits[k]]
    if not candidates:
        raise ConfigError("this peer's --max-memory fits no stage of the run: raise it, or train instead")

    def need(k: int) -> tuple:
        start, end = manifest.stage_span(k)
        return (counts[k] > 0, flops[k] / (end - start), counts[k], k)

    return min(candidates, key=need)


def stage_memory_figures(manifest: RunManifest) -> list[tuple[int, int]]:
    """Per stage: (bytes of weights, gradients and optimizer state; activation bytes one
    microbatch holds from its forward to its backward)."""
    costs = block_costs(
        manifest.model,
        manifest.model_config,
        microbatch_size=manifest.batch.microbatch_size,
        optimizer=manifest.optimizer.name,
    )
    model = build_model(manifest.model, manifest.model_config, device="meta")
    tokens_per_sample = model.input_shape[0] if model.input_shape else 1  # (T,) for token models
    tokens = tokens_per_sample * manifest.batch.microbatch_size
    out = []
    for k in range(manifest.num_stages):
        start, end = manifest.stage_span(k)
        blocks = costs[start:end]
        out.append(
            (
                sum(c.state_bytes for c in blocks),
                int(tokens * sum(c.activation_bytes_per_token for c in blocks)),
            )
        )
    return out
