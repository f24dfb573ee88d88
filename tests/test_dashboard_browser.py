"""End to end: a real swarm, its coordinator's dashboard in a headless chromium, and
`swarmtrain status` once the coordinator is dead; and the RL panel of the real page, served by
the real app over a view the test feeds (an RL run's records and trainer points), next to a
plain run's page, which has none.

Screenshots land in the test's tmp dir and are copied to `artifacts/` at the repository root
(git-ignored): dashboard.png (1280x800 viewport), dashboard-full.png (the whole page),
dashboard-narrow.png (420 px wide, the whole page), dashboard-rl.png (an RL run, the whole
page) and dashboard-rl-narrow.png (the same, 420 px wide).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from swarmtrain.peers.dashboard.state import SwarmView
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.metrics import RLPoint, TrainerPoint
from swarmtrain.wire.records import CompressionConfig, PeerRecord, RunManifest
from swarmtrain.wire.rl_config import RLConfig
from tests.browser import screenshot, set_viewport, start_browser
from tests.conftest import TINY_GPT, wait_until

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
SCRIPT = Path(sys.executable).with_name("swarmtrain")
CLI = (str(SCRIPT),) if SCRIPT.exists() else (sys.executable, "-m", "swarmtrain.cli")
TTL_S = 6.0
"""StageConfig.ttl_s, the default `swarmtrain join` runs with: a killed peer's record lives this long."""

EVENT_KINDS_JS = "return [...document.querySelectorAll('#events > div')].map(d => d.className)"
"""The event log's lines, newest first, by kind."""
MAP_JS = """return [...document.querySelectorAll('#map .replica')].map(
    e => [e.dataset.peer, e.dataset.status, e.closest('.stage').dataset.stage])"""
TABLE_JS = """return [...document.querySelectorAll('#peers tr[data-peer]')].map(tr => [tr.dataset.peer,
    tr.querySelector('[data-col=status]').textContent, tr.querySelector('[data-col=served]').textContent])"""
CODECS_JS = """return [...document.querySelectorAll('#map .stage')].map(
    s => s.querySelector('.codecs').textContent.trim().replace(/\\s+/g, ' '));"""
CHART_JS = """const div = document.getElementById(arguments[0]);
    return (div && div.data || []).map(trace => trace.y || [])"""
NAMED_TRACES_JS = """const div = document.getElementById(arguments[0]);
    return (div && div.data || []).map(trace => [trace.name, trace.y || []])"""
OVERFLOW_JS = """const width = document.documentElement.clientWidth, right = e => e.getBoundingClientRect().right;
    return [document.documentElement.scrollWidth - width,
        ...[...document.querySelectorAll('section')].map(s => Math.ceil(right(s)) - width),
        ...[...document.querySelectorAll('.chart')].map(c => Math.ceil(right(c.querySelector('svg') || c) - right(c)))]"""
"""How far the page, each section and each chart's plot stick out of their box (px; <= 0: they fit)."""
CHARTS_RESIZED_JS = """return document.documentElement.clientWidth === arguments[0] &&
    [...document.querySelectorAll('.chart')].filter(c => c.offsetParent).every(c => {
        const svg = c.querySelector('svg'); return svg && Math.abs(svg.clientWidth - c.clientWidth) <= 1; })"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def status_command(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, "status", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"swarmtrain status exited with {proc.returncode}:\n{err}"
    return out


@pytest.mark.swarm
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dashboard_in_a_browser_follows_a_real_swarm_and_status_outlives_the_coordinator(
    local_swarm, tmp_path
):
    stage0_port = free_port()  # so that `status` can join through stage 0 once the coordinator is dead
    swarm = local_swarm(
        run_id="dash",
        model_config=TINY_GPT,
        num_stages=2,
        compression=CompressionConfig(activations="int8", gradients="int8"),
        dashboard_port=0,
        stage_args={0: ("--port", str(stage0_port))},
    )
    assert swarm.dashboard_url, swarm.log_tail("coordinator")
    ids = [swarm.wait_ready("stage0-1"), swarm.wait_ready("stage1-2")]
    browser = start_browser(1280, 800)
    try:
        browser.get(swarm.dashboard_url)
        serving = {(ids[0], "serving", "0"), (ids[1], "serving", "1")}
        wait_until(
            lambda: set(map(tuple, browser.execute_script(MAP_JS))) == serving,
            timeout_s=30,
            what="both stage peers serving on the swarm map",
        )

        codecs = browser.execute_script(CODECS_JS)
        assert codecs == ["\u2192 int8 \u2194 none", "\u2190 int8 \u2194 none"], (
            codecs
        )  # forward, back, averaging

        # Train while the page is open: what follows reaches it over SSE, without a reload.
        with swarm.trainer() as trainer:
            data = TokenBatches(stdlib_text(2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=8, seed=0)
            results = list(trainer.train(data, steps=3))
        loss = results[-1].loss

        def served_in_table() -> dict[str, int]:
            rows = browser.execute_script(TABLE_JS)
            return {peer: int(served) for peer, _, served in rows if peer in ids and served}

        wait_until(
            lambda: len(served_in_table()) == 2 and min(served_in_table().values()) > 0,
            timeout_s=20,
            what="both stage peers' served counts > 0 in the peer table",
        )
        wait_until(
            lambda: any(
                y and y[-1] == pytest.approx(loss) for y in browser.execute_script(CHART_JS, "chart-loss")
            ),
            timeout_s=20,
            what=f"the trainer's last loss {loss:.4f} on the loss chart",
        )
        traces = dict(browser.execute_script(NAMED_TRACES_JS, "chart-tokens"))
        predicted = traces.pop("predicted (cost model)")  # the stage peers timed a block at join
        tokens = [v for y in traces.values() for v in y]
        assert tokens and all(math.isfinite(v) and v > 0 for v in tokens), tokens
        assert any(v is not None and v > 0 for v in predicted), predicted
        assert "step" in browser.find_element("id", "progress").text

        metrics = get(swarm.dashboard_url + "/metrics")
        for name in (
            "swarmtrain_peer_queue_depth{",
            "swarmtrain_peer_sent_bytes_total{",
            "swarmtrain_trainer_loss{",
        ):
            assert name in metrics, name

        # A peer killed outright turns grey on the map (gone) once its record expires.
        swarm.signal("stage1-2", signal.SIGKILL)
        wait_until(
            lambda: (ids[1], "gone", "1") in set(map(tuple, browser.execute_script(MAP_JS))),
            timeout_s=TTL_S + 20,
            what="the killed stage-1 peer shown as gone on the map",
        )
        assert [ids[1], "gone"] in [row[:2] for row in browser.execute_script(TABLE_JS)]
        assert "left" in browser.find_element("id", "events").text

        # Completed steps fold into one line between the events that matter, and a kind of
        # event can be hidden (and stays hidden as new views arrive).
        kinds = browser.execute_script(EVENT_KINDS_JS)
        assert "step" in kinds and "leave" in kinds, kinds
        assert not any(a == b == "step" for a, b in zip(kinds, kinds[1:])), kinds
        browser.execute_script("document.querySelector('#event-kinds input[data-kind=\"step\"]').click()")
        wait_until(
            lambda: "step" not in browser.execute_script(EVENT_KINDS_JS),
            timeout_s=10,
            what="step events hidden by their filter",
        )
        assert "leave" in browser.execute_script(EVENT_KINDS_JS)

        shots = [
            screenshot(browser, tmp_path / "dashboard.png"),
            screenshot(browser, tmp_path / "dashboard-full.png", full_page=True),
        ]
        set_viewport(browser, 420, 800)
        wait_until(
            lambda: browser.execute_script(CHARTS_RESIZED_JS, 420),
            timeout_s=10,
            what="the charts redrawn for a 420 px window",
        )
        overflow = browser.execute_script(OVERFLOW_JS)
        assert max(overflow) <= 1, f"the page overflows a 420 px window: by {overflow} px"
        shots.append(screenshot(browser, tmp_path / "dashboard-narrow.png", full_page=True))
    finally:
        browser.quit()
    ARTIFACTS.mkdir(exist_ok=True)
    for shot in shots:
        assert shot.stat().st_size > 10_000, f"{shot} is nearly empty"
        shutil.copy(shot, ARTIFACTS / shot.name)

    # Without its coordinator, the swarm still answers `status` through its stage peers.
    swarm.signal("coordinator", signal.SIGKILL)
    address = f"/ip4/127.0.0.1/tcp/{stage0_port}/p2p/{ids[0]}"
    as_json = status_command("--initial-peers", address, "--run-id", "dash", "--json")
    as_table = status_command("--initial-peers", address)
    report = json.loads(finish(as_json))
    assert report["manifest"]["run_id"] == "dash" and report["manifest"]["stage_bounds"] == [0, 2, 4]
    assert report["manifest"]["compression"]["activations"] == "int8"
    assert [(r["peer_id"], r["status"]) for r in report["stages"][0]["replicas"]] == [(ids[0], "serving")]
    assert report["stages"][1]["replicas"] == []  # the killed peer's record has expired
    assert report["trainers"][0]["step"] == results[-1].step
    assert report["trainers"][0]["loss"] == pytest.approx(loss)
    table = finish(as_table)
    assert "run 'dash'" in table and ids[0][-8:] in table and "serving" in table


# The RL panel: the real page and app over a view the test feeds.

A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA1"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB2"
R1 = "12D3KooWRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRR1"
R2 = "12D3KooWRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRR2"
T = "12D3KooWTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT3"
PLAIN = RunManifest(run_id="plain", model="tiny-gpt", num_blocks=4, stage_bounds=(0, 2, 4))
RL_RUN = dataclasses.replace(
    PLAIN,
    run_id="grpo",
    loss="grpo",
    rl=RLConfig(task="add", samples_per_prompt=8, max_staleness=2),
    layout_note="planned from 2 peers: blocks 0-1, 2-3, 900 tokens/s predicted, 1.00x the even split",
)  # a layout planned from the peers that came (`coordinator --min-peers`)
REWARDS = [round(0.1 + 0.65 * (1 - 0.9**step), 3) for step in range(24)]
"""Each step's mean reward (and accuracy: the reward is binary), rising as the policy learns."""
FIGURES_JS = """return Object.fromEntries([...document.querySelectorAll('#rl-figures [data-fig]')].map(
    f => [f.dataset.fig, f.querySelector('b').textContent]))"""
ROLLOUTS_JS = """return [...document.querySelectorAll('#rollouts tr[data-peer]')].map(tr => [tr.dataset.peer,
    ...['status', 'version', 'lag'].map(col => tr.querySelector(`[data-col=${col}]`).textContent)])"""


def rl_view(manifest: RunManifest) -> SwarmView:
    """A run seen over len(REWARDS) polls three seconds apart: two stage peers applying a step
    a poll, a rollout peer in 8-bit a version behind and one the trainer banned after step 2
    (for an RL run), and the trainer's point of each step."""
    view, t0 = SwarmView(), time.time() - 3 * len(REWARDS)
    for step, reward in enumerate(REWARDS):
        now = t0 + 3 * step
        banned = (R2,) if step >= 2 else ()
        records = [
            PeerRecord(peer_id=A, role="stage", stage=0, step=step, served=16 * step, since=t0),
            PeerRecord(peer_id=B, role="stage", stage=1, step=step, served=16 * step, since=t0),
            PeerRecord(peer_id=T, role="trainer", step=step, banned=banned if manifest.rl else (), since=t0),
        ]
        if manifest.rl:
            records += [
                PeerRecord(peer_id=R1, role="rollout", step=max(step - 1, 0), served=40 * step,
                           service_s=0.02, quantize="8bit", since=t0),
                PeerRecord(peer_id=R2, role="rollout", step=step, served=24 * min(step, 2), service_s=0.03, since=t0),
            ]  # fmt: skip
        view.update(records, manifest, now)
        rl = RLPoint(
            samples=64, reward=reward, accuracy=reward, policy_lag=0.5 + step % 2 / 2, samples_per_s=32.0 + step,
            stale=step // 3, rejected=16 if step >= 2 else 0, banned=1 if step >= 2 else 0,
        )  # fmt: skip
        view.add_trainer_point(
            TrainerPoint(trainer=T, step=step, loss=0.5 - reward / 4, tokens_per_s=900.0, t=now,
                         rl=rl if manifest.rl else None)
        )  # fmt: skip
    return view


@contextlib.contextmanager
def serving(view: SwarmView):
    """The dashboard's app over `view` (no poller: the test fed it) on a free port; yields its URL."""
    import uvicorn

    from swarmtrain.peers.dashboard.server import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    config = uvicorn.Config(
        create_app(lambda: view, stream_interval_s=0.2), log_config=None, access_log=False, lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


@pytest.mark.timeout(120)
def test_the_rl_panel_shows_an_rl_runs_figures_and_a_plain_run_has_none(tmp_path):
    browser = start_browser(1280, 800)
    try:
        with serving(rl_view(RL_RUN)) as url:
            browser.get(url)
            wait_until(
                lambda: browser.execute_script(FIGURES_JS).get("reward") == f"{REWARDS[-1]:.3f}",
                timeout_s=20,
                what="the RL panel's figures",
            )
            assert browser.find_element("id", "rl").is_displayed()
            layout = browser.find_element("id", "layout").text
            assert layout.startswith("layout 1: planned from 2 peers: blocks 0-1, 2-3"), layout
            last = len(REWARDS) - 1  # the stages hold its version
            assert browser.execute_script(FIGURES_JS) == {
                "version": "23", "reward": "0.692", "accuracy": "69.2%", "lag": "1.00", "samples": "55.0",
                "rollouts": "1", "stale": "7", "rejected": "16", "banned": "1",
            }  # fmt: skip
            assert browser.execute_script(ROLLOUTS_JS) == [
                [R1, "serving", "22", "1"],
                [R2, "banned", "23", "0"],
            ]
            rl_run = browser.find_element("id", "rl-run").text
            assert "task add" in rl_run and "max staleness 2" in rl_run and f"last RL step {last}" in rl_run
            assert "8bit" in browser.find_element("id", "rollouts").text
            reward, accuracy = browser.execute_script(CHART_JS, "chart-reward")
            assert reward == accuracy == REWARDS
            stale, rejected = browser.execute_script(CHART_JS, "chart-dropped")
            assert stale[-1] == last // 3 and rejected == [0, 0] + [16] * (last - 1)
            trained, *sampled = browser.execute_script(CHART_JS, "chart-samples")
            assert trained == [32.0 + s for s in range(len(REWARDS))] and len(sampled) == 2
            assert len(browser.execute_script(CHART_JS, "chart-served")) == 2  # stage peers only
            assert "reward 0.692" in browser.find_element("id", "progress").text
            shots = [screenshot(browser, tmp_path / "dashboard-rl.png", full_page=True)]
            set_viewport(browser, 420, 800)
            wait_until(
                lambda: browser.execute_script(CHARTS_RESIZED_JS, 420),
                timeout_s=10,
                what="the charts redrawn for a 420 px window",
            )
            overflow = browser.execute_script(OVERFLOW_JS)
            assert max(overflow) <= 1, f"the RL page overflows a 420 px window: by {overflow} px"
            shots.append(screenshot(browser, tmp_path / "dashboard-rl-narrow.png", full_page=True))
            set_viewport(browser, 1280, 800)

        with serving(rl_view(PLAIN)) as url:
            browser.get(url)
            wait_until(
                lambda: browser.execute_script(CHART_JS, "chart-loss"),
                timeout_s=20,
                what="the plain run's loss chart",
            )
            assert not browser.find_element("id", "rl").is_displayed()
            assert browser.execute_script(CHART_JS, "chart-reward") == []  # never drawn
            assert "reward" not in browser.find_element("id", "progress").text
            assert not browser.find_element("id", "layout").text.startswith("layout")  # set from the start
    finally:
        browser.quit()
    ARTIFACTS.mkdir(exist_ok=True)
    for shot in shots:
        assert shot.stat().st_size > 10_000, f"{shot} is nearly empty"
        shutil.copy(shot, ARTIFACTS / shot.name)
