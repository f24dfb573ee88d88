"""A run's first layout, planned from the stage peers that come (`swarmtrain.train.layout`):
the same plan from any view of the same records, stages sized to measured capacity, honest
fallbacks, and a real swarm whose coordinator waits for its peers, plans, and trains with
single-process parity on the planned stages."""

import dataclasses
import random

import pytest

from swarmtrain.errors import ConfigError
from swarmtrain.peers.coordinator import CoordinatorConfig, make_manifest
from swarmtrain.plan import even_split_plan
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.layout import FirstLayoutConfig, first_layout, layout_due
from swarmtrain.train.placement import capacity_of, manifest_costs, manifest_plan_config
from swarmtrain.wire.records import BatchConfig, OptimizerConfig, PeerRecord, RunManifest
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses

MODEL = TINY_GPT | {"n_layer": 6}
FIRST = FirstLayoutConfig(min_peers=3, plan_wait_s=30)


def peer(i: int) -> str:
    return f"Qm{'A' * 40}{i + 1}"


def pending(num_stages: int = 2) -> RunManifest:
    m = make_manifest(
        CoordinatorConfig(model="tiny-gpt", model_config=MODEL, num_stages=num_stages, first_layout=FIRST)
    )
    assert m.layout_version == 0 and "pending" in m.layout_note
    return m


def candidate(i: int, flops: float) -> PeerRecord:
    return PeerRecord(
        peer_id=peer(i),
        role="candidate",
        state="joining",
        capacity={"flops_per_s": 1e12, "block_flops_per_s": flops, "memory_bytes": 2**33},
    )


def test_the_same_records_give_the_same_layout_from_any_view():
    m = pending()
    costs = manifest_costs(m)
    records = [candidate(i, f) for i, f in enumerate([4e9, 4e9, 1e9, 1e9])]
    others = [PeerRecord(peer_id=peer(9), role="trainer"), PeerRecord(peer_id=peer(8), role="coordinator")]
    layouts = set()
    for seed in range(5):
        view = records + others
        random.Random(seed).shuffle(view)
        planned = first_layout(m, view, costs)
        layouts.add((planned.stage_bounds, tuple(planned.assignments.items()), planned.layout_note))
    assert len(layouts) == 1


def test_stages_are_sized_to_the_peers_measured_capacity():
    m = pending()
    costs = manifest_costs(m)
    records = [candidate(0, 4e9), candidate(1, 1e9)]  # one peer 4x the other
    planned = first_layout(m, records, costs)
    assert planned.layout_version == 1 and planned.num_stages == m.num_stages
    fast, slow = planned.assignments[peer(0)], planned.assignments[peer(1)]
    assert fast != slow
    span = [b - a for a, b in zip(planned.stage_bounds, planned.stage_bounds[1:], strict=False)]
    assert span[fast] > span[slow]  # the fast peer holds more blocks
    config = dataclasses.replace(manifest_plan_config(m), min_stages=2, max_stages=2)
    even = even_split_plan(costs, [capacity_of(r) for r in records], config, num_stages=2)
    assert planned.stage_bounds != even.stage_bounds
    assert "planned from 2 peers" in planned.layout_note and "x the even split" in planned.layout_note
    gain = float(planned.layout_note.rsplit(", ", 1)[1].split("x")[0])
    assert gain > 1.2  # the planner's own prediction of what sizing the stages buys
    RunManifest.from_dict(planned.to_dict())  # a valid manifest, as peers will read it


def test_fewer_peers_than_stages_keep_the_even_split():
    m = pending(num_stages=3)
    planned = first_layout(m, [candidate(0, 1e9), candidate(1, 1e9)])
    assert planned.layout_version == 1 and planned.stage_bounds == m.stage_bounds and not planned.assignments
    assert planned.layout_note == "even split kept: 2 stage peers came for 3 stages"


@pytest.mark.parametrize(
    "count, waited, due",
    [(3, 0.0, True), (2, 29.0, False), (2, 30.0, True), (1, 60.0, False), (0, 1e9, False)],
)
def test_the_layout_is_planned_at_min_peers_or_after_the_wait_with_one_per_stage(count, waited, due):
    assert layout_due(FIRST, count, waited, num_stages=2) is due


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_peers": 0}, "--min-peers must be an integer >= 1, got 0"),
        ({"min_peers": 2, "plan_wait_s": -1}, r"--plan-wait must be seconds in \[0, 86400\), got -1"),
    ],
)
def test_first_layout_config_says_what_is_wrong(fields, message):
    with pytest.raises(ConfigError, match=message):
        FirstLayoutConfig(**fields)


def test_a_planned_layout_cannot_also_have_fixed_bounds():
    with pytest.raises(ConfigError, match="leave out --stage-bounds"):
        CoordinatorConfig(model_config=MODEL, stage_bounds=(0, 2, 6), first_layout=FIRST)


def test_a_manifest_refuses_assignments_outside_its_stages():
    m = pending()
    with pytest.raises(ConfigError, match="assignments must map at most 512 peer ids to stages 0..1"):
        RunManifest.from_dict(m.to_dict() | {"assignments": {peer(0): 2}})
    with pytest.raises(ConfigError, match="layout_version must be an integer >= 0"):
        RunManifest.from_dict(m.to_dict() | {"layout_version": -1})


@pytest.mark.swarm
@pytest.mark.slow
def test_a_swarm_waits_for_its_peers_plans_their_stages_and_trains_with_parity(local_swarm):
    """Three stage peers, one 4x slower, join a coordinator that waits for them: it sizes the
    two stages to them, every peer serves the stage the layout gives it, and the run's losses
    equal single-process training's."""
    seed, optimizer = 5, OptimizerConfig(name="adamw", lr=1e-2)
    batch = BatchConfig(microbatch_size=4, microbatches_per_step=4, max_in_flight=4)
    swarm = local_swarm(
        model_config=MODEL,
        num_stages=2,
        min_peers=3,
        seed=seed,
        optimizer=optimizer,
        batch=batch,
        stage_args={k: ("--rebalance-every", "0") for k in range(2)}
        | {2: ("--rebalance-every", "0", "--slowdown", "4")},
    )
    data = lambda: TokenBatches(stdlib_text(2**20), seq_len=MODEL["seq_len"], microbatch_size=4, seed=seed)  # noqa: E731
    with swarm.trainer() as trainer:
        m = trainer.manifest
        assert m.layout_version == 1 and m.layout_note.startswith("planned from 3 peers"), m.layout_note
        assert len(m.assignments) >= 2 and set(m.assignments.values()) == {0, 1}
        records = {r.peer_id: r for r in trainer.node.peers(m.run_id) if r.role == "stage"}
        for peer_id, stage in m.assignments.items():
            assert records[peer_id].stage == stage, (peer_id, records[peer_id])
        results = list(trainer.train(data(), steps=4))
    reference = reference_losses(
        seed=seed, optimizer=optimizer, batches=data(), steps=4, microbatches_per_step=4, model_config=MODEL
    )
    assert_losses_match_reference(results, reference)
