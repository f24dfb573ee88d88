"""The swarm simulator (swarmtrain.sim): its event engine, determinism, that it drives the real
policies and copies none, and what it shows of them (churn handled, readiness against static
routing around a slow replica); `swarmtrain simulate` as a user runs it."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarmtrain.errors import ConfigError
from swarmtrain.schedule import ReadinessQueue, ReadinessRouter
from swarmtrain.sim import Scenario, simulate
from swarmtrain.sim.engine import Engine
from swarmtrain.sim.scenario import ModelSpec, PeerGroup, TraceEvent, load_scenario, mix

REPO = Path(__file__).resolve().parent.parent
SIM = REPO / "swarmtrain" / "sim"

SMALL = Scenario(
    peers=(PeerGroup(profile="4090", count=6), PeerGroup(profile="3090", count=6)),
    model=ModelSpec(n_layer=24, d_model=1024, seq_len=1024),
    microbatches_per_step=128,  # enough tokens a step that the planner uses every peer (2 x 6)
    duration_s=300,
)


def without_wall(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("wall_s", "events_per_s")}


# the engine


def test_the_engine_runs_events_in_time_order_and_ties_in_scheduling_order():
    engine, seen = Engine(), []
    engine.at(2.0, seen.append, "c")
    engine.at(1.0, seen.append, "a")
    engine.at(1.0, seen.append, "b")
    engine.at(5.0, seen.append, "late")
    engine.run(3.0)
    assert seen == ["a", "b", "c"] and engine.now == 3.0 and engine.events == 3
    engine.after(0.5, seen.append, "d")  # relative to now
    engine.run(10.0)
    assert seen[-2:] == ["d", "late"] and engine.pending == 0
    with pytest.raises(ValueError, match="before now"):
        engine.at(1.0, seen.append, "past")


# determinism


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    scenario = dataclasses.replace(SMALL, preemption_per_hour=2.0, downtime_s=60, jitter=0.1)
    a, b = simulate(scenario), simulate(scenario)
    assert without_wall(a.to_json()) == without_wall(b.to_json())
    assert a.series == b.series and a.layout == b.layout and a.step_ends == b.step_ends
    c = simulate(dataclasses.replace(scenario, seed=1))
    assert (c.step_ends, c.layout) != (a.step_ends, a.layout)


# the no-copy rule


POLICY_NAMES = {"choose", "pop", "push", "on_step", "observe", "report", "expected_s", "fail",
                "join_stage", "serving_stage", "best_move", "plan_swarm", "decide_commit",
                "plan_stage_commit", "assign", "expected_orders", "in_flight_budget", "round_robin"}  # fmt: skip
"""Decisions the real peers take through swarmtrain.schedule and swarmtrain.plan."""


def test_the_simulator_defines_no_policy_of_its_own():
    """No function or method of swarmtrain/sim is named like a policy decision, and no class
    of it subclasses one: the simulator may only call them."""
    for path in SIM.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.name not in POLICY_NAMES, f"{path.name} defines {node.name}(): a copy of a policy"
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"ReadinessRouter", "ReadinessQueue", "StaticQueue", "InFlightWindow",
                                    "Rebalancer", "ReadinessEstimator"}, f"{path.name}: {node.name} subclasses a policy"  # fmt: skip


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("swarmtrain."):
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_simulator_and_the_real_peers_import_the_same_policies():
    sim = set().union(*(imported_names(p) for p in SIM.glob("*.py")))
    real = set().union(*(imported_names(p) for p in (REPO / "peers").glob("*.py")))
    real |= set().union(*(imported_names(p) for p in (REPO / "swarmtrain" / "train").glob("*.py")))
    real |= imported_names(REPO / "swarmtrain" / "schedule" / "runtime.py")  # a stage peer's compute thread
    short = {n.rsplit(".", 1)[1]: n for n in real}
    for name in ("ReadinessRouter", "RoundRobinRouter", "ReadinessQueue", "StaticQueue", "InFlightWindow",
                 "ReadinessEstimator", "serving_stage", "Rebalancer", "best_move", "plan_swarm"):  # fmt: skip
        assert any(n.endswith(f".{name}") for n in sim), f"the simulator does not use {name}"
        assert name in short, f"no real peer imports {name}: the simulator would study a policy nobody runs"


def test_a_run_goes_through_the_real_router_and_queue(monkeypatch):
    calls = {"choose": 0, "pop": 0}
    choose, pop = ReadinessRouter.choose, ReadinessQueue.pop

    def counted_choose(self, *a, **kw):
        calls["choose"] += 1
        return choose(self, *a, **kw)

    def counted_pop(self, *a, **kw):
        calls["pop"] += 1
        return pop(self, *a, **kw)

    monkeypatch.setattr(ReadinessRouter, "choose", counted_choose)
    monkeypatch.setattr(ReadinessQueue, "pop", counted_pop)
    result = simulate(dataclasses.replace(SMALL, duration_s=60))
    assert result.steps > 0
    assert calls["choose"] > 0 and calls["pop"] > 0


# what it shows


def uneven(policy: str) -> Scenario:
    """Two stages on fast links, stage 0 held by a fast replica and one 6 times slower."""
    fast = 1.25e9
    return Scenario(
        peers=(
            PeerGroup(profile="4090", count=1, stage=0, spot=False, bandwidth_bytes_per_s=fast),
            PeerGroup(profile="4090", count=1, stage=0, slowdown=6.0, spot=False, bandwidth_bytes_per_s=fast),
            PeerGroup(profile="4090", count=1, stage=1, spot=False, bandwidth_bytes_per_s=fast),
        ),
        model=ModelSpec(n_layer=8, d_model=1024, seq_len=1024),
        stages=2,
        trainers=1,
        policy=policy,
        replan=False,
        duration_s=300,
    )


def test_readiness_routing_beats_static_round_robin_around_a_slow_replica():
    readiness = simulate(uneven("readiness")).steady_tokens_per_s()
    static = simulate(uneven("static")).steady_tokens_per_s()
    stochastic = simulate(uneven("stochastic")).steady_tokens_per_s()
    # static sends every other microbatch to the slow replica and waits for it each step
    assert readiness > 1.3 * static, (readiness, static)
    assert readiness >= stochastic * 0.95, (readiness, stochastic)


def test_preempted_peers_work_is_retried_and_steps_go_on():
    result = simulate(dataclasses.replace(SMALL, preemption_per_hour=6.0, downtime_s=30, duration_s=600))
    c = result.counters
    assert c["preempted"] > 0 and c.get("joined", 0) > 0
    assert c.get("hop_retries", 0) + c.get("replayed_for_commit", 0) > 0
    late = [t for t in result.step_ends if t > 300]
    assert len(late) > 3  # training went on through the churn
    assert c.get("commit_conflicts", 0) == 0  # every microbatch counted once in every stage


def test_a_stage_left_without_replicas_stalls_until_a_peer_joins_it():
    trace = (TraceEvent(t=60.0, action="leave", profile="3090", count=1),
             TraceEvent(t=150.0, action="join", profile="3090", count=1))  # fmt: skip
    scenario = Scenario(
        peers=(
            PeerGroup(profile="4090", count=1, stage=0, spot=False),
            PeerGroup(profile="3090", count=1, stage=1, spot=False),
        ),  # fmt: skip
        model=ModelSpec(n_layer=8, d_model=1024, seq_len=1024),
        stages=2,
        trainers=1,
        replan=False,
        move_s=10.0,
        trace=trace,
        duration_s=300,
    )
    result = simulate(scenario)
    stalled = [t for t in result.step_ends if 61 < t < 160]
    assert not stalled, stalled  # no step completes while stage 1 has no replica
    assert any(t > 160 for t in result.step_ends)  # the joiner took stage 1 (the join rule's first pick)
    assert [e["event"] for e in result.layout if e["event"] in ("left", "join")] == ["left", "join"]
    assert next(e for e in result.layout if e["event"] == "join")["stage"] == 1


def test_live_replanning_moves_peers_to_the_bottleneck():
    """Stage 1 starts with one slow replica and stage 0 with four fast ones: re-planning
    moves fast peers to stage 1 and the swarm goes faster than without it."""
    fast = 1.25e9  # compute-bound, so that the slow stage is the bottleneck the planner sees
    base = Scenario(
        peers=(
            PeerGroup(profile="4090", count=4, stage=0, spot=False, bandwidth_bytes_per_s=fast),
            PeerGroup(profile="3090", count=1, stage=1, spot=False, bandwidth_bytes_per_s=fast),
        ),
        model=ModelSpec(n_layer=8, d_model=1024, seq_len=1024),
        stages=2,
        trainers=1,
        rebalance_s=10,
        move_s=5,
        duration_s=600,
    )
    on, off = simulate(base), simulate(dataclasses.replace(base, replan=False))
    assert on.counters.get("moves", 0) >= 1 and off.counters.get("moves", 0) == 0
    assert on.series["replicas"][-1][1] > 1
    assert on.tokens_per_s > 1.2 * off.tokens_per_s, (on.tokens_per_s, off.tokens_per_s)


# scenarios and the command line


def test_a_scenario_file_is_read_and_a_bad_one_named(tmp_path):
    good = tmp_path / "s.toml"
    good.write_text(
        'duration_s = 120\npolicy = "static"\nregions = ["us", "eu"]\n'
        "[model]\nn_layer = 8\n"
        '[[peers]]\nprofile = "t4"\ncount = 3\n[[peers]]\nprofile = "a100"\ncount = 1\nregion = "eu"\n'
        '[[trace]]\nt = 30\naction = "leave"\nprofile = "t4"\n'
    )
    s = load_scenario(good)
    assert s.policy == "static" and s.model.n_layer == 8 and s.num_peers == 4
    assert s.peers[1].region == "eu" and s.trace[0].action == "leave" and s.regions == ("us", "eu")
    bad = tmp_path / "bad.toml"
    bad.write_text("durations = 3\n")
    with pytest.raises(ConfigError, match=r"unknown keys \['durations'\]"):
        load_scenario(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_scenario(tmp_path / "none.toml")
    with pytest.raises(ConfigError, match="PROFILE:COUNT"):
        mix("4090:2,gtx1060:3")
    with pytest.raises(ConfigError, match="policy must be one of"):
        Scenario(policy="random")
    example = load_scenario(REPO / "examples" / "sim" / "spot-swarm.toml")  # the README's example
    assert example.num_peers == 88 and example.trace[0].count == 20


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmtrain.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_swarmtrain_simulate_prints_json_and_writes_plots(tmp_path):
    proc = cli("--peers", "40", "--duration-s", "120", "--policy", "readiness,static", "--json",
               "--plots", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["policy"] for r in rows] == ["readiness", "static"]
    assert all(r["peers"] == 40 and r["tokens_per_s"] > 0 and r["events_per_s"] > 0 for r in rows)
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert "tokens_per_s.png" in pngs and any(n.startswith("layout-") for n in pngs)
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in pngs)


def test_swarmtrain_simulate_refuses_bad_flags_in_one_line():
    proc = cli("--policy", "random")
    assert proc.returncode == 2 and "--policy 'random': use readiness, static, stochastic" in proc.stderr
    proc = cli("--peers", "10", "--mix", "4090:3")
    assert proc.returncode == 2 and "give --peers or --mix, not both" in proc.stderr
    proc = cli("--scenario", "/nonexistent.toml")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
