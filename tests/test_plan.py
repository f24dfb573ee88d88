"""Planner (pure): hand-computed cases, then properties on random swarms.

Costs and capacities are drawn as integers so sums are exact and the brute force below,
written from the model's formulas rather than from `CostModel`, agrees on what fits. With
`tokens_per_step` set, stages pay for averaging their gradients: the brute force computes a
stage's rate as tokens_per_step / (tokens_per_step / r_sum + averaging time).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.errors import ConfigError
from swarmtrain.plan import (
    BlockCost,
    CostModel,
    MoveCandidate,
    PeerCapacity,
    Plan,
    PlanConfig,
    RebalanceConfig,
    Rebalancer,
    best_move,
    evaluate,
    even_split_plan,
    join_stage,
    plan_swarm,
    should_move,
    transformer_block_cost,
)

# helpers


def block(flops=1.0, weights_and_grads=0.0, optimizer=0.0, activation=0.0, boundary=0.0) -> BlockCost:
    """A block whose weights and gradients are the same size, together `weights_and_grads` bytes."""
    return BlockCost(
        flops_per_token=flops,
        weight_bytes=weights_and_grads / 2,
        grad_bytes=weights_and_grads / 2,
        optimizer_bytes=optimizer,
        activation_bytes_per_token=activation,
        boundary_bytes_per_token=boundary,
    )


def peer(peer_id, flops=1.0, memory=1e18, bandwidth=1e18, is_spot=False) -> PeerCapacity:
    return PeerCapacity(
        peer_id=peer_id,
        flops_per_s=flops,
        memory_bytes=memory,
        bandwidth_bytes_per_s=bandwidth,
        is_spot=is_spot,
    )


CONFIG = PlanConfig(tokens_in_flight=1, memory_headroom=0.0)


def step_rate(config, rate_sum, replicas, min_bandwidth, grad_bytes) -> float:
    """A stage's tokens/s: one optimizer step's tokens over its compute plus averaging time."""
    if replicas == 0:
        return 0.0
    if config.tokens_per_step is None or replicas == 1:
        return rate_sum
    averaging = config.averaging_overhead_s + 2 * grad_bytes * (replicas - 1) / replicas / min_bandwidth
    return config.tokens_per_step / (config.tokens_per_step / rate_sum + averaging)


def brute_force(costs, peers, config) -> float:
    """Best throughput over every stage count, cut and peer -> stage-or-trainer assignment."""
    n, t = len(costs), config.tokens_in_flight

    def stage(i, j):
        flops = sum(c.flops_per_token for c in costs[i:j])
        memory = sum(
            c.weight_bytes + c.grad_bytes + c.optimizer_bytes + c.activation_bytes_per_token * t
            for c in costs[i:j]
        )
        inbound = costs[i - 1].boundary_bytes_per_token if i > 0 else 0.0
        outbound = costs[j - 1].boundary_bytes_per_token if j < n else 0.0
        return flops, memory, 2.0 * (inbound + outbound)

    def grad_bytes(i, j):
        return sum(c.grad_bytes for c in costs[i:j])

    best = 0.0
    for num_stages in range(1, min(n, len(peers), config.max_stages or n) + 1):
        for cuts in itertools.combinations(range(1, n), num_stages - 1):
            bounds = (0, *cuts, n)
            spans = [stage(bounds[s], bounds[s + 1]) for s in range(num_stages)]
            rates = []  # rates[p][s]: replica rate, or None if p does not fit s
            for p in peers:
                usable = p.memory_bytes * (1.0 - config.memory_headroom)
                row = []
                for flops, memory, traffic in spans:
                    compute = p.flops_per_s / flops
                    rate = compute if traffic == 0 else min(compute, p.bandwidth_bytes_per_s / traffic)
                    row.append(rate if memory <= usable else None)
                rates.append(row)
            options = [[s for s in range(num_stages) if row[s] is not None] + [-1] for row in rates]
            grads = [grad_bytes(bounds[s], bounds[s + 1]) for s in range(num_stages)]
            for choice in itertools.product(*options):
                totals = [0.0] * num_stages
                counts = [0] * num_stages
                links = [math.inf] * num_stages
                for p, s in enumerate(choice):
                    if s >= 0:
                        totals[s] += rates[p][s]
                        counts[s] += 1
                        links[s] = min(links[s], peers[p].bandwidth_bytes_per_s)
                stage_rates = [
                    step_rate(config, totals[s], counts[s], links[s], grads[s]) for s in range(num_stages)
                ]
                best = max(best, min(stage_rates))
    return best


def fits(costs, p: PeerCapacity, config, start, stop) -> bool:
    model = CostModel(costs, config)
    return model.stage_memory(start, stop) <= p.memory_bytes * (1.0 - config.memory_headroom)


# unit tests with hand-computed expectations


def test_cost_model_sums_spans_and_counts_both_boundaries_both_passes():
    costs = [block(2, 10, 20, 1, 4), block(3, 1, 2, 2, 5), block(5, 0, 0, 3, 6)]
    model = CostModel(costs, PlanConfig(tokens_in_flight=10))
    assert model.stage_flops(0, 2) == 5
    assert model.stage_memory(0, 2) == 10 + 20 + 1 + 2 + (1 + 2) * 10
    assert model.stage_traffic(0, 3) == 0  # one stage: nothing crosses the wire
    assert model.stage_traffic(0, 1) == 2 * 4  # out: activation forward, gradient back
    assert model.stage_traffic(1, 2) == 2 * (4 + 5)
    assert model.stage_traffic(2, 3) == 2 * 5
    fast_link = peer("a", flops=30, bandwidth=1e9)
    assert model.replica_rate(fast_link, 1, 2) == 10  # compute-bound: 30 / 3
    slow_link = peer("b", flops=30, bandwidth=36)
    assert model.replica_rate(slow_link, 1, 2) == 2  # network-bound: 36 / 18


def test_transformer_block_cost_formulas():
    d, t = 2048, 1024
    cost = transformer_block_cost(d_model=d, seq_len=t)
    assert cost.flops_per_token == 72 * d * d + 6 * t * d
    assert cost.weight_bytes == cost.grad_bytes == 2 * 12 * d * d  # bf16 weights, bf16 gradients
    assert cost.optimizer_bytes == 12 * 12 * d * d  # fp32 master + Adam m, v
    assert cost.activation_bytes_per_token == 34 * d
    assert cost.boundary_bytes_per_token == d  # 8-bit activations


def test_one_peer_that_fits_everything_gets_one_stage():
    plan = plan_swarm([block(2)] * 3, [peer("solo", flops=12)], CONFIG)
    assert plan.stage_bounds == (0, 3)
    assert plan.assignments == {"solo": 0}
    assert plan.throughput_tokens_per_s == 2.0  # 12 FLOP/s over 6 FLOP/token


def test_unequal_stages_match_unequal_peers():
    # Each peer holds at most 3 of the 4 blocks, so two stages are needed. Even halves give
    # min(3/2, 1/2) = 0.5; three blocks on the 3x faster peer give min(3/3, 1/1) = 1.0.
    costs = [block(1, weights_and_grads=1)] * 4
    peers = [peer("fast", flops=3, memory=3), peer("slow", flops=1, memory=3)]
    plan = plan_swarm(costs, peers, CONFIG)
    assert plan.stage_bounds in ((0, 3, 4), (0, 1, 4))
    assert plan.replicas(0 if plan.stage_bounds == (0, 3, 4) else 1) == ("fast",)
    assert plan.throughput_tokens_per_s == pytest.approx(1.0)
    even = even_split_plan(costs, peers, CONFIG)
    assert even.stage_bounds == (0, 2, 4)
    assert even.throughput_tokens_per_s == pytest.approx(0.5)


def test_network_bound_peers_prefer_the_end_stages():
    # Middle stages move twice the bytes of end stages. Three 1-block stages: the slow-link
    # peer at an end runs at min(1, 8 / (2 * 2)) = 1 token/s, in the middle at only 0.5.
    costs = [block(1, weights_and_grads=1, boundary=2)] * 3
    peers = [
        peer("a", memory=1, bandwidth=8),
        peer("b", memory=1, bandwidth=1e9),
        peer("c", memory=1, bandwidth=8),
    ]
    plan = plan_swarm(costs, peers, CONFIG)
    assert plan.stage_bounds == (0, 1, 2, 3)
    assert plan.assignments["b"] == 1
    assert plan.throughput_tokens_per_s == pytest.approx(1.0)


def test_evaluate_recomputes_rates_and_flags_memory():
    costs = [block(1, weights_and_grads=2)] * 2
    peers = [peer("a", flops=4, memory=2), peer("b", flops=2, memory=2), peer("c", flops=9, memory=1)]
    plan = Plan(
        stage_bounds=(0, 1, 2),
        assignments={"a": 0, "b": 1, "c": 1},
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0, 0.0),
    )
    result = evaluate(plan, costs, peers, CONFIG)
    assert result.stage_tokens_per_s == (4.0, 11.0)
    assert result.throughput_tokens_per_s == 4.0
    assert result.over_memory == ("c",)
    with pytest.raises(ConfigError, match="not among the peers"):
        evaluate(dataclasses.replace(plan, assignments={"z": 0}), costs, peers, CONFIG)
    with pytest.raises(ConfigError, match="must rise strictly"):
        evaluate(dataclasses.replace(plan, stage_bounds=(0, 2, 2)), costs, peers, CONFIG)


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ConfigError, match="flops_per_token"):
        block(flops=0)
    with pytest.raises(ConfigError, match="memory_headroom"):
        PlanConfig(tokens_in_flight=1, memory_headroom=1.0)
    with pytest.raises(ConfigError, match="tokens_in_flight"):
        PlanConfig(tokens_in_flight=0)
    with pytest.raises(ConfigError, match="tokens_per_step"):
        PlanConfig(tokens_in_flight=1, tokens_per_step=0)
    with pytest.raises(ConfigError, match="tokens_per_step"):
        PlanConfig(tokens_in_flight=1, tokens_per_step=1.5)
    with pytest.raises(ConfigError, match="averaging_overhead_s"):
        PlanConfig(tokens_in_flight=1, tokens_per_step=10, averaging_overhead_s=-1)
    with pytest.raises(ConfigError, match="averaging_overhead_s"):
        PlanConfig(tokens_in_flight=1, averaging_overhead_s=math.inf)
    with pytest.raises(ConfigError, match="bandwidth"):
        peer("x", bandwidth=-1)
    with pytest.raises(ConfigError, match="appears twice"):
        plan_swarm([block()], [peer("x"), peer("x")], CONFIG)
    with pytest.raises(ConfigError, match="at least one block"):
        plan_swarm([], [peer("x")], CONFIG)


def test_no_peers_or_no_fit_gives_an_incomplete_zero_plan():
    plan = plan_swarm([block(weights_and_grads=5)] * 2, [peer("tiny", memory=1)], CONFIG)
    assert plan.throughput_tokens_per_s == 0
    assert not plan.is_complete
    assert plan.trainers == ("tiny",)
    assert plan_swarm([block()], [], CONFIG).trainers == ()


def test_the_baseline_cuts_as_the_manifest_splits():
    from swarmtrain.wire.records import even_split

    for num_blocks in range(1, 8):
        for num_stages in range(1, num_blocks + 1):
            plan = even_split_plan([block()] * num_blocks, [peer("a")], CONFIG, num_stages=num_stages)
            assert plan.stage_bounds == even_split(num_blocks, num_stages)


def test_round_robin_skips_peers_that_do_not_fit():
    costs = [block(weights_and_grads=2), block(weights_and_grads=1)]
    peers = [peer("a", memory=2), peer("b", memory=1), peer("c", memory=1), peer("d", memory=0.5)]
    plan = even_split_plan(costs, peers, CONFIG, num_stages=2)
    # a takes stage 0; b takes stage 1; c's turn is stage 0, which it does not fit, so it takes
    # stage 1; d fits neither.
    assert plan.assignments == {"a": 0, "b": 1, "c": 1}
    assert plan.trainers == ("d",)


def test_join_stage_hand_case():
    costs = [block(1, weights_and_grads=1), block(1, weights_and_grads=2)]
    peers = [peer("a", flops=10, memory=1), peer("b", flops=5, memory=2)]
    plan = plan_swarm(costs, peers, CONFIG)
    assert plan.stage_bounds == (0, 1, 2)
    assert plan.stage_tokens_per_s == (10.0, 5.0)
    assert join_stage(plan, costs, peers, CONFIG, peer("big", memory=2)) == 1
    assert join_stage(plan, costs, peers, CONFIG, peer("small", memory=1)) == 0
    assert join_stage(plan, costs, peers, CONFIG, peer("none", memory=0.5)) is None
    with pytest.raises(ConfigError, match="already replicates"):
        join_stage(plan, costs, peers, CONFIG, peers[0])


def test_best_move_and_rebalancer_hand_case():
    costs = [block(1, weights_and_grads=1)] * 2
    peers = [peer("a", flops=1, memory=1), peer("b", flops=6, memory=1), peer("c", flops=6, memory=1)]
    plan = Plan(
        stage_bounds=(0, 1, 2),
        assignments={"a": 0, "b": 1, "c": 1},
        trainers=(),
        throughput_tokens_per_s=1.0,
        stage_tokens_per_s=(1.0, 12.0),
    )
    move = best_move(plan, costs, peers, CONFIG, "b")
    assert (move.from_stage, move.to_stage, move.from_stage_replicas) == (1, 0, 2)
    assert move.current_tokens_per_s == 1.0 and move.moved_tokens_per_s == 6.0
    assert best_move(plan, costs, peers, CONFIG, "a") is None  # its leaving would empty stage 0
    rebalancer = Rebalancer(RebalanceConfig(min_gain=0.1, patience=3))
    assert [rebalancer.observe("b", move) for _ in range(3)] == [None, None, move]
    assert rebalancer.streak("b") == 0
    assert should_move(1.0, 1.11, 0.1) and not should_move(1.0, 1.1, 0.1) and should_move(0.0, 1.0, 0.1)


def test_averaging_adds_a_per_step_cost_for_replicated_stages():
    # One block (2 bytes of weights, 2 of gradients), two 10 token/s replicas, the slower link
    # 2 bytes/s. Per 100-token step: 100 / 20 = 5 s of compute, then averaging 1 s + 2 x 2 x
    # (1/2) / 2 = 2 s, so 100 tokens / 7 s. Without tokens_per_step: the plain sum, 20.
    costs = [block(1, weights_and_grads=4)]
    peers = [peer("a", flops=10, bandwidth=2), peer("b", flops=10, bandwidth=8)]
    config = dataclasses.replace(CONFIG, tokens_per_step=100, averaging_overhead_s=1.0)
    model = CostModel(costs, config)
    assert model.stage_grad_bytes(0, 1) == 2
    assert model.averaging_s(0, 1, 2, 2.0) == 2.0
    assert model.averaging_s(0, 1, 1, 2.0) == 0.0  # a single replica averages with nobody
    plan = Plan(
        stage_bounds=(0, 1),
        assignments={"a": 0, "b": 0},
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0,),
    )
    assert evaluate(plan, costs, peers, config).throughput_tokens_per_s == pytest.approx(100 / 7)
    assert evaluate(plan, costs, peers, CONFIG).throughput_tokens_per_s == 20
    alone = dataclasses.replace(plan, assignments={"a": 0})
    assert evaluate(alone, costs, peers, config).throughput_tokens_per_s == 10
    # two replicas (100 / 7 ~ 14.3) beat one (10), so the planner keeps both...
    assert plan_swarm(costs, peers, config).assignments == {"a": 0, "b": 0}
    # ...unless averaging costs more than the second replica saves: 100 / (5 + 11) = 6.25 < 10
    slow = dataclasses.replace(config, averaging_overhead_s=10.0)
    assert plan_swarm(costs, peers, slow).assignments == {"a": 0}
    assert plan_swarm(costs, peers, slow).trainers == ("b",)
    assert join_stage(alone, costs, peers[:1], slow, peers[1]) is None  # it would slow the only stage
    assert join_stage(alone, costs, peers[:1], config, peers[1]) == 0


def test_costly_averaging_turns_data_parallelism_into_a_pipeline():
    # Six blocks, the first and last twice as heavy (embedding, head); four equal peers. Without
    # averaging, 4 replicas of the whole model (4 x 8 / 8 = 4 tokens/s) tie a 4-stage pipeline
    # cut 2 | 1+1 | 1+1 | 2 (8 / 2 = 4), and the planner keeps the first found: 1 stage, 4
    # replicas. With costly averaging, replicas lose and the pipeline wins.
    costs = [
        block(2, weights_and_grads=1),
        *[block(1, weights_and_grads=1)] * 4,
        block(2, weights_and_grads=1),
    ]
    peers = [peer(f"p{i}", flops=8) for i in range(4)]
    data_parallel = plan_swarm(costs, peers, CONFIG)
    assert data_parallel.stage_bounds == (0, 6)
    assert data_parallel.replicas(0) == ("p0", "p1", "p2", "p3")
    assert data_parallel.throughput_tokens_per_s == 4.0
    config = dataclasses.replace(CONFIG, tokens_per_step=64, averaging_overhead_s=10.0)
    plan = plan_swarm(costs, peers, config)
    assert plan.stage_bounds == (0, 1, 3, 5, 6)
    assert all(len(plan.replicas(s)) == 1 for s in range(4))
    assert plan.trainers == ()
    assert plan.throughput_tokens_per_s == 4.0
    # the data-parallel plan under the same model: 64 tokens per 64 / 4 s of compute plus 10 s
    # (and 2 x 3 x (3/4) gradient bytes over a 1e18 bytes/s link) of averaging
    dp = evaluate(data_parallel, costs, peers, config).throughput_tokens_per_s
    assert dp == pytest.approx(64 / (64 / 4 + 10 + 2 * 3 * 3 / 4 / 1e18))
    assert plan.throughput_tokens_per_s > dp
    # free averaging (no overhead, links fast enough to make the bytes free) is the old model
    free = dataclasses.replace(config, averaging_overhead_s=0.0)
    assert plan_swarm(costs, peers, free) == data_parallel


def test_planner_imports_no_torch():
    code = "import sys, swarmtrain.plan; assert 'torch' not in sys.modules, 'swarmtrain.plan imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# properties on random swarms

blocks_st = st.builds(
    block,
    flops=st.integers(1, 10),
    weights_and_grads=st.integers(0, 10),
    optimizer=st.integers(0, 10),
    activation=st.integers(0, 3),
    boundary=st.integers(0, 5),
)


@st.composite
def models(draw, max_blocks):
    """Random per-block costs, or (as real models are) one cost repeated."""
    if draw(st.booleans()):
        return [draw(blocks_st)] * draw(st.integers(1, max_blocks))
    return draw(st.lists(blocks_st, min_size=1, max_size=max_blocks))


@st.composite
def swarms(draw, max_peers, min_peers=0):
    count = draw(st.integers(min_peers, max_peers))
    return [
        peer(
            f"p{i:02d}",
            flops=draw(st.integers(1, 100)),
            memory=draw(st.integers(0, 80)),
            bandwidth=draw(st.integers(1, 100)),
            is_spot=draw(st.booleans()),
        )
        for i in range(count)
    ]


configs = st.builds(
    PlanConfig,
    tokens_in_flight=st.integers(1, 4),
    memory_headroom=st.sampled_from([0.0, 0.1, 0.25]),
    max_stages=st.one_of(st.none(), st.integers(1, 8)),
)


averaging_configs = st.builds(
    PlanConfig,
    tokens_in_flight=st.integers(1, 4),
    memory_headroom=st.sampled_from([0.0, 0.1, 0.25]),
    max_stages=st.one_of(st.none(), st.integers(1, 8)),
    tokens_per_step=st.sampled_from([1, 10, 100, 1000]),  # averaging dominant ... negligible
    averaging_overhead_s=st.sampled_from([0.0, 0.75, 5.0]),
)


@settings(max_examples=40, deadline=None)
@given(models(max_blocks=12), swarms(max_peers=12), configs)
def test_plans_respect_memory_keep_roles_consistent_and_beat_even_split(costs, peers, config):
    plan = plan_swarm(costs, peers, config)
    result = evaluate(plan, costs, peers, config)
    assert result.over_memory == ()
    assert plan.stage_bounds[0] == 0 and plan.stage_bounds[-1] == len(costs)
    assert config.max_stages is None or plan.num_stages <= config.max_stages
    assert set(plan.assignments).isdisjoint(plan.trainers)
    assert set(plan.assignments) | set(plan.trainers) == {p.peer_id for p in peers}
    assert plan.throughput_tokens_per_s == pytest.approx(result.throughput_tokens_per_s, rel=1e-12)
    assert plan.stage_tokens_per_s == pytest.approx(result.stage_tokens_per_s, rel=1e-12)
    bounds = plan.stage_bounds
    for p in peers:  # a trainer fits no stage of the cut: every peer that fits one is used
        fits_any = any(fits(costs, p, config, bounds[s], bounds[s + 1]) for s in range(plan.num_stages))
        assert fits_any == (p.peer_id in plan.assignments)
    even = even_split_plan(costs, peers, config)
    assert plan.throughput_tokens_per_s >= even.throughput_tokens_per_s * (1 - 1e-12)


@settings(max_examples=30, deadline=None)
@given(
    models(max_blocks=10),
    swarms(max_peers=10),
    averaging_configs,
    st.integers(1, 100),
    st.integers(1, 100),
    st.randoms(use_true_random=False),
)
def test_with_averaging_plans_respect_memory_beat_even_split_and_joins_never_slow(
    costs, peers, config, flops, bandwidth, rnd
):
    plan = plan_swarm(costs, peers, config)
    shuffled = list(peers)
    rnd.shuffle(shuffled)
    assert plan_swarm(costs, shuffled, config) == plan  # deterministic, whatever the peers' order
    result = evaluate(plan, costs, peers, config)
    assert result.over_memory == ()
    assert set(plan.assignments).isdisjoint(plan.trainers)
    assert set(plan.assignments) | set(plan.trainers) == {p.peer_id for p in peers}
    assert plan.throughput_tokens_per_s == pytest.approx(result.throughput_tokens_per_s, rel=1e-12)
    assert plan.stage_tokens_per_s == pytest.approx(result.stage_tokens_per_s, rel=1e-12)
    even = even_split_plan(costs, peers, config)
    assert plan.throughput_tokens_per_s >= even.throughput_tokens_per_s * (1 - 1e-12)
    newcomer = peer("new", flops=flops, memory=1e18, bandwidth=bandwidth)
    stage = join_stage(plan, costs, peers, config, newcomer)
    if stage is not None:  # joining a stage never slows it, so never slows the pipeline
        joined = dataclasses.replace(plan, assignments={**plan.assignments, "new": stage})
        after = evaluate(joined, costs, [*peers, newcomer], config)
        assert after.stage_tokens_per_s[stage] >= result.stage_tokens_per_s[stage] * (1 - 1e-12)
    for peer_id in plan.assignments:  # best_move predicts what evaluate then finds
        move = best_move(plan, costs, peers, config, peer_id)
        if move is not None:
            moved = dataclasses.replace(plan, assignments={**plan.assignments, peer_id: move.to_stage})
            expected = evaluate(moved, costs, peers, config).throughput_tokens_per_s
            assert move.moved_tokens_per_s == pytest.approx(expected, rel=1e-9)
            assert move.moved_tokens_per_s > move.current_tokens_per_s


@settings(max_examples=20, deadline=None)
@given(models(max_blocks=8), swarms(max_peers=8), configs, st.integers(1, 10**6))
def test_free_averaging_gives_the_plans_of_the_plain_sum(costs, peers, config, tokens_per_step):
    """No fixed cost and links so fast that the gradient bytes cost nothing: the old model."""
    peers = [dataclasses.replace(p, bandwidth_bytes_per_s=1e30) for p in peers]
    free = dataclasses.replace(config, tokens_per_step=tokens_per_step, averaging_overhead_s=0.0)
    plan = plan_swarm(costs, peers, config)
    assert plan_swarm(costs, peers, free) == plan
    assert even_split_plan(costs, peers, free) == even_split_plan(costs, peers, config)
    newcomer = peer("new", flops=7, memory=1e18, bandwidth=1e30)
    assert join_stage(plan, costs, peers, free, newcomer) == join_stage(plan, costs, peers, config, newcomer)


@st.composite
def coverable(draw):
    """A swarm holding, for some cut, one peer per stage that just fits it, plus random peers."""
    costs = draw(models(max_blocks=16))
    config = dataclasses.replace(draw(configs), max_stages=None)
    model = CostModel(costs, config)
    num_stages = draw(st.integers(1, min(len(costs), 6)))
    cuts = (
        draw(st.sets(st.integers(1, len(costs) - 1), min_size=num_stages - 1, max_size=num_stages - 1))
        if num_stages > 1
        else set()
    )
    bounds = [0, *sorted(cuts), len(costs)]
    witnesses = [
        peer(
            f"w{s}",
            flops=draw(st.integers(1, 100)),
            memory=model.stage_memory(bounds[s], bounds[s + 1]) / (1 - config.memory_headroom) * 1.0001,
            bandwidth=draw(st.integers(1, 100)),
        )
        for s in range(num_stages)
    ]
    return costs, witnesses + draw(swarms(max_peers=6)), config


@settings(max_examples=30, deadline=None)
@given(coverable())
def test_every_stage_has_a_replica_when_memory_allows(instance):
    costs, peers, config = instance
    plan = plan_swarm(costs, peers, config)
    assert plan.is_complete
    assert plan.throughput_tokens_per_s > 0
    assert evaluate(plan, costs, peers, config).over_memory == ()


@settings(max_examples=60, deadline=None)
@given(models(max_blocks=6), swarms(max_peers=4, min_peers=1), configs)
def test_small_swarms_are_within_one_percent_of_brute_force(costs, peers, config):
    optimum = brute_force(costs, peers, config)
    got = plan_swarm(costs, peers, config).throughput_tokens_per_s
    assert optimum * 0.99 <= got <= optimum * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(models(max_blocks=6), swarms(max_peers=4, min_peers=1), averaging_configs)
def test_with_averaging_small_swarms_are_within_one_percent_of_brute_force(costs, peers, config):
    optimum = brute_force(costs, peers, config)
    got = plan_swarm(costs, peers, config).throughput_tokens_per_s
    assert optimum * 0.99 <= got <= optimum * (1 + 1e-9)


@pytest.mark.parametrize("averaging", [False, True], ids=["sum", "averaging"])
def test_heuristic_alone_is_near_brute_force_on_small_swarms(averaging):
    """With exhaustive search off, over a fixed sample: within 1% of the optimum on almost all."""
    rng = random.Random(2024)
    gaps = []
    for _ in range(40):
        costs = [
            block(
                *(
                    rng.randint(1, 10),
                    rng.randint(0, 10),
                    rng.randint(0, 10),
                    rng.randint(0, 3),
                    rng.randint(0, 5),
                )
            )
            for _ in range(rng.randint(2, 6))
        ]
        peers = [
            peer(f"p{i}", rng.randint(1, 100), rng.randint(5, 80), rng.randint(1, 100))
            for i in range(rng.randint(2, 4))
        ]
        config = PlanConfig(tokens_in_flight=rng.randint(1, 4), exhaustive_limit=0)
        if averaging:
            config = dataclasses.replace(
                config,
                tokens_per_step=rng.choice([1, 10, 100, 1000]),
                averaging_overhead_s=rng.choice([0.0, 0.75, 5.0]),
            )
        optimum = brute_force(costs, peers, config)
        if optimum > 0:
            gaps.append(1 - plan_swarm(costs, peers, config).throughput_tokens_per_s / optimum)
    assert sum(g <= 0.01 for g in gaps) >= 0.9 * len(gaps), sorted(gaps)[-5:]
    assert max(gaps) < 0.25


@settings(max_examples=25, deadline=None)
@given(models(max_blocks=10), swarms(max_peers=10), configs, st.randoms(use_true_random=False))
def test_same_inputs_in_any_order_give_the_same_plan(costs, peers, config, rnd):
    shuffled = list(peers)
    rnd.shuffle(shuffled)
    assert plan_swarm(costs, peers, config) == plan_swarm(costs, shuffled, config)
    assert even_split_plan(costs, peers, config) == even_split_plan(costs, shuffled, config)


@settings(max_examples=25, deadline=None)
@given(models(max_blocks=8), swarms(max_peers=8), configs)
def test_peers_that_fit_no_stage_become_trainers(costs, peers, config):
    smallest = min(CostModel(costs, config).stage_memory(i, i + 1) for i in range(len(costs)))
    if smallest == 0:
        return  # every peer fits a zero-byte block
    too_small = [peer(f"tiny{i}", flops=1000, memory=smallest * 0.99) for i in range(2)]
    plan = plan_swarm(costs, peers + too_small, config)
    assert {"tiny0", "tiny1"} <= set(plan.trainers)


@settings(max_examples=30, deadline=None)
@given(
    models(max_blocks=8), swarms(max_peers=8, min_peers=1), configs, st.integers(1, 100), st.integers(1, 100)
)
def test_join_stage_picks_a_slowest_stage(costs, peers, config, flops, bandwidth):
    plan = plan_swarm(costs, peers, config)
    newcomer = peer("new", flops=flops, memory=1e18, bandwidth=bandwidth)
    stage = join_stage(plan, costs, peers, config, newcomer)
    assert plan.stage_tokens_per_s[stage] == min(plan.stage_tokens_per_s)
    nothing = peer("none", memory=-0.0)
    chosen = join_stage(plan, costs, peers, config, nothing)
    bounds = plan.stage_bounds
    assert (chosen is None) == (
        not any(fits(costs, nothing, config, bounds[s], bounds[s + 1]) for s in range(plan.num_stages))
    )


observations = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),  # peer
        st.sampled_from([(0, 1), (0, 2), (1, 0)]),  # (from, to)
        st.integers(1, 3),  # replicas of the source stage
        st.sampled_from([1.0, 1.05, 1.2, 2.0, None]),  # moved / current; None: no candidate
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(observations, st.integers(1, 4), st.sampled_from([0.0, 0.1, 0.5]))
def test_rebalancer_needs_patience_consecutive_gains_and_never_empties_a_stage(steps, patience, min_gain):
    rebalancer = Rebalancer(RebalanceConfig(min_gain=min_gain, patience=patience))
    history: dict[str, list[tuple[tuple[int, int] | None, bool]]] = {"a": [], "b": []}
    for peer_id, move, replicas, ratio in steps:
        candidate = None
        if ratio is not None:
            candidate = MoveCandidate(
                peer_id=peer_id,
                from_stage=move[0],
                to_stage=move[1],
                from_stage_replicas=replicas,
                current_tokens_per_s=10.0,
                moved_tokens_per_s=10.0 * ratio,
            )
        decision = rebalancer.observe(peer_id, candidate)
        qualifies = candidate is not None and ratio > 1 + min_gain
        past = history[peer_id]
        # checks since this peer's last recommended move, newest last
        window = list(itertools.takewhile(lambda h: not h[1], reversed(past)))[::-1]
        run = 0  # consecutive qualifying checks of this same move, this one included
        if qualifies:
            run = 1
            for earlier_move, _ in reversed(window):
                if earlier_move != move:
                    break
                run += 1
        should = qualifies and run >= patience and replicas >= 2
        assert (decision is not None) == should
        if decision is not None:
            assert decision.from_stage_replicas >= 2
        past.append((move if qualifies else None, decision is not None))


@settings(max_examples=25, deadline=None)
@given(models(max_blocks=8), swarms(max_peers=8, min_peers=2), configs)
def test_best_move_only_proposes_gains_elsewhere(costs, peers, config):
    plan = plan_swarm(costs, peers, config)
    for peer_id, stage in plan.assignments.items():
        move = best_move(plan, costs, peers, config, peer_id)
        if move is not None:
            assert move.from_stage == stage != move.to_stage
            assert move.moved_tokens_per_s > move.current_tokens_per_s
            assert move.from_stage_replicas == len(plan.replicas(stage))
