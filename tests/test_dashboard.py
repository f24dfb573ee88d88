"""The dashboard: the pure SwarmView and its web app over a fake node (a real swarm in a real
browser: test_dashboard_browser.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import urllib.request

import pytest

from swarmtrain.errors import SwarmError
from swarmtrain.peers.dashboard.server import DashboardConfig, DashboardThread
from swarmtrain.peers.dashboard.state import SwarmView, ViewConfig
from swarmtrain.wire.metrics import RLPoint, TrainerPoint
from swarmtrain.wire.records import CompressionConfig, PeerRecord, RunManifest
from swarmtrain.wire.rl_config import RLConfig

MANIFEST = RunManifest(run_id="dash", model="tiny-gpt", num_blocks=4, stage_bounds=(0, 2, 4))
A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA1"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB2"
C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC3"


def stage_peer(peer_id: str, stage: int, **kw) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="stage", stage=stage, **kw)


def point(step: int, t: float, trainer: str = "trainer", **kw) -> TrainerPoint:
    kw.setdefault("loss", 3.0)
    kw.setdefault("tokens_per_s", 1000.0)
    return TrainerPoint(trainer=trainer, step=step, t=t, **kw)


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


def test_a_planned_layout_is_an_event_and_part_of_the_manifest_summary():
    pending = dataclasses.replace(
        MANIFEST, layout_version=0, layout_note="pending: waiting for 3 stage peers"
    )
    view = SwarmView()
    events = view.update([PeerRecord(peer_id=A, role="candidate", state="joining")], pending, now=100.0)
    assert ("layout", "") in kinds(events) and "layout pending: waiting for 3" in events[0].text
    assert view.stages()[0]["replicas"] == []  # a candidate serves no stage yet
    planned = dataclasses.replace(
        MANIFEST, stage_bounds=(0, 3, 4), layout_note="planned from 2 peers", assignments={A: 0, B: 1}
    )
    events = view.update([stage_peer(A, 0), stage_peer(B, 1)], planned, now=101.0)
    layout = [e.text for e in events if e.kind == "layout"]
    assert layout == ["layout 1: planned from 2 peers"]
    summary = view.snapshot()["manifest"]
    assert summary["layout_version"] == 1 and summary["layout_note"] == "planned from 2 peers"
    assert view.update([stage_peer(A, 0), stage_peer(B, 1)], planned, now=102.0) == []  # said once


def test_the_map_names_each_stages_codecs():
    m = dataclasses.replace(
        MANIFEST,
        stage_bounds=(0, 1, 2, 4),
        compression=CompressionConfig(activations="none,int8", gradients="int8", averaging="nf4,none,fp16"),
    )
    view = SwarmView()
    view.update([stage_peer(A, 0)], m, now=0.0)
    assert [s["codecs"] for s in view.stages()] == [
        {"forward": "none", "backward": None, "averaging": "nf4"},
        {"forward": "int8", "backward": "int8", "averaging": "none"},
        {"forward": None, "backward": "int8", "averaging": "fp16"},
    ]
    assert view.snapshot()["manifest"]["compression"]["activations"] == "none,int8"


def test_state_change_stage_move_and_step_completion_are_events():
    view = SwarmView()
    view.update([stage_peer(A, 0, step=3), stage_peer(B, 1, step=3)], MANIFEST, now=0.0)
    events = view.update(
        [stage_peer(A, 0, step=4, state="draining"), stage_peer(B, 0, step=3)], MANIFEST, now=1.0
    )
    assert kinds(events) == [("state", A), ("move", B), ("step", "")]
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
    view.add_trainer_point(point(1, 19.0, trainer=A))
    view.update([], MANIFEST, now=30.0)
    for t in range(31, 37):
        view.update([stage_peer(C, 1)], MANIFEST, now=float(t))
    assert set(view.peer_series) == {C}
    assert view.trainer_series == {}  # a trainer silent for the whole history is forgotten
    assert len(view.gone) <= view.config.max_gone


def test_served_rate_and_trainer_points_reach_the_snapshot_as_json():
    view = SwarmView()
    view.update([stage_peer(A, 0, served=10)], MANIFEST, now=0.0)
    view.update([stage_peer(A, 0, served=30)], MANIFEST, now=2.0)
    view.update([stage_peer(A, 0, served=5)], MANIFEST, now=3.0)  # the peer restarted: no negative rate
    view.add_trainer_point(point(1, 2.0, loss=5.5, tokens_per_s=1200.0))
    view.add_trainer_point(point(2, 3.0, loss=math.nan, tokens_per_s=1300.0))
    snap = json.loads(json.dumps(view.snapshot(), allow_nan=False))
    assert snap["series"]["peers"][A]["served_per_s"] == [0.0, 10.0, 0.0]
    assert snap["series"]["trainers"]["trainer"]["loss"] == [5.5, None]
    assert snap["manifest"]["stage_bounds"] == [0, 2, 4]
    assert snap["peers"][0]["peer_id"] == A


def test_a_ban_marks_the_banned_peer_and_is_one_event():
    view = SwarmView()
    view.update([stage_peer(A, 0), stage_peer(B, 1)], MANIFEST, now=0.0)
    events = view.update([stage_peer(A, 0, banned=(B,)), stage_peer(B, 1)], MANIFEST, now=1.0)
    assert kinds(events) == [("ban", B)]
    assert events[0].text.startswith(f"stage {A[-8:]}") and f"banned stage {B[-8:]}" in events[0].text
    snap = view.snapshot()
    banned = next(r for r in snap["peers"] if r["peer_id"] == B)
    assert (banned["status"], banned["state"], banned["banned_by"]) == ("banned", "serving", [A])
    assert [r["status"] for r in snap["stages"][1]["replicas"]] == ["banned"]
    assert view.update([stage_peer(A, 0, banned=(B,)), stage_peer(B, 1)], MANIFEST, now=2.0) == []
    view.update([stage_peer(A, 0), stage_peer(B, 1)], MANIFEST, now=3.0)  # the ban expired
    assert [r["status"] for r in view.snapshot()["peers"]] == ["serving", "serving"]


def test_replays_and_drops_are_events_and_a_point_seen_twice_counts_once():
    view = SwarmView()
    view.update([stage_peer(A, 0, replayed=1)], MANIFEST, now=0.0)  # no baseline yet: no event
    events = view.update([stage_peer(A, 0, replayed=4)], MANIFEST, now=1.0)
    assert kinds(events) == [("replay", A)] and "replayed 3 microbatch(es) (4 in all)" in events[0].text
    assert view.add_trainer_point(point(1, 1.0, trainer=C)) == []
    events = view.add_trainer_point(point(2, 2.0, trainer=C, replayed=2, dropped=1))
    assert kinds(events) == [("replay", C), ("drop", C)]
    assert view.add_trainer_point(point(2, 2.0, trainer=C, replayed=2, dropped=1)) == []
    assert [p.step for p in view.trainer_series[C]] == [1, 2]
    assert [e["kind"] for e in view.snapshot()["events"]][-3:] == ["replay", "replay", "drop"]


def test_a_peer_that_left_stays_on_the_map_as_gone_for_a_while():
    view = SwarmView(ViewConfig(leave_after_missing=1, gone_keep_s=10.0, max_gone=2))
    view.update([stage_peer(A, 0), stage_peer(B, 0)], MANIFEST, now=0.0)
    view.update([stage_peer(A, 0)], MANIFEST, now=1.0)
    stage0 = view.stages()[0]
    assert [(r["peer_id"], r["status"]) for r in stage0["replicas"]] == [(A, "serving"), (B, "gone")]
    assert stage0["num_serving"] == 1
    snap = view.snapshot()
    assert [r["peer_id"] for r in snap["peers"]] == [A]
    assert [(r["peer_id"], r["left_at"]) for r in snap["gone"]] == [(B, 1.0)]
    assert kinds(view.update([stage_peer(A, 0), stage_peer(B, 0)], MANIFEST, now=2.0)) == [("join", B)]
    assert view.gone == {}  # back: live again
    view.update([stage_peer(A, 0)], MANIFEST, now=3.0)
    view.update([stage_peer(C, 1)], MANIFEST, now=4.0)  # A leaves too
    view.update([], MANIFEST, now=5.0)  # and C: three gone, two kept
    assert [r["peer_id"] for r in view.snapshot()["gone"]] == [C, A]
    view.update([], MANIFEST, now=20.0)
    assert view.gone == {} and view.stages()[0]["replicas"] == []


def test_wire_rates_compression_and_memory_reach_the_snapshot():
    cap = {"memory_bytes": 2**30, "flops_per_s": 1e12, "device_name": "Xeon"}
    view = SwarmView()
    view.update(
        [stage_peer(A, 0, bytes_sent=1000, raw_bytes_sent=4000, capacity=cap), stage_peer(B, 1)],
        MANIFEST,
        now=0.0,
    )
    a = stage_peer(A, 0, bytes_sent=3000, raw_bytes_sent=12000, memory_used_bytes=2**20, capacity=cap)
    view.update([a, stage_peer(B, 1, bytes_sent=1000, raw_bytes_sent=1000)], MANIFEST, now=2.0)
    assert list(view.bytes_sent_per_s) == [0.0, 1500.0]  # A: 1000/s, B: 500/s
    assert list(view.raw_bytes_sent_per_s) == [0.0, 4500.0]
    peers = {r["peer_id"]: r for r in view.snapshot()["peers"]}
    assert peers[A]["compression"] == 4.0 and peers[B]["compression"] == 1.0
    assert (peers[A]["memory_used_bytes"], peers[A]["memory_total_bytes"]) == (2**20, 2**30)
    assert peers[A]["bytes_sent_per_s"] == 1000.0
    assert view.snapshot()["series"]["peers"][A]["bytes_sent_per_s"] == [0.0, 1000.0]


def test_a_view_started_late_shows_the_swarm_as_it_is_and_matches_the_api_model():
    """A coordinator (or `swarmtrain status`) that starts mid-run sees everything on its first poll."""
    from swarmtrain.peers.dashboard.api import SwarmSnapshot

    records = [
        stage_peer(A, 0, served=40, step=7, queue_depth=2, service_s=0.05, replayed=3, banned=(B,)),
        stage_peer(B, 1, served=38, step=7, failed=1, bytes_sent=10, bytes_received=20, raw_bytes_sent=40),
        PeerRecord(peer_id=C, role="coordinator"),
    ]
    view = SwarmView()
    events = view.update(records, MANIFEST, now=100.0)
    assert sorted(e.kind for e in events) == ["ban", "join", "join", "join"]  # no replay, no step
    view.add_trainer_point(point(7, 99.0, completed=28, window=4))
    snap = json.loads(json.dumps(view.snapshot(), allow_nan=False))
    SwarmSnapshot.model_validate(snap)
    peers = {r["peer_id"]: r for r in snap["peers"]}
    assert (peers[A]["served"], peers[A]["queue_depth"], peers[A]["replayed"]) == (40, 2, 3)
    assert peers[B]["status"] == "banned" and peers[B]["compression"] == 4.0
    assert snap["trainers"][0]["completed"] == 28 and snap["trainers"][0]["window"] == 4
    present = view.snapshot(with_history=False)
    assert "series" not in present and "events" not in present


def test_the_view_keeps_showing_a_finished_run_after_its_stage_peers_left():
    from swarmtrain.peers.dashboard.api import SwarmSnapshot

    view = SwarmView(ViewConfig(leave_after_missing=1))
    run = dataclasses.replace(MANIFEST, max_steps=3)
    view.update([stage_peer(A, 0, step=2), stage_peer(B, 1, step=2)], run, now=1.0)
    assert view.snapshot()["finished"] is False
    view.update([stage_peer(A, 0, step=3, state="finished"), stage_peer(B, 1, step=2)], run, now=2.0)
    snap = view.snapshot()
    SwarmSnapshot.model_validate(snap)
    assert snap["finished"] is True and snap["stages"][0]["replicas"][0]["status"] == "finished"
    view.update([], run, now=3.0)  # they left, as finished stage peers do
    assert view.snapshot()["finished"] is True


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
    def __init__(self, records: list[PeerRecord], points: list[TrainerPoint] = ()):
        self.records = records
        self.points = list(points)

    def get_manifest(self, run_id: str) -> RunManifest:
        return MANIFEST

    def peers(self, run_id: str) -> list[PeerRecord]:
        return list(self.records)

    def trainer_points(self, run_id: str) -> list[dict]:
        return [p.to_dict() for p in self.points] + [{"not": "a point"}]


def test_routes_serve_page_plotly_json_events_and_metrics():
    busy = {"queue_depth": 3, "service_s": 0.25, "replayed": 2, "failed": 1, "bytes_sent": 4096}
    # dated within the test's history: a point older than the first poll is a silent trainer's,
    # dropped at each poll and read again after it (a reader between the two missed it)
    trainer = point(2, time.time() + 60, trainer=C, completed=8, dropped=1)
    node = FakeNode(
        [stage_peer(A, 0, served=7, step=2, **busy), stage_peer(B, 1, served=7, step=2)], [trainer]
    )
    with DashboardThread(node, "dash", DashboardConfig(poll_s=0.1)) as dash:
        assert dash.url.startswith("http://127.0.0.1:")
        wait_for(
            lambda: len(swarm_json(dash)["peers"]) == 2 and swarm_json(dash)["trainers"],
            10,
            "two peers and the trainer's point in /api/swarm",
        )  # (the trainer's points are read apart from the peers' records: both must be in)
        ctype, html = get(dash.url + "/")
        assert ctype.startswith("text/html") and "/static/plotly.min.js" in html and "cdn" not in html.lower()
        ctype, js = get(dash.url + "/static/plotly.min.js")
        assert "javascript" in ctype and len(js) > 1_000_000
        _, text = get(dash.url + "/metrics")
        assert 'swarmtrain_stage_peers{run="dash",stage="0"} 1.0' in text
        assert f'swarmtrain_peer_served_microbatches{{peer_id="{A}",run="dash",stage="0"}} 7.0' in text
        assert 'swarmtrain_step{run="dash"} 2.0' in text
        labels = f'{{peer_id="{A}",run="dash",stage="0"}}'
        for metric, value in [
            ("swarmtrain_peer_queue_depth", 3.0),
            ("swarmtrain_peer_service_seconds", 0.25),
            ("swarmtrain_peer_replayed_microbatches_total", 2.0),
            ("swarmtrain_peer_failed_requests_total", 1.0),
            ("swarmtrain_peer_sent_bytes_total", 4096.0),
            ("swarmtrain_peer_received_bytes_total", 0.0),
            ("swarmtrain_peer_banned", 0.0),
        ]:
            assert f"{metric}{labels} {value}" in text, metric
        assert f'swarmtrain_trainer_dropped_microbatches_total{{run="dash",trainer="{C}"}} 1.0' in text
        assert f'swarmtrain_trainer_loss{{run="dash",trainer="{C}"}} 3.0' in text
        with urllib.request.urlopen(dash.url + "/api/events", timeout=5) as stream:
            assert "text/event-stream" in stream.headers["Content-Type"]
            data = next(line for line in stream if line.startswith(b"data: "))
        assert [p["peer_id"] for p in json.loads(data[len(b"data: ") :])["peers"]] == [A, B]
        node.records = [stage_peer(A, 0)]

        def left() -> list[str]:
            return [e["peer_id"] for e in swarm_json(dash)["events"] if e["kind"] == "leave"]

        assert wait_for(left, 10, "B leaving") == [B]


def test_openapi_documents_the_json_api_and_metrics():
    with DashboardThread(FakeNode([]), "dash") as dash:
        spec = json.loads(get(dash.url + "/openapi.json")[1])
    paths = spec["paths"]
    assert set(paths) == {"/api/swarm", "/api/events", "/metrics"}  # the page and plotly.js are not API
    swarm = paths["/api/swarm"]["get"]
    assert swarm["description"] and swarm["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SwarmSnapshot"
    }
    assert "text/event-stream" in paths["/api/events"]["get"]["responses"]["200"]["content"]
    assert "swarmtrain_peer_queue_depth" in paths["/metrics"]["get"]["description"]
    schemas = spec["components"]["schemas"]
    assert {"SwarmSnapshot", "PeerView", "StageView", "TrainerView", "EventView"} <= set(schemas)
    documented = set(schemas["PeerView"]["properties"])
    missing = {f.name for f in dataclasses.fields(PeerRecord)} - documented
    assert not missing, f"PeerRecord fields {sorted(missing)} are not in peers/dashboard/api.py PeerView"
    assert "compression" in documented


def test_a_taken_port_is_a_clear_error():
    with DashboardThread(FakeNode([]), "dash") as dash, pytest.raises(SwarmError, match="--dashboard-port"):
        DashboardThread(FakeNode([]), "dash", DashboardConfig(port=dash.port))


R = "12D3KooWRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRR1"
RL_RUN = dataclasses.replace(MANIFEST, loss="grpo", rl=RLConfig(task="add", samples_per_prompt=8))


def rl_step(reward: float, **kw) -> RLPoint:
    kw = {"samples": 32, "accuracy": reward, "policy_lag": 0.5, "samples_per_s": 20.0} | kw
    return RLPoint(reward=reward, **kw)


def test_an_rl_run_shows_rollout_lag_and_reward_series_and_a_trainers_ban():
    from swarmtrain.peers.dashboard.api import SwarmSnapshot

    stages = [stage_peer(A, 0, step=4), stage_peer(B, 1, step=4)]
    view = SwarmView()
    view.update(
        [*stages, PeerRecord(peer_id=R, role="rollout", step=3, served=100, quantize="8bit")], RL_RUN, 10.0
    )
    trainer = PeerRecord(peer_id=C, role="trainer", step=4, banned=(R,))  # its feed banned R
    events = view.update(
        [*stages, PeerRecord(peer_id=R, role="rollout", step=3, served=140), trainer], RL_RUN, 12.0
    )
    assert ("ban", R) in kinds(events)
    view.add_trainer_point(point(3, 11.0, trainer=C, rl=rl_step(0.25)))
    view.add_trainer_point(point(4, 12.0, trainer=C, rl=rl_step(0.5, stale=3, rejected=8, banned=1)))
    snap = json.loads(json.dumps(view.snapshot(), allow_nan=False))
    SwarmSnapshot.model_validate(snap)
    assert snap["manifest"]["rl"]["samples_per_prompt"] == 8
    summary = {"policy_version": 4, "rollout_peers": 0, "step": 4, "reward": 0.5, "accuracy": 0.5}
    summary |= {"policy_lag": 0.5, "samples_per_s": 20.0, "stale": 3, "rejected": 8, "banned": 1}
    assert snap["rl"] == summary  # R is banned: no rollout peer serves
    rollout = next(r for r in snap["peers"] if r["peer_id"] == R)
    assert (rollout["policy_lag"], rollout["status"], rollout["served_per_s"]) == (1, "banned", 20.0)
    assert all(r["policy_lag"] is None for r in snap["peers"] if r["role"] != "rollout")
    series = snap["series"]["trainers"][C]
    assert (series["reward"], series["stale"], series["rejected"]) == ([0.25, 0.5], [0, 3], [0, 8])
    assert snap["series"]["peers"][R]["role"] == "rollout" and snap["series"]["peers"][A]["role"] == "stage"
    assert snap["series"]["bytes_sent_per_s"] == [0.0, 0.0]  # a rollout peer's samples are no wire traffic
    assert snap["trainers"][0]["rl"]["banned"] == 1


def test_a_plain_run_is_no_rl_run_and_an_rl_step_of_no_samples_is_a_gap():
    view = SwarmView()
    view.update([stage_peer(A, 0)], MANIFEST, now=1.0)
    view.add_trainer_point(point(0, 1.0))
    snap = view.snapshot()
    assert snap["rl"] is None and snap["trainers"][0]["rl"] is None
    assert snap["series"]["trainers"]["trainer"]["reward"] == [None]
    empty = RLPoint(samples=0, reward=math.nan, accuracy=math.nan, policy_lag=math.nan, samples_per_s=0.0)
    view.add_trainer_point(point(1, 2.0, rl=empty))
    snap = json.loads(json.dumps(view.snapshot(), allow_nan=False))  # NaN means travel as null
    assert snap["trainers"][0]["rl"]["reward"] is None and snap["series"]["trainers"]["trainer"]["stale"] == [
        None,
        0,
    ]
    headless = SwarmView()  # no manifest: a rollout peer says it is an RL run
    headless.update([PeerRecord(peer_id=R, role="rollout")], None, now=1.0)
    assert headless.snapshot()["rl"]["rollout_peers"] == 1


def test_the_rl_summary_weighs_each_trainers_step_by_its_samples():
    from swarmtrain.peers.dashboard.rl_view import rl_summary

    latest = [
        point(6, 1.0, trainer=A, rl=rl_step(0.25, samples=32, samples_per_s=10.0, stale=1, banned=2)),
        point(
            7, 2.0, trainer=B, rl=rl_step(0.75, samples=96, samples_per_s=30.0, rejected=4, policy_lag=1.0)
        ),
        point(7, 2.0, trainer=C),  # no RL figures: left out
    ]
    summary = rl_summary(latest, policy_version=8, rollouts=3)
    assert (summary["reward"], summary["policy_lag"], summary["samples_per_s"]) == (0.625, 0.875, 40.0)
    assert (summary["step"], summary["stale"], summary["rejected"], summary["banned"]) == (7, 1, 4, 2)
    nothing = rl_summary([point(1, 1.0)], policy_version=None, rollouts=0)
    assert nothing["reward"] is None and nothing["step"] is None and nothing["samples_per_s"] == 0


def test_completed_steps_fold_into_one_line_between_the_events_that_matter():
    view = SwarmView(ViewConfig(events_len=4))
    view.update([stage_peer(A, 0, step=0)], MANIFEST, now=0.0)
    for t in range(1, 30):  # 29 steps complete: one line, however many
        view.update([stage_peer(A, 0, step=t)], MANIFEST, now=float(t))
    view.update([stage_peer(A, 0, step=30), stage_peer(B, 1, step=30)], MANIFEST, now=30.0)  # B joins
    view.update([stage_peer(A, 0, step=31), stage_peer(B, 1, step=31)], MANIFEST, now=31.0)
    view.update([stage_peer(A, 0, step=33), stage_peer(B, 1, step=33)], MANIFEST, now=32.0)  # a poll missed one
    log = [e.to_dict() for e in view.events]
    assert [(e["kind"], e["count"]) for e in log] == [("join", 1), ("step", 29), ("join", 1), ("step", 3)]
    assert [e["text"] for e in log[1::2]] == ["steps 1-29 completed", "steps 30-33 completed"]
    assert log[1]["t"] == 29.0  # a folded line's time is its latest step's
    assert "joined" in log[0]["text"] and "joined" in log[2]["text"]  # 4 lines hold both joins
