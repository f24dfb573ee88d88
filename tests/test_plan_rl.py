"""Joint RL planning (pure): hand-computed splits, joins, role moves and their hysteresis.

One block whose forward+backward costs 1 FLOP per token, so a stage replica's token rate is
its peer's flops_per_s; a sample is 1 token to train and 1 token to decode, so consumed
samples/s is the pipeline's token rate and produced samples/s the rollout peers' summed
decode rate.
"""

from __future__ import annotations

import dataclasses

import pytest

from swarmtrain.errors import ConfigError
from swarmtrain.plan import (
    BlockCost,
    PeerCapacity,
    Plan,
    PlanConfig,
    RebalanceConfig,
    RLDemand,
    RoleMove,
    RoleRebalancer,
    best_role_move,
    join_role,
    split_rl,
)
from swarmtrain.plan.rl import rl_rates
from swarmtrain.rl.roles import RoleChecker, choose_role
from swarmtrain.wire.records import BatchConfig, PeerRecord, RLConfig, RunManifest
from tests.conftest import TINY_GPT

COSTS = [
    BlockCost(
        flops_per_token=1.0,
        weight_bytes=50.0,
        grad_bytes=50.0,
        optimizer_bytes=0.0,
        activation_bytes_per_token=0.0,
        boundary_bytes_per_token=0.0,
    )
]
TWO_BLOCKS = COSTS * 2
CONFIG = PlanConfig(tokens_in_flight=1, memory_headroom=0.0)
DEMAND = RLDemand(tokens_per_sample=1, decode_tokens_per_sample=1)


def peer(peer_id: str, flops: float, decode: float, memory: float = 1e9) -> PeerCapacity:
    return PeerCapacity(
        peer_id=peer_id,
        flops_per_s=flops,
        memory_bytes=memory,
        bandwidth_bytes_per_s=1e18,
        decode_tokens_per_s=decode,
    )


def layout(assignments: dict[str, int], num_stages: int = 1) -> Plan:
    return Plan(
        stage_bounds=tuple(range(num_stages + 1)),
        assignments=assignments,
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0,) * num_stages,
    )


# strong machines: 4 FLOP/s, decode 2 tok/s; weak ones: 1 FLOP/s, decode 4 tok/s
STRONG = [peer("a", 4, 2), peer("b", 4, 2)]
WEAK = [peer("c", 1, 4), peer("d", 1, 4)]


def test_strong_peers_train_and_weak_ones_sample_so_production_matches_consumption():
    split = split_rl((0, 1), COSTS, STRONG + WEAK, CONFIG, DEMAND)
    # one stage on a: consumed 4, produced 2+4+4=10 -> 4; on a, b: 8 and 8 -> 8; on a, b, c: 9, 4 -> 4
    assert split.plan.assignments == {"a": 0, "b": 0}
    assert split.rollouts == ("c", "d")
    assert (split.consumed_samples_per_s, split.produced_samples_per_s) == (8, 8)
    assert split.samples_per_s == 8
    assert [split.role(p) for p in "abcd"] == ["stage", "stage", "rollout", "rollout"]
    inverse = rl_rates(layout({"c": 0, "d": 0}), ("a", "b"), COSTS, STRONG + WEAK, CONFIG, DEMAND)
    assert min(inverse) == 2  # the inverse split: 2 consumed, 4 produced
    assert split.samples_per_s >= 4 * min(inverse)


def test_stages_are_covered_first_and_filled_as_joining_peers_fill_them():
    peers = [peer("a", 4, 1), peer("b", 3, 1), peer("c", 2, 1), peer("w", 1, 8)]
    split = split_rl((0, 1, 2), TWO_BLOCKS, peers, CONFIG, DEMAND)
    # stage peers join strongest first: a -> stage 0, b -> stage 1 (empty), c -> the slower (1)
    assert split.plan.assignments == {"a": 0, "b": 1, "c": 1}
    assert split.rollouts == ("w",)
    assert (split.consumed_samples_per_s, split.produced_samples_per_s) == (4, 8)


def test_memory_decides_who_can_train_and_who_can_sample():
    peers = [
        peer("small", 100, 5, memory=10),  # fits no stage (it needs 100 bytes): it samples
        peer("nodecode", 1, 0),  # cannot sample (no decode rate): it trains
        peer("neither", 100, 0, memory=10),  # a trainer: it drives steps
    ]
    split = split_rl((0, 1), COSTS, peers, CONFIG, DEMAND)
    assert split.plan.assignments == {"nodecode": 0}
    assert split.rollouts == ("small",)
    assert split.trainers == ("neither",)
    assert split.samples_per_s == 1
    with pytest.raises(ConfigError, match="not in this RL split"):
        split.role("stranger")


def test_a_joining_peer_fills_an_empty_stage_then_the_slower_half():
    a, c = STRONG[0], WEAK[0]
    assert join_role(layout({}), (), COSTS, [], CONFIG, DEMAND, a) == "stage"
    # a trains at 4, nothing samples: the new peer samples
    assert join_role(layout({"a": 0}), (), COSTS, [a], CONFIG, DEMAND, STRONG[1]) == "rollout"
    # a trains at 4, c and d sample 8: b trains (8 and 8 beat 4 and 10)
    both = [a, *WEAK]
    assert join_role(layout({"a": 0}), ("c", "d"), COSTS, both, CONFIG, DEMAND, STRONG[1]) == "stage"
    # an empty second stage comes first, whatever the rates
    assert join_role(layout({"a": 0}, 2), ("c",), TWO_BLOCKS, [a, c], CONFIG, DEMAND, WEAK[1]) == "stage"
    assert join_role(layout({}), (), COSTS, [], CONFIG, DEMAND, peer("tiny", 1, 3, memory=1)) == "rollout"
    assert join_role(layout({}), (), COSTS, [], CONFIG, DEMAND, peer("x", 1, 0, memory=1)) == "trainer"


def test_the_best_role_move_never_takes_a_last_replica():
    peers = STRONG + WEAK
    # a alone trains (4), b, c, d sample (10): b's joining the stage makes it 8 and 8
    move = best_role_move(layout({"a": 0}), ("b", "c", "d"), COSTS, peers, CONFIG, DEMAND, "abcd")
    assert move == RoleMove(peer_id="b", to_role="stage", current_samples_per_s=4, moved_samples_per_s=8)
    # everyone trains (10), nothing samples: a stage peer should sample, but a is not movable
    everyone = layout({p.peer_id: 0 for p in peers})
    move = best_role_move(everyone, (), COSTS, peers, CONFIG, DEMAND, "bcd")
    assert move.to_role == "rollout" and move.peer_id == "c" and move.moved_samples_per_s == 4
    # a last replica stays, even when sampling is all the run lacks
    assert best_role_move(layout({"a": 0}), (), COSTS, peers, CONFIG, DEMAND, "a") is None
    # at the best split nothing moves
    assert best_role_move(layout({"a": 0, "b": 0}), ("c", "d"), COSTS, peers, CONFIG, DEMAND, "abcd") is None


def test_a_stage_that_lost_every_replica_is_refilled_by_a_rollout_peer():
    peers = STRONG[1:] + WEAK
    move = best_role_move(layout({}), ("b", "c", "d"), COSTS, peers, CONFIG, DEMAND, "bcd")
    # from 0: b trains at 4 against 8 sampled; c or d would train at 1
    assert move.peer_id == "b" and move.to_role == "stage" and move.current_samples_per_s == 0


def test_role_rebalancer_moves_only_for_a_lasting_gain_over_min_gain():
    big = RoleMove(peer_id="b", to_role="stage", current_samples_per_s=4, moved_samples_per_s=8)
    small = RoleMove(peer_id="b", to_role="stage", current_samples_per_s=4, moved_samples_per_s=4.3)
    r = RoleRebalancer(RebalanceConfig(min_gain=0.1, patience=3))
    assert [r.observe("b", big) for _ in range(3)] == [None, None, "stage"]
    assert r.streak == 0  # it starts again after a move
    assert [r.observe("b", big), r.observe("b", small), r.observe("b", big), r.observe("b", big)] == [
        None
    ] * 4
    assert r.streak == 3 - 1
    assert r.observe("b", big) == "stage"
    # another peer's move, or none, starts the count again
    other = RoleMove(peer_id="c", to_role="rollout", current_samples_per_s=4, moved_samples_per_s=8)
    seen = [r.observe("b", big), r.observe("b", other), r.observe("b", big), r.observe("b", None)]
    assert seen == [None] * 4 and r.streak == 0


def test_bad_figures_are_refused_with_the_name_of_the_field():
    with pytest.raises(ConfigError, match="decode_tokens_per_s"):
        peer("a", 1, -1)
    with pytest.raises(ConfigError, match="tokens_per_sample must be a finite number > 0"):
        RLDemand(tokens_per_sample=0, decode_tokens_per_sample=1)
    with pytest.raises(ConfigError, match="no capacity given for peers"):
        rl_rates(layout({"a": 0}), ("z",), COSTS, STRONG, CONFIG, DEMAND)
    with pytest.raises(ConfigError, match="unique"):
        split_rl((0, 1), COSTS, [STRONG[0], STRONG[0]], CONFIG, DEMAND)


# the planner fed from an RL run's manifest and peer records (swarmtrain.rl.roles)


def rl_manifest() -> tuple[RunManifest, RunManifest]:
    """A pre-training run and the same run as an RL run (GRPO on 2-digit addition)."""
    plain = RunManifest(
        run_id="rl",
        model="tiny-gpt",
        model_config=TINY_GPT,
        num_blocks=TINY_GPT["n_layer"],
        stage_bounds=(0, TINY_GPT["n_layer"]),
        batch=BatchConfig(microbatch_size=8, microbatches_per_step=2, max_in_flight=2),
    )
    return plain, dataclasses.replace(plain, loss="grpo", rl=RLConfig(task="add"))


def record(peer_id, role, *, decode=1e5, flops=1e9, memory=2**33, auto=True, state="serving", stage=None):
    capacity = {"flops_per_s": flops, "memory_bytes": memory, "decode_tokens_per_s": decode}
    if auto:
        capacity["role_auto"] = True
    return PeerRecord(
        peer_id=peer_id,
        role=role,
        stage=(0 if role == "stage" else -1) if stage is None else stage,
        state=state,
        capacity=capacity,
    )


def test_choose_role_reads_the_run_from_its_records():
    plain, rl = rl_manifest()
    mine = {"flops_per_s": 1e9, "memory_bytes": 2**33, "decode_tokens_per_s": 1e5}
    assert choose_role(plain, [], mine, peer_id="me") == "stage"  # pre-training: always a stage
    assert choose_role(rl, [], mine, peer_id="me") == "stage"  # the stage has no replica
    held = [record("s", "stage")]
    assert choose_role(rl, held, mine, peer_id="me") == "rollout"  # nothing samples
    # the stage's only replica is leaving, and this peer's own old record does not count
    leaving = [record("s", "stage", state="draining"), record("me", "stage")]
    assert choose_role(rl, leaving + [record("r", "rollout")], mine, peer_id="me") == "stage"
    # a record whose capacity does not parse is left out, not trusted and not fatal
    garbage = record("x", "rollout")
    garbage.capacity["decode_tokens_per_s"] = "fast"
    assert choose_role(rl, [*held, garbage], mine, peer_id="me") == "rollout"
    small = {**mine, "memory_bytes": 1024}
    assert choose_role(rl, [], small, peer_id="me") == "rollout"  # fits no stage
    assert choose_role(rl, [], {**small, "decode_tokens_per_s": 0}, peer_id="me") == "trainer"


def test_role_checker_moves_an_auto_rollout_peer_into_a_stage_nobody_holds():
    _, rl = rl_manifest()
    checker = RoleChecker(rl, patience=3)
    orphaned = [
        record("s", "stage", state="draining"),
        record("me", "rollout"),
        record("r", "rollout", auto=False),
    ]
    assert [checker.check("me", orphaned) for _ in range(3)] == [None, None, "stage"]
    # a peer started as a rollout peer (no role_auto) is never moved: the auto one is
    other = RoleChecker(rl, patience=1)
    assert other.check("r", orphaned) is None
    # while the stage is held and the auto peer samples for it, nothing moves
    held = [record("s", "stage", auto=False), record("me", "rollout")]
    assert [checker.check("me", held) for _ in range(4)] == [None] * 4
