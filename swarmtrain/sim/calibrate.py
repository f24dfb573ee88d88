"""Calibration: the same small swarm for real on loopback and in the simulator.

`run_real` starts a coordinator and stage peers (`LocalSwarm`), some of them slowed down
(`join --slowdown`), trains a few steps and returns what it measured: tokens/s over the
steps after the warm-up, each peer's compute seconds per microbatch (as Echo and Proteus
profile operators on the real hardware) and share of the microbatches. From a run of even
peers `calibrate` fits the two constants the simulator cannot know (what a message costs
beyond its bytes, and what a step's commit costs beyond its microbatches); `scenario_of`
builds the simulated twin of any layout with them. A test (tests/test_sim_calibration.py)
keeps the simulated tokens/s of other layouts (a replica 3 times slower, under readiness
and static routing) within 10% of the real ones.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

from swarmtrain.sim.scenario import ModelSpec, PeerGroup, Scenario
from swarmtrain.sim.swarm import simulate

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 64}
MICROBATCH_SIZE = 4
MICROBATCHES = 8
LOOPBACK_BYTES_PER_S = 1e9
"""Loopback is no limit for these frames; what a message costs beyond its bytes is in hop_s."""


@dataclass(frozen=True)
class RealRun:
    layout: tuple[tuple[int, float], ...]
    """(stage, slowdown) of each stage peer."""
    schedule: str
    tokens_per_s: float
    """Over the steps after the warm-up, by the wall clock (what happens between steps counts)."""
    step_s: float
    """Median wall-clock seconds from one of those steps' end to the next's."""
    service_s: dict = field(default_factory=dict)
    """Per stage: its fastest replica's compute seconds per microbatch (forward + backward, or
    the fused loss task), as measured: its busy seconds over its microbatches."""
    peer_service_s: tuple[float, ...] = ()
    """Each stage peer's compute seconds per microbatch, in `layout` order."""
    shares: dict = field(default_factory=dict)
    """Per stage peer (by slowdown and order, 'S0@3.0#0'): its share of the microbatches."""


def run_real(
    layout: list[tuple[int, float]], *, steps: int = 8, warmup: int = 2, schedule: str = "readiness"
) -> RealRun:
    """Train `steps` steps on a real loopback swarm of `layout` ((stage, slowdown) per peer)."""
    from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
    from swarmtrain.train.data import TokenBatches, stdlib_text
    from swarmtrain.wire.records import BatchConfig

    stages = sorted({k for k, _ in layout})
    first = {k: next(s for kk, s in layout if kk == k) for k in stages}
    config = LocalSwarmConfig(
        run_id="calibrate",
        model_config=MODEL,
        num_stages=len(stages),
        stage_args={k: ("--slowdown", str(s), "--rebalance-every", "0") for k, s in first.items()},
        batch=BatchConfig(
            microbatch_size=MICROBATCH_SIZE, microbatches_per_step=MICROBATCHES, max_in_flight=MICROBATCHES
        ),
        schedule=schedule,
        num_trainers=0,
    )
    extra = list(layout)
    for k, s in first.items():
        extra.remove((k, s))
    with LocalSwarm(config) as swarm:
        names = {swarm.wait_ready(f"stage{k}-{i + 1}"): (k, first[k]) for i, k in enumerate(stages)}
        for k, s in extra:
            name = swarm.spawn_stage(k, extra_args=("--slowdown", str(s), "--rebalance-every", "0"))
            names[swarm.wait_ready(name)] = (k, s)
        with swarm.trainer() as trainer:
            batches = TokenBatches(
                stdlib_text(2**20), seq_len=MODEL["seq_len"], microbatch_size=MICROBATCH_SIZE, seed=0
            )
            data = iter(batches)
            list(trainer.train(data, steps=warmup))  # cold steps: neither timed nor profiled
            before = _final_busy(trainer, set(names))
            measured, ends = [], []
            for result in trainer.train(data, steps=steps - warmup):  # wall clock: gaps count
                measured.append(result)
                ends.append(time.monotonic())
            after = _final_busy(trainer, set(names))
            busy = {p: after[p] - before.get(p, 0.0) for p in after}
    work = {}
    for r in measured:
        for per_peer in r.work.values():
            for peer_id, count in per_peer.items():
                work[peer_id] = work.get(peer_id, 0) + count
    per_peer = []
    for peer_id in names:
        per_peer.append(busy[peer_id] / work[peer_id] if work.get(peer_id) else 0.0)
    service = {}
    for (k, _), seconds in zip(names.values(), per_peer, strict=True):
        if seconds > 0:
            service[k] = min(service.get(k, seconds), seconds)
    shares, seen = {}, {}
    for peer_id, (k, slowdown) in names.items():
        total = sum(c for p, c in work.items() if names.get(p, (None,))[0] == k)
        n = seen[(k, slowdown)] = seen.get((k, slowdown), -1) + 1
        shares[f"S{k}@{slowdown}#{n}"] = round(work.get(peer_id, 0) / total, 3) if total else 0.0
    return RealRun(
        layout=tuple(names.values()),
        schedule=schedule,
        tokens_per_s=sum(r.tokens for r in measured[1:]) / (ends[-1] - ends[0]),
        step_s=statistics.median(b - a for a, b in zip(ends, ends[1:])),
        service_s=dict(sorted(service.items())),
        peer_service_s=tuple(per_peer),
        shares=shares,
    )


def _final_busy(trainer, peers: set[str], timeout_s: float = 20.0) -> dict[str, float]:
    """Each stage peer's compute seconds once training is over: its record's busy_s, read until
    two reads a heartbeat apart agree (a record is announced every 2 s)."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        records = {p.peer_id: p.busy_s for p in trainer.node.peers("calibrate") if p.peer_id in peers}
        if records == previous and len(records) == len(peers):
            return records
        if time.monotonic() > deadline:
            raise RuntimeError(f"stage peers' records did not settle within {timeout_s} s: {records}")
        previous = records
        time.sleep(2.5)  # one heartbeat: the next read shows any compute the last one missed


@dataclass(frozen=True)
class Calibration:
    """The constants a simulated loopback twin needs beyond each peer's measured compute."""

    hop_s: float
    """Seconds a message costs beyond its bytes."""
    commit_s: float
    """Seconds a step's commit costs beyond its microbatches."""


JITTER = 0.05
"""Spread of a real peer's task times (lognormal sigma): without any, a simulated swarm can lock
into one unlucky order (the slow replica always holding a step's last microbatch)."""
SEEDS = (0, 1, 2)
HOP_GRID_S = (0.0, 0.0005, 0.001, 0.002, 0.004, 0.008)


def scenario_of(run: RealRun, calibration: Calibration, *, steps: int = 40) -> Scenario:
    """The simulated twin of `run`'s layout: its peers (each as slow as it measured), batch
    and schedule, with the calibrated constants."""
    service = run.service_s
    groups = tuple(  # each peer as slow as it measured, against its stage's fastest
        PeerGroup(profile="cpu", count=1, stage=k, slowdown=max(1.0, seconds / service[k]), spot=False,
                  bandwidth_bytes_per_s=LOOPBACK_BYTES_PER_S)
        for (k, _), seconds in zip(run.layout, run.peer_service_s, strict=True)
    )  # fmt: skip
    stages = max(k for k, _ in run.layout) + 1
    return Scenario(
        peers=groups,
        model=ModelSpec(n_layer=MODEL["n_layer"], d_model=MODEL["d_model"], seq_len=MODEL["seq_len"]),
        microbatch_size=MICROBATCH_SIZE,
        microbatches_per_step=MICROBATCHES,
        max_in_flight=MICROBATCHES,
        trainers=1,
        codec="none",
        policy="static" if run.schedule == "static" else "readiness",
        replan=False,
        service_s=tuple(service[k] for k in range(stages)),
        hop_s=calibration.hop_s,
        commit_s=calibration.commit_s,
        jitter=JITTER,
        duration_s=run.step_s * steps,
    )


def simulated_tokens_per_s(scenario: Scenario, warmup: int = 2) -> float:
    """Steady tokens/s of `scenario`, the mean over SEEDS (its compute jitter drawn anew)."""
    rates = []
    for seed in SEEDS:
        result = simulate(replace(scenario, seed=seed))
        rate = result.steady_tokens_per_s(warmup)
        if rate is None:
            raise RuntimeError(f"the simulation ran {result.steps} steps, too few to measure")
        rates.append(rate)
    return statistics.fmean(rates)


def calibrate(run: RealRun) -> Calibration:
    """Fit the constants to `run` (a layout of even peers): the per-message cost from
    HOP_GRID_S that brings the simulated step closest to the real one, then the commit cost
    that makes up what is left (not below 0)."""
    tokens_per_step = MICROBATCH_SIZE * MODEL["seq_len"] * MICROBATCHES
    best = min(
        HOP_GRID_S,
        key=lambda hop: abs(
            simulated_tokens_per_s(scenario_of(run, Calibration(hop, 0.0))) - run.tokens_per_s
        ),
    )
    rate = simulated_tokens_per_s(scenario_of(run, Calibration(best, 0.0)))
    return Calibration(
        hop_s=best, commit_s=max(0.0, tokens_per_step / run.tokens_per_s - tokens_per_step / rate)
    )


def compare(run: RealRun, calibration: Calibration) -> dict:
    """Real against simulated tokens/s of `run`'s layout (the simulator given each peer's
    measured compute and the calibrated constants)."""
    sim = simulated_tokens_per_s(scenario_of(run, calibration))
    return {
        "layout": [list(x) for x in run.layout],
        "schedule": run.schedule,
        "real_tokens_per_s": round(run.tokens_per_s, 1),
        "sim_tokens_per_s": round(sim, 1),
        "error": round(sim / run.tokens_per_s - 1, 4),
        "peer_service_s": [round(x, 5) for x in run.peer_service_s],
        "hop_s": calibration.hop_s,
        "commit_s": round(calibration.commit_s, 4),
        "real_shares": run.shares,
    }


__all__ = ["Calibration", "RealRun", "calibrate", "compare", "run_real", "scenario_of"]
