"""What the simulator keeps of each peer, trainer and microbatch, and what a run returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmtrain.plan.cost_model import PeerCapacity
from swarmtrain.schedule import (
    InFlightWindow,
    ReadinessEstimator,
    ReadinessQueue,
    ReadinessRouter,
    StaticQueue,
)
from swarmtrain.sim.scenario import PeerGroup, Scenario

TRAINER_BANDWIDTH = 1.25e9


@dataclass(eq=False)
class SimPeer:
    id: str
    group: PeerGroup
    region: str
    capacity: PeerCapacity
    flops_per_s: float
    bandwidth: float
    stage: int | None = None
    alive: bool = True
    serving: bool = False
    draining_to: int | None = None
    epoch: int = 0
    estimator: ReadinessEstimator | None = None
    queue: ReadinessQueue | StaticQueue | None = None
    router: ReadinessRouter | None = None
    busy: bool = False
    held: dict = field(default_factory=dict)
    """Microbatch -> the epoch of it whose activations this peer holds until its backward."""
    fresh: set = field(default_factory=set)
    """Microbatches of this step whose gradient is in its buffer (first passes)."""
    kept: set = field(default_factory=set)
    """Replayed microbatches of this step whose gradient it keeps apart."""
    tasks: dict = field(default_factory=dict)
    seq: int = 0
    up_free: float = 0.0
    down_free: float = 0.0
    stall_until: float = -1.0
    busy_s: float = 0.0
    neighbors: dict = field(default_factory=dict)


@dataclass(eq=False)
class SimTrainer:
    id: str
    router: ReadinessRouter
    window: InFlightWindow
    region: str = "us"
    bandwidth: float = TRAINER_BANDWIDTH
    up_free: float = 0.0
    down_free: float = 0.0
    queue: list = field(default_factory=list)
    """Orders of this step's share not issued yet (replays first)."""
    in_flight: int = 0
    neighbors: dict = field(default_factory=dict)


@dataclass(eq=False)
class Microbatch:
    id: str
    step: int
    order: int
    trainer: SimTrainer
    epoch: int = 0
    path: list = field(default_factory=list)
    """The peers holding its forward state, by stage, down to where its work is now."""
    route: dict = field(default_factory=dict)
    """Stage -> the peer its (last) forward went through."""
    prefer: tuple = ()
    replay: bool = False
    """Sent again after a failure: a replica that computes its gradient keeps it apart (held)."""


@dataclass
class SimResult:
    """What a simulation measured (`to_json` gives the report)."""

    scenario: Scenario
    tokens_per_s: float
    steps: int
    events: int
    wall_s: float
    series: dict
    counters: dict
    layout: list
    stages: int
    plan_tokens_per_s: float
    step_ends: list

    def steady_tokens_per_s(self, warmup_steps: int = 2) -> float | None:
        """Tokens/s over the steps after `warmup_steps` (None with fewer than two of them)."""
        ends = self.step_ends[warmup_steps:]
        if len(ends) < 2:
            return None
        tokens = self.counters["tokens_per_step"]
        return tokens * (len(ends) - 1) / (ends[-1] - ends[0])

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        s = self.scenario
        return {
            "policy": s.policy,
            "replan": s.replan,
            "peers": s.num_peers,
            "stages": self.stages,
            "duration_s": s.duration_s,
            "seed": s.seed,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "planned_tokens_per_s": round(self.plan_tokens_per_s, 1),
            "of_plan": round(self.tokens_per_s / self.plan_tokens_per_s, 3)
            if self.plan_tokens_per_s
            else None,
            "steps": self.steps,
            "events": self.events,
            "events_per_s": round(self.events_per_s),
            "wall_s": round(self.wall_s, 2),
            **self.counters,
        }
