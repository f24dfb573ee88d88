"""What a newcomer runs first: `swarmtrain demo` and the examples."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_demo_trains_a_compressed_three_stage_swarm_and_reports_json():
    proc = run(
        [
            sys.executable, "-m", "swarmtrain.cli", "demo",
            "--stages", "3", "--steps", "30",
            "--model-config", "n_layer=3,d_model=64,seq_len=32",
            "--microbatch-size", "8",
            "--compress", "int8",
            "--json",
        ],
        timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["stages"] == 3 and summary["steps"] == 30
    assert summary["uniform_loss"] == pytest.approx(math.log(256))
    assert summary["initial_loss"] > summary["uniform_loss"] - 0.3  # starts near a uniform guess
    assert summary["final_loss"] < summary["initial_loss"] - 1.0  # and learns
    assert summary["tokens_per_s"] > 0 and summary["replays"] == 0
    # int8 everywhere: 3.9x fewer tensor bytes, less what the uncompressed link probes at start-up add
    assert summary["compression"] == "int8"
    assert summary["raw_bytes"] > 2 * summary["wire_bytes"] > 0, summary
    assert "swarmtrain join --initial-peers /ip4/127.0.0.1/tcp/" in proc.stderr  # how to join it
    assert "dashboard: http://127.0.0.1:" in proc.stderr  # and where to watch it


def test_custom_model_example_trains():
    proc = run([sys.executable, "examples/custom_model.py", "--steps", "25"], timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_rl_example_trains_grpo_through_a_swarm_started_from_its_warm_up():
    proc = run(
        [
            sys.executable,
            "examples/rl_add.py",
            "--steps",
            "4",
            "--rollout-peers",
            "1",
            "--eval-prompts",
            "100",
        ],
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    steps = [line.split() for line in lines if line.startswith("step")]
    assert [int(s[1]) for s in steps] == [0, 1, 2, 3]
    losses = [float(s[3]) for s in steps]
    rewards = [float(s[5]) for s in steps]
    lags = [float(s[8]) for s in steps]
    assert all(math.isfinite(x) for x in losses), losses
    assert all(0 <= r <= 1 for r in rewards), rewards
    # a policy from the seed is never right: rewards come from the warm-up's weights
    assert any(r > 0 for r in rewards), rewards
    assert all(0 <= lag <= 2 for lag in lags), lags  # nothing older than max_staleness trained
    warm = float(lines[0].split()[-1])
    assert lines[0].startswith("warm-up:") and 0 < warm <= 1, lines[0]
    words = lines[-1].split()  # held-out accuracy: B after the warm-up, A after 4 GRPO steps
    assert float(words[2]) == warm and 0 <= float(words[6]) <= 1, lines[-1]


def test_rl_example_refuses_a_swarm_without_rollout_peers():
    proc = run([sys.executable, "examples/rl_add.py", "--rollout-peers", "0"], timeout=60)
    assert proc.returncode == 2
    assert "--rollout-peers: must be an integer >= 1, got '0'" in proc.stderr


def test_heterogeneous_demo_plans_unequal_stages_and_matches_the_homogeneous_losses():
    common = [
        "--steps",
        "6",
        "--model-config",
        "n_layer=6,d_model=64,seq_len=32",
        "--microbatch-size",
        "8",
        "--json",
    ]
    runs = {}
    for name, extra in (("homogeneous", []), ("heterogeneous", ["--heterogeneous"])):
        proc = run([sys.executable, "-m", "swarmtrain.cli", "demo", *extra, *common], timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(proc.stdout)
    layout = runs["heterogeneous"]["layout"]
    spans = [row["blocks"][1] - row["blocks"][0] + 1 for row in layout]
    assert sum(spans) == 6 and len(set(spans)) > 1, layout  # planned, unequal stages
    assert any(s > 1 for row in layout for s in row["peer_slowdowns"])  # a slow peer serves
    # Same seed and data order: the split and the peers' speeds do not change the maths.
    homogeneous, heterogeneous = runs["homogeneous"]["losses"], runs["heterogeneous"]["losses"]
    assert len(homogeneous) == len(heterogeneous) == 6
    for a, b in zip(homogeneous, heterogeneous):
        assert b == pytest.approx(a, rel=1e-3)
