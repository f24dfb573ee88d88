"""Which stage a joining stage peer takes: the pure rule (`swarmtrain.plan.serving_stage`) on
hand-built plans, then `placement.choose_stage`, which feeds it a run's manifest and records."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.errors import ConfigError
from swarmtrain.plan import BlockCost, PeerCapacity, Plan, PlanConfig, evaluate, join_stage, serving_stage
from swarmtrain.train.placement import (
    choose_stage,
    layout_plan,
    manifest_costs,
    manifest_plan_config,
    peer_capacity,
)
from swarmtrain.wire.records import BatchConfig, PeerRecord, RunManifest
from tests.conftest import TINY_GPT

CONFIG = PlanConfig(tokens_in_flight=1, memory_headroom=0.0)


def block(flops=1.0, grad=0.0, memory=0.0) -> BlockCost:
    return BlockCost(
        flops_per_token=flops,
        weight_bytes=memory,
        grad_bytes=grad,
        optimizer_bytes=0.0,
        activation_bytes_per_token=0.0,
        boundary_bytes_per_token=0.0,
    )


def peer(peer_id, flops=1.0, memory=1e18, bandwidth=1e18) -> PeerCapacity:
    return PeerCapacity(
        peer_id=peer_id, flops_per_s=flops, memory_bytes=memory, bandwidth_bytes_per_s=bandwidth
    )


def plan_of(bounds, assignments) -> Plan:
    num_stages = len(bounds) - 1
    return Plan(
        stage_bounds=tuple(bounds),
        assignments=dict(assignments),
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0,) * num_stages,
    )


# the pure rule


def test_an_empty_stage_comes_first_lowest_index_first_among_those_the_peer_fits():
    costs = [block()] * 3
    peers = [peer("a", flops=100)]
    plan = plan_of((0, 1, 2, 3), {"a": 1})
    new = peer("new")
    assert serving_stage(plan, costs, peers, CONFIG, new) == 0
    assert serving_stage(plan, costs, peers, CONFIG, new, fits=[False, True, True]) == 2
    # stage 1 is the only one it fits: it joins it, though stages 0 and 2 have no replica
    assert serving_stage(plan, costs, peers, CONFIG, new, fits=[False, True, False]) == 1


def test_a_peer_never_takes_a_stage_it_does_not_fit():
    # Stage 1 is the bottleneck (1 token/s against 4), which join_stage fills...
    costs = [block(memory=1), block(memory=3)]
    peers = [peer("a", flops=4), peer("b", flops=1)]
    plan = plan_of((0, 1, 2), {"a": 0, "b": 1})
    assert join_stage(plan, costs, peers, CONFIG, peer("big", memory=3)) == 1
    assert serving_stage(plan, costs, peers, CONFIG, peer("big", memory=3)) == 1
    # ...unless the peer has the memory for stage 0 only: by the planner's memory model,
    assert serving_stage(plan, costs, peers, CONFIG, peer("small", memory=1)) == 0
    # or as the caller says (its own measure, e.g. --max-memory).
    assert serving_stage(plan, costs, peers, CONFIG, peer("big", memory=3), fits=[True, False]) == 0
    with pytest.raises(ConfigError, match="has the memory for no stage"):
        serving_stage(plan, costs, peers, CONFIG, peer("tiny", memory=0.5))
    with pytest.raises(ConfigError, match="has the memory for no stage"):
        serving_stage(plan, costs, peers, CONFIG, peer("big", memory=3), fits=[False, False])
    with pytest.raises(ConfigError, match="fits has 1 entries for a plan of 2 stages"):
        serving_stage(plan, costs, peers, CONFIG, peer("big", memory=3), fits=[True])
    with pytest.raises(ConfigError, match="already replicates stage 1"):
        serving_stage(plan, costs, peers, CONFIG, peers[1])


def test_when_join_stage_says_none_the_peer_takes_the_lowest_rate_per_replica():
    # Every replica averages over 1 byte/s links, 100 tokens per step, no fixed overhead.
    # Stage 0: 'a' at 0.5 tokens/s, alone. Stage 1: 'b' and 'c' at 8 tokens/s each, averaging
    # 2 x 100 x 1/2 = 100 s a step: 16 / (1 + 16) ~ 0.94 tokens/s, 0.47 per replica. A third
    # replica of stage 1 averages 133 s: 24 / 33 ~ 0.73; a second of stage 0 averages its 1000
    # gradient bytes for 1000 s: 8.5 / 86 ~ 0.1. Both slower, so join_stage says None.
    costs = [block(grad=1000), block(grad=100)]
    config = PlanConfig(
        tokens_in_flight=1, memory_headroom=0.0, tokens_per_step=100, averaging_overhead_s=0.0
    )
    peers = [
        peer("a", flops=0.5, bandwidth=1),
        peer("b", flops=8, bandwidth=1),
        peer("c", flops=8, bandwidth=1),
    ]
    plan = plan_of((0, 1, 2), {"a": 0, "b": 1, "c": 1})
    new = peer("new", flops=8, bandwidth=1)
    totals = evaluate(plan, costs, peers, config).stage_tokens_per_s
    assert totals[0] == 0.5 and totals[1] == pytest.approx(16 / 17)
    assert join_stage(plan, costs, peers, config, new) is None
    # The lowest rate per replica is stage 1's (0.47 < 0.5), though stage 0 is the slower stage.
    assert serving_stage(plan, costs, peers, config, new) == 1
    assert serving_stage(plan, costs, peers, config, new, fits=[True, False]) == 0


@st.composite
def running_plans(draw):
    """A complete plan of 1-4 stages over 1-6 blocks, with 1-6 replicas, and a joining peer."""
    num_blocks = draw(st.integers(1, 6))
    costs = [
        BlockCost(
            flops_per_token=draw(st.integers(1, 10)),
            weight_bytes=draw(st.integers(0, 10)),
            grad_bytes=draw(st.integers(0, 10)),
            optimizer_bytes=draw(st.integers(0, 10)),
            activation_bytes_per_token=draw(st.integers(0, 3)),
            boundary_bytes_per_token=draw(st.integers(0, 5)),
        )
        for _ in range(num_blocks)
    ]
    num_stages = draw(st.integers(1, min(4, num_blocks)))
    cuts = sorted(draw(st.permutations(range(1, num_blocks)))[: num_stages - 1])
    bounds = (0, *cuts, num_blocks)
    count = draw(st.integers(num_stages, 6))
    stages = list(range(num_stages)) + draw(
        st.lists(st.integers(0, num_stages - 1), min_size=count - num_stages, max_size=count - num_stages)
    )
    peers = [
        peer(f"p{i}", flops=draw(st.integers(1, 100)), bandwidth=draw(st.integers(1, 100)))
        for i in range(count)
    ]
    new = peer(
        "new",
        flops=draw(st.integers(1, 100)),
        memory=draw(st.integers(0, 80)),
        bandwidth=draw(st.integers(1, 100)),
    )
    config = PlanConfig(
        tokens_in_flight=draw(st.integers(1, 4)),
        memory_headroom=0.0,
        tokens_per_step=draw(st.sampled_from([None, 10, 100, 1000])),
    )
    return plan_of(bounds, {p.peer_id: s for p, s in zip(peers, stages)}), costs, peers, config, new


@settings(max_examples=60, deadline=None)
@given(running_plans(), st.data())
def test_serving_stage_agrees_with_join_stage_and_fits(case, data):
    plan, costs, peers, config, new = case
    fits = data.draw(st.lists(st.booleans(), min_size=plan.num_stages, max_size=plan.num_stages))
    if not any(fits):
        with pytest.raises(ConfigError):
            serving_stage(plan, costs, peers, config, new, fits)
        return
    stage = serving_stage(plan, costs, peers, config, new, fits)
    assert fits[stage]
    joined = join_stage(plan, costs, peers, config, new)
    if joined is not None and fits[joined]:
        assert stage == joined  # the planner's rule wherever it has an answer the peer can take
    else:
        totals = evaluate(plan, costs, peers, config).stage_tokens_per_s
        per_replica = [totals[k] / len(plan.replicas(k)) for k in range(plan.num_stages)]
        assert per_replica[stage] == min(per_replica[k] for k in range(plan.num_stages) if fits[k])


# choose_stage: the rule fed from a run's manifest and peer records

MANIFEST = RunManifest(
    run_id="join",
    model="tiny-gpt",
    model_config=TINY_GPT,
    num_blocks=4,
    stage_bounds=(0, 1, 3, 4),
    batch=BatchConfig(microbatch_size=2, microbatches_per_step=4, max_in_flight=2),
)
CAPACITY = {"flops_per_s": 4e9, "memory_bytes": 2**33, "bandwidth_bytes_per_s": 2**30, "is_spot": False}


def stage_peer(peer_id, stage, flops=1e9, state="serving") -> PeerRecord:
    capacity = {**CAPACITY, "flops_per_s": flops}
    return PeerRecord(peer_id=peer_id, role="stage", stage=stage, state=state, capacity=capacity)


def test_choose_stage_takes_the_first_stage_without_a_live_replica():
    others = [PeerRecord(peer_id="trainer", role="trainer"), PeerRecord(peer_id="coord", role="coordinator")]
    assert choose_stage(MANIFEST, others, capacity=CAPACITY) == 0
    records = [stage_peer("a", 0), stage_peer("b", 1, state="joining")]
    assert choose_stage(MANIFEST, records, capacity=CAPACITY) == 2
    # a draining replica is leaving: its stage counts as empty
    records = [stage_peer("a", 0), stage_peer("b", 1, state="draining"), stage_peer("c", 2)]
    assert choose_stage(MANIFEST, records, capacity=CAPACITY) == 1
    # this peer's own record, from an earlier life, does not count either
    records = [stage_peer("a", 0), stage_peer("me", 1), stage_peer("c", 2)]
    assert choose_stage(MANIFEST, records, capacity=CAPACITY, peer_id="me") == 1


def test_choose_stage_follows_join_stage_on_a_running_swarm():
    # Peers of about a MFLOP/s: a step's compute (seconds) outweighs averaging, so replicas help.
    me = {**CAPACITY, "flops_per_s": 1e6}
    records = [stage_peer("a", 0, flops=1e6), stage_peer("b", 1, flops=2e6), stage_peer("c", 2, flops=3e5)]
    plan = layout_plan(MANIFEST, records)
    costs, config = manifest_costs(MANIFEST), manifest_plan_config(MANIFEST)
    peers = [peer_capacity(r.peer_id, r.capacity) for r in records]
    expected = join_stage(plan, costs, peers, config, peer_capacity("me", me))
    assert expected == 2  # the bottleneck
    assert choose_stage(MANIFEST, records, capacity=me, peer_id="me") == expected
    # where --max-memory rules that stage out, the slowest stage per replica it fits
    fits = [True, True, False]
    totals = evaluate(plan, costs, peers, config).stage_tokens_per_s
    slowest = min((0, 1), key=lambda k: (totals[k], k))
    assert choose_stage(MANIFEST, records, fits, me, peer_id="me") == slowest


def test_the_averaging_overhead_is_what_the_serving_replicas_measured():
    default = manifest_plan_config(MANIFEST).averaging_overhead_s
    records = [
        dataclasses.replace(stage_peer("a", 0), exchange_s=0.02),
        dataclasses.replace(stage_peer("b", 0), exchange_s=0.04),
        dataclasses.replace(stage_peer("c", 0), exchange_s=0.3),
        dataclasses.replace(stage_peer("d", 1, state="joining"), exchange_s=9.0),  # not serving
        stage_peer("e", 1),  # never exchanged
    ]
    assert manifest_plan_config(MANIFEST, records).averaging_overhead_s == 0.04  # the median
    assert manifest_plan_config(MANIFEST, records[3:]).averaging_overhead_s == default == 0.75


def test_choose_stage_serves_the_slowest_stage_when_any_replica_would_slow_the_run():
    # Peers of GFLOP/s finish a 128-token step in milliseconds, and averaging takes 0.75 s a
    # step (more over stage 1's 1 MB/s links): join_stage sends a new peer nowhere, so a stage
    # peer takes the slowest stage per replica, stage 1.
    slow_link = {**CAPACITY, "bandwidth_bytes_per_s": 1e6}
    records = [
        stage_peer("a", 0),
        PeerRecord(peer_id="b", role="stage", stage=1, capacity=slow_link),
        PeerRecord(peer_id="b2", role="stage", stage=1, capacity=slow_link),
        stage_peer("c", 2, flops=2e9),
    ]
    plan = layout_plan(MANIFEST, records)
    costs, config = manifest_costs(MANIFEST), manifest_plan_config(MANIFEST)
    peers = [peer_capacity(r.peer_id, r.capacity) for r in records]
    assert join_stage(plan, costs, peers, config, peer_capacity("me", CAPACITY)) is None
    totals = evaluate(plan, costs, peers, config).stage_tokens_per_s
    assert totals[1] / 2 < min(totals[0], totals[2])
    assert choose_stage(MANIFEST, records, capacity=CAPACITY, peer_id="me") == 1


def test_choose_stage_says_when_the_peer_fits_no_stage():
    with pytest.raises(
        ConfigError, match="--max-memory fits no stage of the run: raise it, or train instead"
    ):
        choose_stage(MANIFEST, [stage_peer("a", 0)], [False, False, False], CAPACITY)
    with pytest.raises(ConfigError, match="fits has 2 entries for a run of 3 stages"):
        choose_stage(MANIFEST, [], [True, True], CAPACITY)


def test_peers_that_joined_at_once_on_one_stage_spread_to_the_stages_nobody_serves():
    from dataclasses import replace

    from swarmtrain.train.placement import StageRebalancer

    rebalancer = StageRebalancer(MANIFEST)
    a, b, c = (replace(stage_peer(p, 0), since=t) for p, t in (("a", 1.0), ("b", 2.0), ("c", 2.0)))
    records = [a, b, c]
    # the newest spare replica of stage 0 (latest since, then highest id) goes at the first check
    assert [rebalancer.check(p, records) for p in ("a", "b", "c")] == [None, None, 1]
    # the last replica of a stage never leaves it, even for a stage nobody serves
    assert rebalancer.check("a", [a]) is None


def test_a_rate_timed_on_a_block_of_the_runs_model_wins_over_the_matmul_probe():
    from swarmtrain.peers.self_measure import block_capacity

    timed = block_capacity(MANIFEST, "cpu")
    assert timed["block_flops_per_s"] > 0 and timed["block_seconds"] > 0
    slowed = block_capacity(MANIFEST, "cpu", slowdown=4.0)
    # rate x seconds is the block's traced FLOPs, whatever the timing; a 4x slower machine
    # announces a quarter of its measured rate (well under the unslowed one, timing noise aside)
    flops = timed["block_flops_per_s"] * timed["block_seconds"]
    assert slowed["block_flops_per_s"] * slowed["block_seconds"] == pytest.approx(flops)
    assert slowed["block_flops_per_s"] < timed["block_flops_per_s"]
    assert peer_capacity("p", {**CAPACITY, **timed}).flops_per_s == timed["block_flops_per_s"]
    assert peer_capacity("p", CAPACITY).flops_per_s == CAPACITY["flops_per_s"]
    assert peer_capacity("p", {**CAPACITY, "block_flops_per_s": None}).flops_per_s == CAPACITY["flops_per_s"]
