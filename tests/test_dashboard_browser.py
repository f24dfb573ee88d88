"""End to end: a real swarm, its coordinator's dashboard in a headless chromium, and
`swarmtrain status` once the coordinator is dead.

Screenshots land in the test's tmp dir and are copied to `artifacts/` at the repository root
(git-ignored): dashboard.png (1280x800 viewport), dashboard-full.png (the whole page) and
dashboard-narrow.png (420 px wide, the whole page).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import CompressionConfig
from tests.browser import screenshot, set_viewport, start_browser
from tests.conftest import TINY_GPT, wait_until

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
SCRIPT = Path(sys.executable).with_name("swarmtrain")
CLI = (str(SCRIPT),) if SCRIPT.exists() else (sys.executable, "-m", "swarmtrain.cli")
TTL_S = 6.0
"""StageConfig.ttl_s, the default `swarmtrain join` runs with: a killed peer's record lives this long."""

MAP_JS = """return [...document.querySelectorAll('#map .replica')].map(
    e => [e.dataset.peer, e.dataset.status, e.closest('.stage').dataset.stage])"""
TABLE_JS = """return [...document.querySelectorAll('#peers tr[data-peer]')].map(tr => [tr.dataset.peer,
    tr.querySelector('[data-col=status]').textContent, tr.querySelector('[data-col=served]').textContent])"""
CODECS_JS = """return [...document.querySelectorAll('#map .stage')].map(
    s => s.querySelector('.codecs').textContent.trim().replace(/\\s+/g, ' '));"""
CHART_JS = """const div = document.getElementById(arguments[0]);
    return (div && div.data || []).map(trace => trace.y || [])"""
OVERFLOW_JS = """const width = document.documentElement.clientWidth, right = e => e.getBoundingClientRect().right;
    return [document.documentElement.scrollWidth - width,
        ...[...document.querySelectorAll('section')].map(s => Math.ceil(right(s)) - width),
        ...[...document.querySelectorAll('.chart')].map(c => Math.ceil(right(c.querySelector('svg') || c) - right(c)))]"""
"""How far the page, each section and each chart's plot stick out of their box (px; <= 0: they fit)."""
CHARTS_RESIZED_JS = """return document.documentElement.clientWidth === arguments[0] &&
    [...document.querySelectorAll('.chart')].every(c => {
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
        tokens = [v for y in browser.execute_script(CHART_JS, "chart-tokens") for v in y]
        assert tokens and all(math.isfinite(v) and v > 0 for v in tokens), tokens
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
