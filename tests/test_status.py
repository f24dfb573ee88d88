"""`swarmtrain status` without a network: what it reads from a fake swarm and how it prints it
(the real command against a real swarm, with its coordinator dead: test_dashboard_browser.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from rich.console import Console

from swarmtrain.errors import ConfigError, RunNotFoundError
from swarmtrain.peers.status import StatusConfig, format_bytes, read_status, render_status
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.wire.metrics import RLPoint, TrainerPoint
from swarmtrain.wire.records import CompressionConfig, PeerRecord, RunManifest
from swarmtrain.wire.rl_config import RLConfig

A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA1"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB2"
T = "12D3KooWTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT3"
DASH = RunManifest(run_id="dash", model="tiny-gpt", num_blocks=4, stage_bounds=(0, 3, 4), max_steps=50)


class FakeSwarm:
    """The DHT reads `read_status` makes, answered from dicts; run resolution is SwarmNode's own."""

    require_manifest = SwarmNode.require_manifest

    def __init__(self, manifests: list[RunManifest], peers: dict[str, list[PeerRecord]], points=()):
        self.manifests = {m.run_id: m for m in manifests}
        self.records = peers
        self.points = list(points)

    def known_runs(self) -> list[str]:
        return sorted(self.manifests)

    def get_manifest(self, run_id: str) -> RunManifest | None:
        return self.manifests.get(run_id)

    def peers(self, run_id: str) -> list[PeerRecord]:
        return self.records.get(run_id, [])

    def trainer_points(self, run_id: str) -> list[dict]:
        return [p.to_dict() for p in self.points] + [{"step": "garbage"}]


def printed(status: dict) -> str:
    console = Console(record=True, width=220, color_system=None)
    console.print(render_status(status))
    return console.export_text()


CAP = {"memory_bytes": 8 * 2**30, "device_name": "Xeon", "flops_per_s": 1e12}
PEERS = [
    PeerRecord(
        peer_id=A, role="stage", stage=0, served=40, step=6, capacity=CAP, queue_depth=2, service_s=0.02,
        memory_used_bytes=2**30, replayed=1, bytes_sent=2**20, raw_bytes_sent=4 * 2**20, banned=(B,), since=10.0,
    ),
    PeerRecord(peer_id=B, role="stage", stage=1, served=39, step=6, failed=3, since=12.0),
]  # fmt: skip
POINT = TrainerPoint(trainer=T, step=5, loss=2.75, tokens_per_s=5300.0, t=99.0, completed=24, window=4)


def test_status_shows_stages_peers_and_the_last_trainer_point():
    swarm = FakeSwarm([DASH], {"dash": PEERS}, [POINT])
    status = json.loads(json.dumps(read_status(swarm, None, now=100.0), allow_nan=False))
    assert status["run_id"] == "dash" and status["manifest"]["stage_bounds"] == [0, 3, 4]
    assert [[(r["peer_id"], r["status"]) for r in s["replicas"]] for s in status["stages"]] == [
        [(A, "serving")],
        [(B, "banned")],
    ]
    a = status["peers"][0]
    assert (a["compression"], a["memory_total_bytes"], a["queue_depth"]) == (4.0, 8 * 2**30, 2)
    assert status["trainers"] == [POINT.to_dict()]
    text = printed(status)
    assert "run 'dash': tiny-gpt, 4 blocks in 2 stages [0, 3, 4], schedule readiness, step 6 of 50" in text
    assert "0-2" in text and "3-3" in text  # block spans
    for words in (A[-8:], "banned", "1.0 GiB / 8.0 GiB", "20.0 ms", "4.00x", "1.0 MiB", "2.750", "5300"):
        assert words in text, words


def test_status_of_a_run_whose_manifest_expired_still_lists_its_peers():
    swarm = FakeSwarm([], {"dash": PEERS})
    status = read_status(swarm, "dash", now=100.0)
    assert status["manifest"] is None and status["stages"] == []
    assert [r["peer_id"] for r in status["peers"]] == [A, B]
    text = printed(status)
    assert "no manifest in the DHT" in text and B[-8:] in text and "no trainer has reported" in text


def test_status_of_an_unknown_run_names_the_runs_there_are():
    swarm = FakeSwarm(
        [DASH, RunManifest(run_id="other", model="tiny-gpt", num_blocks=2, stage_bounds=(0, 2))], {}
    )
    with pytest.raises(RunNotFoundError, match="no run 'beta' in this swarm; it announces 'dash', 'other'"):
        read_status(swarm, "beta", now=0.0)
    with pytest.raises(RunNotFoundError, match="several runs"):
        read_status(swarm, None, now=0.0)


def test_status_needs_an_address_to_join_through():
    with pytest.raises(ConfigError, match="--initial-peers"):
        StatusConfig(node=NodeConfig())
    with pytest.raises(ConfigError, match="--initial-peers"):
        NodeConfig(client_mode=True)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0"), (None, ""), (512, "512 B"), (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB"), (2**50, "1024.0 TiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_status_names_the_runs_codecs():
    compressed = dataclasses.replace(
        DASH, compression=CompressionConfig(activations="nf4-s16", gradients="int8", averaging="int8,none")
    )
    text = printed(read_status(FakeSwarm([compressed], {"dash": PEERS}), None, now=100.0))
    assert "compression: activations nf4-s16, gradients int8, averaging int8,none, error feedback on" in text
    assert "compression:" not in printed(read_status(FakeSwarm([DASH], {"dash": PEERS}), None, now=100.0))


def test_status_names_the_runs_loss_when_the_manifest_names_one():
    weighted = dataclasses.replace(DASH, loss="weighted_cross_entropy")
    assert ", loss weighted_cross_entropy, step" in printed(
        read_status(FakeSwarm([weighted], {"dash": PEERS}), None, now=100.0)
    )
    assert ", loss " not in printed(read_status(FakeSwarm([DASH], {"dash": PEERS}), None, now=100.0))


def test_status_shows_a_run_finished_once_its_last_step_is_in():
    short = dataclasses.replace(DASH, max_steps=7)
    finished = dataclasses.replace(PEERS[0], state="finished", step=7)
    going = read_status(FakeSwarm([short], {"dash": PEERS}), None, now=100.0)
    assert not going["finished"] and "(finished)" not in printed(going)
    done = read_status(FakeSwarm([short], {"dash": [finished, PEERS[1]]}), None, now=100.0)
    assert done["finished"] and done["peers"][0]["status"] == "finished"
    assert "step 7 of 7 (finished)" in printed(done)
    last_point = dataclasses.replace(POINT, step=6)  # a trainer committed the last step; its stages left
    assert read_status(FakeSwarm([short], {"dash": []}, [last_point]), None, now=100.0)["finished"]
    assert not read_status(FakeSwarm([DASH], {"dash": [finished]}, [last_point]), None, now=100.0)["finished"]


def test_status_shows_a_lost_stage_and_the_checkpoints_peers_hold():
    held = dataclasses.replace(PEERS[0], checkpoints=(200, 300), banned=())
    lost = dataclasses.replace(PEERS[1], state="lost", step=0, served=0)
    status = read_status(FakeSwarm([DASH], {"dash": [held, lost]}), None, now=100.0)
    assert [r["status"] for r in status["peers"]] == ["serving", "lost"]
    lines = printed(status).splitlines()
    assert any(A[-8:] in line and " 300 " in line for line in lines)  # the newest checkpoint it holds
    assert any(B[-8:] in line and " lost " in line for line in lines)


R1 = "12D3KooWRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRR1"
R2 = "12D3KooWRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRR2"
RL_RUN = dataclasses.replace(
    DASH, loss="grpo", rl=RLConfig(task="add", samples_per_prompt=8, max_staleness=2)
)
ROLLOUTS = [
    PeerRecord(peer_id=R1, role="rollout", step=4, served=320, service_s=0.025, quantize="8bit", failed=2),
    PeerRecord(peer_id=R2, role="rollout", step=6, served=48, service_s=0.05),
    PeerRecord(peer_id=T, role="trainer", step=6, banned=(R2,)),  # its feed banned R2
]
RL_STEP = RLPoint(
    samples=32,
    reward=0.625,
    accuracy=0.5,
    policy_lag=1.25,
    samples_per_s=41.5,
    stale=3,
    rejected=16,
    banned=1,
)


def test_status_of_an_rl_run_shows_its_rollout_peers_and_the_trainers_rl_step():
    point = dataclasses.replace(POINT, rl=RL_STEP)
    status = read_status(FakeSwarm([RL_RUN], {"dash": PEERS + ROLLOUTS}, [point]), None, now=100.0)
    status = json.loads(json.dumps(status, allow_nan=False))
    rollouts = {r["peer_id"]: r for r in status["peers"] if r["role"] == "rollout"}
    assert status["rl"]["rollout_peers"] == 1 and status["manifest"]["rl"]["task"] == "add"
    assert (rollouts[R1]["policy_lag"], rollouts[R2]["policy_lag"]) == (2, 0)  # the stages are at step 6
    assert rollouts[R2]["status"] == "banned" and rollouts[R1]["quantize"] == "8bit"
    assert status["trainers"][0]["rl"]["reward"] == 0.625
    lines = [line.strip() for line in printed(status).splitlines()]
    assert "RL: task add, 8 samples a prompt, max staleness 2; the stages serve policy version 6" in lines
    # the joint planner's view from the records: these announce no decode rate, none follows it
    plan = status["rl_plan"]
    assert (
        plan["consumed_samples_per_s"] > 0 and plan["produced_samples_per_s"] == 0 and plan["auto_peers"] == 0
    )
    assert any(
        line.startswith("planner: the stages can train ~") and "0 peers follow it" in line for line in lines
    )

    def last_row(peer: str) -> list[str]:  # the RL section comes last; the peers table names them too
        return [line.split() for line in lines if line.startswith(peer[-8:])][-1]

    row = last_row(R1)
    assert row == [R1[-8:], "serving", "8bit", "4", "2", "320", "40.0", "2", "0"]
    assert last_row(R2)[:5] == [
        R2[-8:],
        "banned",
        "6",
        "0",
        "48",
    ]
    row = last_row(T)
    assert row == [T[-8:], "5", "0.625", "0.500", "1.25", "41.5", "3", "16", "0", "1"]


def test_status_of_an_rl_step_of_no_samples_says_n_a_and_a_plain_run_has_no_rl_section():
    empty = RLPoint(samples=0, reward=math.nan, accuracy=math.nan, policy_lag=math.nan, samples_per_s=0.0)
    point = dataclasses.replace(POINT, rl=empty)
    status = read_status(FakeSwarm([RL_RUN], {"dash": PEERS}, [point]), None, now=100.0)
    assert status["trainers"][0]["rl"]["reward"] is None
    row = next(
        line.split()
        for line in map(str.strip, printed(status).splitlines())
        if line.startswith(T[-8:]) and "n/a" in line
    )
    assert row[2:5] == ["n/a", "n/a", "n/a"]
    plain = read_status(FakeSwarm([DASH], {"dash": PEERS}, [POINT]), None, now=100.0)
    assert plain["rl"] is None and plain["trainers"][0]["rl"] is None and plain["rl_plan"] is None
    assert "RL" not in printed(plain) and "rollout peers" not in printed(plain)


def test_status_shows_the_cost_models_tokens_per_s_for_the_live_layout_beside_the_measured():
    def layout(rate_a: float, rate_b: float) -> list[PeerRecord]:
        calibrated = {**CAP, "block_flops_per_s": rate_a}  # timed on a block: it wins over flops_per_s
        plain = {**CAP, "flops_per_s": rate_b}
        return [  # neither served yet (no service_s): their announced rates count
            dataclasses.replace(PEERS[0], capacity=calibrated, service_s=0.0),
            dataclasses.replace(PEERS[1], capacity=plain),
        ]

    slow = read_status(FakeSwarm([DASH], {"dash": layout(1e6, 1e6)}, [POINT]), None, now=100.0)
    fast = read_status(FakeSwarm([DASH], {"dash": layout(2e6, 2e6)}, [POINT]), None, now=100.0)
    assert slow["prediction"]["calibrated_peers"] == 1 and slow["prediction"]["stage_peers"] == 2
    assert slow["prediction"]["measured_peers"] == 0
    predicted = slow["prediction"]["predicted_tokens_per_s"]
    assert fast["prediction"]["predicted_tokens_per_s"] == pytest.approx(2 * predicted)  # compute-bound
    # the matmul probe's 1e12 FLOP/s of peer A is not what the model uses: its block's rate is
    assert read_status(FakeSwarm([DASH], {"dash": PEERS}, [POINT]), None, now=100.0)["prediction"][
        "predicted_tokens_per_s"
    ] != pytest.approx(predicted)
    # once both served, their measured seconds per microbatch count, whatever they announced
    served = [dataclasses.replace(r, service_s=0.05) for r in layout(1e6, 1e6)]
    again = [dataclasses.replace(r, service_s=0.05) for r in layout(9e6, 3e6)]
    measured = read_status(FakeSwarm([DASH], {"dash": served}, [POINT]), None, now=100.0)["prediction"]
    assert measured["measured_peers"] == 2
    assert measured == read_status(FakeSwarm([DASH], {"dash": again}, [POINT]), None, now=100.0)["prediction"]
    line = next(line for line in printed(slow).splitlines() if line.startswith("layout:"))
    assert f"predicts {predicted:.0f} tokens/s (of 2 stage peers, 0 at their measured" in line
    assert "1 timed a block of the run's model at join" in line
    assert f"the trainers measure 5300 ({predicted / 5300:.2f}x)" in line
    # no prediction while a stage has no serving replica
    leaving = [PEERS[0], dataclasses.replace(PEERS[1], state="draining")]
    assert read_status(FakeSwarm([DASH], {"dash": leaving}, [POINT]), None, now=100.0)["prediction"] is None


def test_status_says_how_the_layout_came_to_be():
    planned = dataclasses.replace(
        DASH, layout_note="planned from 2 peers: blocks 0-2, 3-3", layout_at=1000.0, assignments={A: 0, B: 1}
    )
    pending = dataclasses.replace(DASH, layout_version=0, layout_note="pending: waiting for 3 stage peers")
    text = printed(read_status(FakeSwarm([planned], {"dash": PEERS}), "dash", now=1180.0))
    assert "layout 1 (planned 3 min ago): planned from 2 peers: blocks 0-2, 3-3" in text
    assert "layout pending: waiting for 3 stage peers" in printed(
        read_status(FakeSwarm([pending], {"dash": []}), "dash", now=1180.0)
    )
    plain = printed(read_status(FakeSwarm([DASH], {"dash": PEERS}), "dash", now=1180.0))
    assert "layout 1" not in plain and "layout pending" not in plain  # a layout set with the run
