"""Timed swarmtrain runs for `pipeline.py`: a LocalSwarm in a given layout, trained from this process.

`run_swarm(cfg, schedule, layout)` starts the coordinator and every stage peer, trains
warm-up + timed steps with the trainer in this process, reads each peer's PeerRecord (busy_s,
served) and process CPU time before and after the timed steps, and returns plain figures.
With `kill=(stage, replica)` it SIGKILLs that peer in the middle of the timed steps and adds a
per-step timeline.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass

from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.wire.records import BatchConfig

BATCH = BatchConfig(microbatch_size=8, microbatches_per_step=8, max_in_flight=8)
"""ENVIRONMENT.md's reference: 8 microbatches of 8 sequences a step, all of them in flight."""
TEXT_BYTES = 2**22
"""Bytes of standard-library text every system draws its batches from."""
SNAPSHOT_WAIT_S = 5.0
"""How long to wait for every live peer's post-commit heartbeat before reading the records."""
_BASIC_FIELDS = {"step", "loss", "samples", "tokens", "seconds"}
"""StepResult fields that are not microbatch counters (all others are reported as counters)."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What every run of one benchmark invocation shares."""

    model_config: dict
    """tiny-gpt options (n_layer, n_head, d_model, seq_len, vocab_size)."""
    steps: int
    """Timed steps per run."""
    warmup_steps: int = 2
    """Untimed steps first: torch pipelining infers shapes, swarm peers open their streams."""
    stages: int = 2
    """Stages of the homogeneous and kill_replica layouts."""
    torch_schedule: str = "1f1b"
    """'1f1b' or 'gpipe'."""

    def __post_init__(self):
        if self.steps < 1 or self.warmup_steps < 1 or self.stages < 2:
            raise ValueError(
                f"need steps >= 1, warmup_steps >= 1 and stages >= 2, got {self.steps}, "
                f"{self.warmup_steps} and {self.stages}"
            )
        if self.stages > self.num_blocks:
            raise ValueError(f"{self.stages} stages need as many blocks, the model has {self.num_blocks}")

    @property
    def num_blocks(self) -> int:
        return self.model_config["n_layer"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Stages and the peers serving them."""

    stage_bounds: tuple[int, ...]
    """Stage k holds blocks [stage_bounds[k], stage_bounds[k+1])."""
    slowdowns: tuple[tuple[float, ...], ...]
    """One --slowdown per peer of each stage; the first of each stage starts with the swarm."""


@dataclass(frozen=True)
class Peer:
    """A stage peer process of a LocalSwarm."""

    name: str
    stage: int
    slowdown: float
    peer_id: str
    pid: int


def batches(cfg: BenchConfig) -> TokenBatches:
    """The microbatches every system trains on, in the same order."""
    return TokenBatches(
        stdlib_text(TEXT_BYTES),
        seq_len=cfg.model_config["seq_len"],
        microbatch_size=BATCH.microbatch_size,
        seed=0,
    )


def _peer_args(slowdown: float) -> tuple[str, ...]:
    return ("--slowdown", str(slowdown), "--rebalance-every", "0")  # no rebalancing: layouts stay put


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads) from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": fields[0] is the state
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def snapshot(trainer, swarm: LocalSwarm, peers: list[Peer]) -> dict[str, dict]:
    """{peer name: {busy_s, served, cpu_s}} as of the trainer's last commit; None for a dead peer.

    Waits up to SNAPSHOT_WAIT_S for each live peer's record to show the trainer's step: a
    peer announces itself right after it commits, so that record counts all the step's compute.
    """
    alive = [p for p in peers if swarm.procs[p.name].poll() is None]
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while True:
        records = {r.peer_id: r for r in trainer.node.peers(trainer.manifest.run_id)}
        current = all(p.peer_id in records and records[p.peer_id].step >= trainer.step for p in alive)
        if current or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out = {}
    for p in peers:
        record = records.get(p.peer_id) if p in alive else None
        out[p.name] = {
            "busy_s": record.busy_s if record else None,
            "served": record.served if record else None,
            "cpu_s": cpu_seconds(p.pid) if p in alive else None,
        }
    return out


def _delta(before: dict, after: dict, key: str) -> float | None:
    return None if after[key] is None or before[key] is None else after[key] - before[key]


def utilization(before: dict, after: dict, peers: list[Peer], wall_s: float) -> dict:
    """Per peer: utilization = d(busy_s)/d(wall) from its PeerRecord, cpu_utilization =
    d(process CPU seconds)/d(wall); bubble fractions = 1 - their mean over the peers alive at
    the end (None unless every one of them has a value).

    If no peer's busy_s grew while peers served microbatches, the swarm does not report
    busy_s (it is 0 until the stage runtime fills it in): every utilization is None.
    """
    deltas = {p.name: {k: _delta(before[p.name], after[p.name], k) for k in after[p.name]} for p in peers}
    reports_busy = any(d["busy_s"] for d in deltas.values()) or not any(d["served"] for d in deltas.values())
    rows = [
        {
            "peer": p.name,
            "stage": p.stage,
            "slowdown": p.slowdown,
            "alive_at_end": after[p.name]["served"] is not None,
            "served": deltas[p.name]["served"],
            "utilization": None if not reports_busy or d["busy_s"] is None else d["busy_s"] / wall_s,
            "cpu_utilization": None if d["cpu_s"] is None else d["cpu_s"] / wall_s,
        }
        for p, d in ((p, deltas[p.name]) for p in peers)
    ]
    return {
        "peers": rows,
        "bubble_fraction": _bubble(rows, "utilization"),
        "cpu_bubble_fraction": _bubble(rows, "cpu_utilization"),
    }


def _bubble(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if row["alive_at_end"]]
    return None if not values or None in values else 1 - statistics.mean(values)


def counters(result) -> dict:
    """The microbatch counters of a StepResult: `replays` and `dropped` today, plus whatever
    the trainer adds (completed, replayed, dropped causes...), read without naming them."""
    return {
        f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name not in _BASIC_FIELDS
    }


def _swarm_config(
    cfg: BenchConfig, schedule: str, layout: Layout, swarm_key: str | None, trust: bool
) -> LocalSwarmConfig:
    return LocalSwarmConfig(
        swarm_key=swarm_key,
        num_trainers=2 if trust else 0,
        run_id=f"bench-{schedule}",
        model_config=cfg.model_config,
        stage_bounds=layout.stage_bounds,
        stage_args={k: _peer_args(s[0]) for k, s in enumerate(layout.slowdowns)},
        batch=BATCH,
        schedule=schedule,
        threads_per_peer=1,
    )


def _spawn_peers(swarm: LocalSwarm, layout: Layout) -> list[list[Peer]]:
    """Start the replicas `layout` adds to a started swarm; returns every peer of each stage, serving."""
    names = [[f"stage{k}-{k + 1}"] for k in range(len(layout.slowdowns))]  # the launcher's own names
    for k, slowdowns in enumerate(layout.slowdowns):
        names[k] += [swarm.spawn_stage(k, extra_args=_peer_args(s)) for s in slowdowns[1:]]
    return [
        [
            Peer(name, k, layout.slowdowns[k][i], swarm.wait_ready(name), swarm.procs[name].pid)
            for i, name in enumerate(stage)
        ]
        for k, stage in enumerate(names)
    ]


def _kill_later(swarm: LocalSwarm, name: str, delay_s: float, killed: dict[str, float]) -> threading.Timer:
    """SIGKILL peer `name` (its whole process group) in `delay_s`; record when in `killed`."""

    def kill() -> None:
        killed[name] = time.monotonic()
        swarm.signal(name, signal.SIGKILL)

    timer = threading.Timer(delay_s, kill)
    timer.start()
    return timer


def run_swarm(
    cfg: BenchConfig,
    schedule: str,
    layout: Layout,
    *,
    kill: tuple[int, int] | None = None,
    swarm_key: str | None = None,
    trust: bool = True,
) -> dict:
    """Train warm-up + timed steps on a swarm in `layout`; figures of the timed steps.

    With `kill` = (stage, replica index), that peer is SIGKILLed during timed step
    cfg.steps // 2, half the median step time so far after it starts, and the figures add a
    per-step `timeline` with times relative to the kill. `swarm_key`: a private swarm's key
    file; `trust` False authorizes any trainer (the baseline of the trust scenario).
    Raises StepFailedError if a step fails.
    """
    started = time.monotonic()
    killed: dict[str, float] = {}
    timer = None
    with LocalSwarm(_swarm_config(cfg, schedule, layout, swarm_key, trust)) as swarm:
        by_stage = _spawn_peers(swarm, layout)
        peers = [p for stage in by_stage for p in stage]
        victim = None if kill is None else by_stage[kill[0]][kill[1]].name
        startup_s = time.monotonic() - started
        with swarm.trainer() as trainer:
            steps = trainer.train(batches(cfg), steps=cfg.warmup_steps + cfg.steps)
            warm = [next(steps) for _ in range(cfg.warmup_steps)]
            before = snapshot(trainer, swarm, peers)
            timed = []  # (StepResult, monotonic time it ended)
            try:
                for i in range(cfg.steps):
                    if victim is not None and i == cfg.steps // 2:
                        so_far = [r.seconds for r, _ in timed] or [warm[-1].seconds]
                        timer = _kill_later(swarm, victim, statistics.median(so_far) / 2, killed)
                    result = next(steps)
                    timed.append((result, time.monotonic()))
            finally:
                if timer is not None:
                    timer.cancel()
            after = snapshot(trainer, swarm, peers)
    results = [r for r, _ in timed]
    rates = [r.tokens_per_s for r in results]
    wall_s = sum(r.seconds for r in results)
    figures = {
        "schedule": schedule,
        "stage_bounds": list(layout.stage_bounds),
        "peer_slowdowns_per_stage": [list(s) for s in layout.slowdowns],
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "steps": len(results),
        "wall_s": wall_s,
        "startup_s": startup_s,
        "losses": [r.loss for r in results],
        "replays": sum(r.replays for r in results),
        "dropped": sum(r.dropped for r in results),
        **utilization(before, after, peers, wall_s),
    }
    if victim is not None:
        figures["killed"] = victim
        figures["kill_happened"] = victim in killed  # False: the run ended before the timer fired
        figures["timeline"] = _timeline(timed, killed.get(victim))
    return figures


def _timeline(timed: list, kill_t: float | None) -> list[dict]:
    """One row per timed step: its start and end relative to the kill, its speed and counters."""
    origin = kill_t if kill_t is not None else timed[0][1] - timed[0][0].seconds
    return [
        {
            "step": r.step,
            "start_s": round(end - r.seconds - origin, 3),
            "end_s": round(end - origin, 3),
            "tokens_per_s": r.tokens_per_s,
            "loss": r.loss,
            **counters(r),
        }
        for r, end in timed
    ]
