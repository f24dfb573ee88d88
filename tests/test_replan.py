"""Re-planning a running swarm's layout (`swarmtrain.plan.layout`): every view of the same peers
proposes the same layout, and the hysteresis holds the layout steady when the gain is small or
short-lived; the dashboard's view and `status` show the proposal."""

import dataclasses
import random

import pytest

from swarmtrain.errors import ConfigError
from swarmtrain.peers.coordinator import CoordinatorConfig, make_manifest
from swarmtrain.peers.dashboard.state import SwarmView
from swarmtrain.peers.status import replan_text
from swarmtrain.plan import (
    BlockCost,
    LayoutGate,
    LayoutProposal,
    PeerCapacity,
    PlanConfig,
    ReplanConfig,
    propose_layout,
)
from swarmtrain.plan.planner import Plan
from swarmtrain.train.layout import replan_proposal
from swarmtrain.wire.records import PeerRecord

COSTS = [
    BlockCost(
        flops_per_token=1e6,
        weight_bytes=1e6,
        grad_bytes=1e6,
        optimizer_bytes=2e6,
        activation_bytes_per_token=1e3,
        boundary_bytes_per_token=1e3,
    )
] * 8
CONFIG = PlanConfig(tokens_in_flight=512)


def peer(i: int) -> str:
    return f"Qm{'A' * 40}{i + 1}"


def capacity(i: int, flops: float) -> PeerCapacity:
    return PeerCapacity(peer_id=peer(i), flops_per_s=flops, memory_bytes=2**33, bandwidth_bytes_per_s=1e9)


def even_live(peers: list[PeerCapacity]) -> Plan:
    """Two stages of four blocks, peers alternating between them (as joins in id order leave them)."""
    return Plan(
        stage_bounds=(0, 4, 8),
        assignments={p.peer_id: i % 2 for i, p in enumerate(peers)},
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0, 0.0),
    )


def test_every_view_of_the_same_peers_proposes_the_same_layout():
    peers = [capacity(i, f) for i, f in enumerate([8e9, 4e9, 1e9, 1e9])]
    live = even_live(peers)
    keys = set()
    for seed in range(6):
        view = list(peers)
        random.Random(seed).shuffle(view)
        proposal = propose_layout(COSTS, view, CONFIG, live)
        keys.add((proposal.key, proposal.planned_tokens_per_s, proposal.current_tokens_per_s))
    assert len(keys) == 1
    ((key, planned, current),) = keys
    assert key[0] != (0, 4, 8) and planned > current  # it sizes the stages to the peers


def test_no_proposal_when_the_live_layout_is_the_planners():
    peers = [capacity(i, f) for i, f in enumerate([8e9, 4e9, 1e9, 1e9])]
    proposal = propose_layout(COSTS, peers, CONFIG, even_live(peers))
    planned = Plan(
        stage_bounds=proposal.stage_bounds,
        assignments=proposal.assignments,
        trainers=(),
        throughput_tokens_per_s=0.0,
        stage_tokens_per_s=(0.0, 0.0),
    )
    assert propose_layout(COSTS, peers, CONFIG, planned) is None


def proposal(planned: float, bounds=(0, 5, 8), current: float = 100.0) -> LayoutProposal:
    return LayoutProposal(
        stage_bounds=bounds, assignments={peer(0): 0, peer(1): 1}, current_tokens_per_s=current,
        planned_tokens_per_s=planned,
    )  # fmt: skip


def test_the_gate_holds_the_layout_when_the_gain_is_small():
    gate = LayoutGate(ReplanConfig(min_gain=0.2, patience=3))
    assert all(gate.observe(proposal(119.0)) is None for _ in range(10))  # +19%: never
    assert gate.streak == 0


def test_the_gate_holds_the_layout_when_the_gain_is_short_lived():
    gate = LayoutGate(ReplanConfig(min_gain=0.2, patience=3))
    checks = [proposal(150.0), proposal(150.0), None, proposal(150.0), proposal(150.0),
              proposal(150.0, bounds=(0, 6, 8)), proposal(150.0), proposal(110.0), proposal(150.0)]  # fmt: skip
    assert [gate.observe(p) for p in checks] == [None] * len(checks)
    assert gate.streak == 1
    assert gate.observe(proposal(150.0)) is None and gate.observe(proposal(150.0)) == proposal(150.0)
    assert gate.observe(proposal(150.0)) == proposal(150.0)  # and stays worth it while it lasts


def test_from_a_stalled_layout_any_proposal_gains():
    assert proposal(10.0, current=0.0).gain == float("inf")
    assert proposal(10.0, current=0.0).to_dict()["gain"] is None  # JSON has no inf
    gate = LayoutGate(ReplanConfig(min_gain=0.5, patience=1))
    assert gate.observe(proposal(10.0, current=0.0)) is not None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_gain": -0.1}, "min_gain must be a finite number >= 0, got -0.1"),
        ({"min_gain": float("nan")}, "min_gain must be a finite number >= 0, got nan"),
        ({"patience": 0}, "patience must be an integer >= 1, got 0"),
    ],
)
def test_replan_config_says_what_is_wrong(fields, message):
    with pytest.raises(ConfigError, match=message):
        ReplanConfig(**fields)


MODEL = {"n_layer": 8, "n_head": 4, "d_model": 128, "seq_len": 64, "vocab_size": 256}


def serving(i: int, stage: int, service_s: float) -> PeerRecord:
    return PeerRecord(
        peer_id=peer(i), role="stage", stage=stage, state="serving", service_s=service_s,
        capacity={"block_flops_per_s": 1e9, "memory_bytes": 2**33},
    )  # fmt: skip


def test_measured_speeds_make_the_proposal_and_the_dashboard_counts_its_polls():
    """Three stages evenly split; stage 2's replica measures 8x slower than the others. The
    planner gives it fewer blocks; the dashboard's view counts the polls the gain has held."""
    m = make_manifest(CoordinatorConfig(model_config=MODEL, num_stages=3))
    records = [serving(0, 0, 0.05), serving(1, 1, 0.05), serving(2, 2, 0.4)]
    p = replan_proposal(m, records)
    assert p is not None and p.gain > 0.2
    sizes = [b - a for a, b in zip(p.stage_bounds, p.stage_bounds[1:], strict=False)]
    assert sizes[p.assignments[peer(2)]] == min(sizes)
    assert replan_proposal(m, records[:2]) is None  # stage 2 unserved: nothing to compare
    view = SwarmView()
    streaks = []
    for t in range(4):
        view.update(records, m, now=100.0 + t)
        streaks.append(view.snapshot()["replan"]["streak"])
    assert streaks == [1, 2, 3, 4] and view.replan["sustained"]
    line = replan_text(view.replan)
    assert line.startswith("re-plan: these peers would get blocks ") and "held 4 of 3 polls" in line
    moved = dataclasses.replace(m, stage_bounds=p.stage_bounds, layout_version=2)
    view.update([dataclasses.replace(r, stage=p.assignments[r.peer_id]) for r in records], moved, now=110.0)
    assert view.replan is None or view.replan["streak"] == 1  # a new layout: its proposals start afresh
