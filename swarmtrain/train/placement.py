"""Placement: from a model and measured peers to stages. The bridge between tracing a
model's costs (`swarmtrain.model.tracing`, torch) and the pure planner in `swarmtrain.plan`;
the stage peers and the launchers in `swarmtrain.peers` call it."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model
from swarmtrain.model.tracing import block_costs
from swarmtrain.plan import BlockCost, PeerCapacity, Plan, PlanConfig, evaluate, plan_swarm, serving_stage
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
    tokens_per_sample = sample_positions(model, model_config)
    config = PlanConfig(
        tokens_in_flight=tokens_per_sample * microbatch_size * max_in_flight,
        tokens_per_step=tokens_per_sample * microbatch_size * microbatches_per_step,
        max_stages=max_stages,
    )
    costs = planner_costs(model, model_config, microbatch_size=microbatch_size)
    return plan_swarm(costs, peers, config)


def sample_positions(model: str, model_config: dict) -> int:
    """Positions one sample puts through the pipeline: the model's sequence length (1 for a
    model whose input has no positions)."""
    meta = build_model(model, model_config, device="meta")
    return meta.input_shape[0] if meta.input_shape else 1  # (T,) for token models


def manifest_costs(manifest: RunManifest) -> list[BlockCost]:
    """The run's per-block costs for the planner: its model traced at its microbatch size."""
    return planner_costs(
        manifest.model,
        manifest.model_config,
        microbatch_size=manifest.batch.microbatch_size,
        optimizer=manifest.optimizer.name,
    )


def manifest_plan_config(manifest: RunManifest, records: Iterable[PeerRecord] = ()) -> PlanConfig:
    """How the planner models the run: the tokens a stage holds in flight and the tokens of
    one optimizer step (over which replicas average), from the manifest's batch settings; and
    what averaging costs a step, as the serving replicas among `records` measured it (the
    median of their `exchange_s`), else the cost model's default."""
    tokens = sample_positions(manifest.model, manifest.model_config) * manifest.batch.microbatch_size
    measured = [
        r.exchange_s for r in records if r.role == "stage" and r.state == "serving" and r.exchange_s > 0
    ]
    return PlanConfig(
        tokens_in_flight=tokens * manifest.batch.max_in_flight,
        tokens_per_step=tokens * manifest.batch.microbatches_per_step,
        **({"averaging_overhead_s": statistics.median(measured)} if measured else {}),
    )


def peer_capacity(peer_id: str, capacity: Mapping[str, Any] | None) -> PeerCapacity:
    """A capacity dict (the keys of `PeerRecord.capacity`: flops_per_s, block_flops_per_s,
    memory_bytes, bandwidth_bytes_per_s, is_spot, decode_tokens_per_s) as the planner's
    PeerCapacity. Its FLOP/s is the rate measured on a block of the run's model where the peer
    announced one (`self_measure.block_capacity`), else the matmul probe's; missing keys take a
    modest default (1 GFLOP/s, 16 GiB, loopback bandwidth, not spot, no sampling)."""
    cap = capacity or {}
    return PeerCapacity(
        peer_id=peer_id,
        flops_per_s=float(cap.get("block_flops_per_s") or cap.get("flops_per_s", 1e9)),
        memory_bytes=float(cap.get("memory_bytes", 2**34)),
        bandwidth_bytes_per_s=float(cap.get("bandwidth_bytes_per_s", LOOPBACK_BYTES_PER_S)),
        is_spot=bool(cap.get("is_spot", False)),
        decode_tokens_per_s=float(cap.get("decode_tokens_per_s", 0.0)),
    )


def capacity_of(record: PeerRecord) -> PeerCapacity:
    """A peer's announced capacity (its start-up probe) as the planner's PeerCapacity."""
    return peer_capacity(record.peer_id, record.capacity)


def layout_plan(manifest: RunManifest, records: Iterable[PeerRecord]) -> Plan:
    """The run's current layout as a plan: the manifest's stage bounds, each of `records`
    (stage peers, their stages in range) on its stage; no predicted rates."""
    return Plan(
        stage_bounds=manifest.stage_bounds,
        assignments={r.peer_id: r.stage for r in records},
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0,) * manifest.num_stages,
    )


def live_stage_peers(manifest: RunManifest, records: Iterable[PeerRecord]) -> list[PeerRecord]:
    """The serving stage peers of `records` on stages the manifest has."""
    return [
        r
        for r in records
        if r.role == "stage" and 0 <= r.stage < manifest.num_stages and r.state == "serving"
    ]


def live_capacities(
    manifest: RunManifest, live: Iterable[PeerRecord], costs: Sequence[BlockCost]
) -> list[PeerCapacity]:
    """The planner's view of serving stage peers: a replica that served at its measured compute
    seconds per microbatch (`service_s`, as the FLOP/s at which its stage's FLOPs take that
    long), one that did not yet at its announced capacity (`capacity_of`). ValueError or
    TypeError for a capacity that does not parse."""
    tokens = sample_positions(manifest.model, manifest.model_config) * manifest.batch.microbatch_size
    peers = []
    for r in live:
        cap = capacity_of(r)
        if r.service_s > 0:  # flops/s at which the stage's FLOPs take the measured seconds
            start, end = manifest.stage_span(r.stage)
            flops = tokens * sum(c.flops_per_token for c in costs[start:end])
            cap = dataclasses.replace(cap, flops_per_s=flops / r.service_s)
        peers.append(cap)
    return peers


def layout_prediction(
    manifest: RunManifest, records: Iterable[PeerRecord], costs: Sequence[BlockCost] | None = None
) -> dict | None:
    """What the planner's cost model predicts for the run's live layout (`evaluate` on its
    serving stage peers): `steady_tokens_per_s`, the pipeline's rate with every stage busy, and
    `predicted_tokens_per_s`, what a step achieves once the pipeline fills and drains around
    its microbatches. Each replica counts at its best measured rate. A
    replica that served counts at its measured compute seconds per microbatch (`service_s`:
    forward and backward of its stage as it runs there, sharing the machine with whatever else
    does); one that did not yet at its announced capacity: a rate timed on a block of the run's
    model at join (`calibrated_peers`), else its matmul probe's, which small kernels do not
    reach. `measured_peers` counts the first kind, `stage_peers` all. None while a stage has no
    serving replica. `costs`: `manifest_costs(manifest)`, if the caller keeps it."""
    live = live_stage_peers(manifest, records)
    if {r.stage for r in live} != set(range(manifest.num_stages)):
        return None
    costs = manifest_costs(manifest) if costs is None else costs
    tokens = sample_positions(manifest.model, manifest.model_config) * manifest.batch.microbatch_size
    try:
        peers = live_capacities(manifest, live, costs)
        evaluation = evaluate(layout_plan(manifest, live), costs, peers, manifest_plan_config(manifest, live))
    except (ConfigError, TypeError, ValueError):  # a capacity that does not parse
        return None
    # A step's microbatches fill the pipeline and drain it (GPipe's bubble): one microbatch
    # crosses every stage (on one replica each), the other M - 1 follow at the slowest stage's pace.
    rates = evaluation.stage_tokens_per_s
    if min(rates) <= 0:
        return None
    replicas = [sum(1 for r in live if r.stage == k) for k in range(manifest.num_stages)]
    M = manifest.batch.microbatches_per_step
    step_s = sum(n * tokens / rate for n, rate in zip(replicas, rates, strict=True))
    step_s += (M - 1) * tokens / min(rates)
    return {
        "predicted_tokens_per_s": M * tokens / step_s,
        "steady_tokens_per_s": evaluation.throughput_tokens_per_s,
        "measured_peers": sum(1 for r in live if r.service_s > 0),
        "calibrated_peers": sum(1 for r in live if r.capacity.get("block_flops_per_s")),
        "stage_peers": len(live),
    }


class StageRebalancer:
    """Decide, check by check, whether this stage peer should move to another stage.

    Every replica of a stage computes the same thing from the same DHT snapshot: the one
    whose move would raise predicted swarm throughput most (ties: lowest peer id) is the
    only candidate, so replicas never leave a stage in a herd; the pure `Rebalancer` then
    requires the gain to clear `min_gain` for `patience` consecutive checks, and never
    takes a stage's last replica. A stage nobody serves (peers that joined at once all took
    the same one) is filled at the first check by the newest replica of a stage that has two.
    """

    def __init__(self, manifest, *, min_gain: float = 0.1, patience: int = 3):
        from swarmtrain.plan import RebalanceConfig, Rebalancer

        self.manifest = manifest
        self.config = manifest_plan_config(manifest)
        self.costs = manifest_costs(manifest)
        self.rebalancer = Rebalancer(RebalanceConfig(min_gain=min_gain, patience=patience))

    def check(self, me: str, records) -> int | None:
        """The stage to move to now, or None (stay). `records` are the run's peer records."""
        from swarmtrain.plan import best_move

        serving = [r for r in records if r.role == "stage" and r.state == "serving"]
        if me not in {r.peer_id for r in serving}:
            return None
        unserved = [k for k in range(self.manifest.num_stages) if not any(r.stage == k for r in serving)]
        if unserved:  # peers that joined at once all took the same stage: the newest spare one fills a gap
            here = next(r.stage for r in serving if r.peer_id == me)
            mine = sorted((r for r in serving if r.stage == here), key=lambda r: (r.since, r.peer_id))
            return unserved[0] if len(mine) >= 2 and mine[-1].peer_id == me else None
        plan = layout_plan(self.manifest, serving)
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


JOINING_PEER_ID = "joining-peer"
"""Stands for the joining peer in its own plan when `choose_stage` is not told its id."""


def choose_stage(
    manifest: RunManifest,
    records: Iterable[PeerRecord],
    fits: Sequence[bool] | None = None,
    capacity: Mapping[str, Any] | None = None,
    *,
    peer_id: str | None = None,
) -> int:
    """The stage a stage peer started without one takes when it joins the run.

    The pure rule `swarmtrain.plan.serving_stage` on the run as `records` show it: the
    manifest's stages, replicated by every stage peer that is joining or serving (draining
    peers are leaving; records of `peer_id` are this peer's own, from an earlier life); costs
    traced from the manifest's model, and the planner configured from its batch as the
    rebalancer is. So: a stage with no live replica first (lowest index), else the planner's
    `join_stage`, else the stage with the lowest predicted rate per replica. `fits[k]`: this
    peer has the memory for stage k (None: every stage); it never takes another. `capacity`:
    this peer's own, as its record will announce it (see `peer_capacity` for the keys).
    Raises ConfigError when it fits no stage.
    """
    num_stages = manifest.num_stages
    fits = [True] * num_stages if fits is None else list(fits)
    if len(fits) != num_stages:
        raise ConfigError(
            f"fits has {len(fits)} entries for a run of {num_stages} stages: give one per stage"
        )
    if not any(fits):
        raise ConfigError("this peer's --max-memory fits no stage of the run: raise it, or train instead")
    live = [
        r
        for r in records
        if r.role == "stage" and 0 <= r.stage < num_stages and r.state != "draining" and r.peer_id != peer_id
    ]
    return serving_stage(
        layout_plan(manifest, live),
        manifest_costs(manifest),
        [capacity_of(r) for r in live],
        manifest_plan_config(manifest),
        peer_capacity(peer_id or JOINING_PEER_ID, capacity),
        fits,
    )


def stage_memory_figures(manifest: RunManifest) -> list[tuple[int, int]]:
    """Per stage: (bytes of weights, gradients and optimizer state; activation bytes one
    microbatch holds from its forward to its backward)."""
    costs = block_costs(
        manifest.model,
        manifest.model_config,
        microbatch_size=manifest.batch.microbatch_size,
        optimizer=manifest.optimizer.name,
    )
    tokens = sample_positions(manifest.model, manifest.model_config) * manifest.batch.microbatch_size
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


def stages_that_fit(
    manifest: RunManifest, memory: Sequence[tuple[int, int]], max_memory_bytes: float | None
) -> list[bool]:
    """Which stages a peer with `max_memory_bytes` holds (None: any): a stage's state and
    `max_in_flight` microbatches of its activations (`memory`: `stage_memory_figures`)."""
    if max_memory_bytes is None:
        return [True] * manifest.num_stages
    return [state + manifest.batch.max_in_flight * act <= max_memory_bytes for state, act in memory]
