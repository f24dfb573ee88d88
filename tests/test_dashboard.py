"""The dashboard: the pure SwarmView, its web app over a fake node, and a real swarm behind it."""

from __future__ import annotations

import json
import math
import signal
import time
import urllib.request

import pytest

from swarmtrain.errors import SwarmError
from swarmtrain.peers.dashboard.server import DashboardConfig, DashboardThread
from swarmtrain.peers.dashboard.state import SwarmView, ViewConfig
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import PeerRecord, RunManifest
from tests.conftest import TINY_GPT

MANIFEST = RunManifest(run_id="dash", model="tiny-gpt", num_blocks=4, stage_bounds=(0, 2, 4))
A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA1"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB2"
C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC3"


def stage_peer(peer_id: str, stage: int, **kw) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="stage", stage=stage, **kw)


def kinds(events) -> list[tuple[str, str]]:
    return [(e.kind, e.peer_id) for e in events]


# SwarmView: pure


def test_first_poll_reports_joins_and_maps_stages_to_block_spans():
    view = SwarmView()
    events = view.update([stage_peer(A, 0, device="cuda:0 (H200)"), stage_peer(B, 1)], MANIFEST, now=100.0)
    assert kinds(events) == [("join", A), ("join", B)]
    stages = view.stages()
    assert [s["blocks"] for s in stages] == [[0, 2], [2, 4]]
    assert [[r["peer_id"] for r in s["replicas"]] for s in stages] == [[A], [B]]
    assert stages[0]["replicas"][0]["device"] == "cuda:0 (H200)"
    assert list(view.peers_per_stage) == [(1, 1)]


def test_state_change_stage_move_and_step_completion_are_events():
    view = SwarmView()
    view.update([stage_peer(A, 0, step=3), stage_peer(B, 1, step=3)], MANIFEST, now=0.0)
    events = view.update(
        [stage_peer(A, 0, step=4, state="draining"), stage_peer(B, 0, step=3)], MANIFEST, now=1.0
    )
    assert kinds(events) == [("state", A), ("stage", B), ("step", "")]
    assert "serving -> draining" in events[0].text
    assert "stage 1 to stage 0" in events[1].text
    assert events[2].text == "step 4 completed"
    assert view.stages()[0]["num_serving"] == 1  # B serves; A drains
    assert list(view.peers_per_stage)[-1] == (1, 0)


def test_a_peer_leaves_after_missing_polls_and_a_single_miss_is_tolerated():
    view = SwarmView(ViewConfig(leave_after_missing=2))
    view.update([stage_peer(A, 0), stage_peer(B, 1)], MANIFEST, now=0.0)
    assert view.update([stage_peer(A, 0)], MANIFEST, now=1.0) == []
    assert (
        view.update([stage_peer(A, 0), stage_peer(B, 1)], MANIFEST, now=2.0) == []
    )  # back: no leave, no join
    view.update([stage_peer(A, 0)], MANIFEST, now=3.0)
    events = view.update([stage_peer(A, 0)], MANIFEST, now=4.0)
    assert kinds(events) == [("leave", B)]
    assert set(view.peers) == {A}
    assert kinds(view.update([stage_peer(A, 0), stage_peer(C, 1)], MANIFEST, now=5.0)) == [("join", C)]


def test_history_and_event_log_are_bounded_and_gone_peers_are_forgotten():
    view = SwarmView(ViewConfig(history_len=5, events_len=3, leave_after_missing=1))
    for t in range(20):
        peer = A if t % 2 else B  # every poll: one joins, the other leaves
        view.update([stage_peer(peer, 0, served=t)], MANIFEST, now=float(t))
    assert len(view.times) == len(view.step) == len(view.peers_per_stage) == 5
    assert list(view.times) == [15.0, 16.0, 17.0, 18.0, 19.0]
    assert len(view.events) == 3
    assert all(len(s) <= 5 for s in view.peer_series.values())
    view.update([], MANIFEST, now=30.0)
    for t in range(31, 37):
        view.update([stage_peer(C, 1)], MANIFEST, now=float(t))
    assert set(view.peer_series) == {C}


def test_served_rate_and_trainer_points_reach_the_snapshot_as_json():
    view = SwarmView()
    view.update([stage_peer(A, 0, served=10)], MANIFEST, now=0.0)
    view.update([stage_peer(A, 0, served=30)], MANIFEST, now=2.0)
    view.update([stage_peer(A, 0, served=5)], MANIFEST, now=3.0)  # the peer restarted: no negative rate
    view.add_trainer_point(1, 5.5, 1200.0, now=2.0)
    view.add_trainer_point(2, math.nan, 1300.0, now=3.0)
    snap = json.loads(json.dumps(view.snapshot(), allow_nan=False))
    assert snap["series"]["peers"][A]["served_per_s"] == [0.0, 10.0, 0.0]
    assert snap["series"]["trainers"]["trainer"]["loss"] == [5.5, None]
    assert snap["manifest"]["stage_bounds"] == [0, 2, 4]
    assert snap["peers"][0]["peer_id"] == A


def test_a_view_without_manifest_has_peers_but_no_map():
    view = SwarmView()
    view.update([stage_peer(A, 0)], None, now=0.0)
    snap = view.snapshot()
    assert snap["manifest"] is None and snap["stages"] == [] and len(snap["peers"]) == 1


# the web app, over a fake node


def get(url: str, timeout_s: float = 5.0) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll `predicate()` until it returns something truthy; fail saying `what` did not happen."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"{what} within {timeout_s} s (last: {last!r})")


def swarm_json(dash: DashboardThread) -> dict:
    return json.loads(get(dash.url + "/api/swarm")[1])


class FakeNode:
    def __init__(self, records: list[PeerRecord]):
        self.records = records

    def get_manifest(self, run_id: str) -> RunManifest:
        return MANIFEST

    def peers(self, run_id: str) -> list[PeerRecord]:
        return list(self.records)

    def trainer_points(self, run_id: str) -> list[dict]:
        return []


def test_routes_serve_page_plotly_json_events_and_metrics():
    node = FakeNode([stage_peer(A, 0, served=7, step=2), stage_peer(B, 1, served=7, step=2)])
    with DashboardThread(node, "dash", DashboardConfig(poll_s=0.1)) as dash:
        assert dash.url.startswith("http://127.0.0.1:")
        wait_for(lambda: len(swarm_json(dash)["peers"]) == 2, 10, "two peers in /api/swarm")
        ctype, html = get(dash.url + "/")
        assert ctype.startswith("text/html") and "/static/plotly.min.js" in html and "cdn" not in html.lower()
        ctype, js = get(dash.url + "/static/plotly.min.js")
        assert "javascript" in ctype and len(js) > 1_000_000
        _, text = get(dash.url + "/metrics")
        assert 'swarmtrain_stage_peers{run="dash",stage="0"} 1.0' in text
        assert f'swarmtrain_peer_served_microbatches{{peer_id="{A}",run="dash",stage="0"}} 7.0' in text
        assert 'swarmtrain_step{run="dash"} 2.0' in text
        with urllib.request.urlopen(dash.url + "/api/events", timeout=5) as stream:
            assert "text/event-stream" in stream.headers["Content-Type"]
            data = next(line for line in stream if line.startswith(b"data: "))
        assert [p["peer_id"] for p in json.loads(data[len(b"data: ") :])["peers"]] == [A, B]
        node.records = [stage_peer(A, 0)]

        def left() -> list[str]:
            return [e["peer_id"] for e in swarm_json(dash)["events"] if e["kind"] == "leave"]

        assert wait_for(left, 10, "B leaving") == [B]


def test_a_taken_port_is_a_clear_error():
    with DashboardThread(FakeNode([]), "dash") as dash, pytest.raises(SwarmError, match="--dashboard-port"):
        DashboardThread(FakeNode([]), "dash", DashboardConfig(port=dash.port))


# a real swarm behind it


@pytest.mark.swarm
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dashboard_follows_a_real_swarm(local_swarm):
    swarm = local_swarm(run_id="dash", model_config=TINY_GPT, num_stages=2)
    node = SwarmNode(NodeConfig(initial_peers=(swarm.address,)))
    dash = DashboardThread(node, "dash", DashboardConfig(poll_s=0.5))
    try:

        def stage_peers() -> dict[int, str]:
            view = swarm_json(dash)
            return {r["stage"]: r["peer_id"] for r in view["peers"] if r["role"] == "stage"}

        peers = wait_for(
            lambda: len(stage_peers()) == 2 and stage_peers(), 30, "both stage peers in /api/swarm"
        )
        view = swarm_json(dash)
        assert view["manifest"]["num_stages"] == 2
        assert [len(s["replicas"]) for s in view["stages"]] == [1, 1]
        _, text = get(dash.url + "/metrics")
        assert 'swarmtrain_stage_peers{run="dash",stage="1"} 1.0' in text
        assert "swarmtrain_peer_served_microbatches{" in text and 'swarmtrain_step{run="dash"}' in text

        # A trainer's steps reach the loss and tokens/s charts through the DHT.
        with swarm.trainer() as trainer:
            data = TokenBatches(stdlib_text(2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=8, seed=0)
            results = list(trainer.train(data, steps=2))
            trainer_id = trainer.node.peer_id

        def trainer_series() -> dict:
            return swarm_json(dash)["series"]["trainers"].get(trainer_id, {})

        # The dashboard samples each trainer's latest point (every poll_s), so it sees step 1 last.
        wait_for(
            lambda: trainer_series().get("step", [None])[-1] == 1,
            30,
            "the trainer's last step on the dashboard",
        )
        assert trainer_series()["loss"][-1] == pytest.approx(results[-1].loss)

        swarm.signal("stage1-2", signal.SIGKILL)
        ttl_s = 6.0  # StageConfig.ttl_s, the default `swarmtrain join` runs with
        wait_for(
            lambda: 1 not in stage_peers(), ttl_s + 15, "the killed stage-1 peer leaving", interval_s=0.5
        )
        events = swarm_json(dash)["events"]
        assert ("leave", peers[1]) in [(e["kind"], e["peer_id"]) for e in events]
    finally:
        dash.stop()
        node.shutdown()
