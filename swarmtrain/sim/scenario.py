"""What a simulation runs: peers, model, batch, policy, churn, links; from flags or TOML.

A TOML scenario holds the fields of `Scenario` at top level and the peer groups as
`[[peers]]` tables (`profile`, `count`, and optionally `region`, `slowdown`, `spot`,
`flops_per_s`, `bandwidth_bytes_per_s`), an availability trace as `[[trace]]` tables
(`t`, `action` 'leave' or 'join', `profile`, `count`):

    duration_s = 1800
    policy = "readiness"
    preemption_per_hour = 0.2
    [model]
    n_layer = 24
    d_model = 2048
    seq_len = 1024
    [[peers]]
    profile = "4090"
    count = 64
    region = "eu"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import tomllib

from swarmtrain.errors import ConfigError
from swarmtrain.sim.profiles import PROFILES, REGIONS, profile

POLICIES = ("readiness", "static", "stochastic")
CODEC_BYTES = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.016, "nf4": 0.53, "uint4": 0.53}
"""Wire bytes per element of each codec (with its block scales)."""


@dataclass(frozen=True, kw_only=True)
class PeerGroup:
    profile: str
    count: int
    region: str | None = None
    """None: the group's peers are spread over the scenario's regions in turn."""
    slowdown: float = 1.0
    """Compute takes this many times longer than the profile says (as `join --slowdown`)."""
    spot: bool = True
    """Preemptible: subject to the scenario's preemption rate."""
    flops_per_s: float | None = None
    bandwidth_bytes_per_s: float | None = None
    stage: int | None = None
    """Serve this stage from the start (as `join --stage`); when any group sets one, the
    planner is not asked and groups without one start as trainers-only peers that join later."""

    def __post_init__(self):
        profile(self.profile)
        if self.count < 0:
            raise ConfigError(f"peer group {self.profile}: count must be >= 0, got {self.count}")
        if not self.slowdown >= 1:
            raise ConfigError(f"peer group {self.profile}: slowdown must be >= 1, got {self.slowdown}")
        if self.region is not None and self.region not in REGIONS:
            raise ConfigError(f"peer group {self.profile}: region {self.region!r} is not one of {REGIONS}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GPT of `n_layer` blocks (`plan.cost_model.transformer_block_cost`); the default, about
    300M parameters, fits a stage on a 16 GB card."""

    n_layer: int = 24
    d_model: int = 1024
    seq_len: int = 1024


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    t: float
    action: str
    """'leave': `count` live peers of `profile` leave (the oldest first); 'join': `count` join."""
    profile: str
    count: int = 1

    def __post_init__(self):
        if self.action not in ("leave", "join"):
            raise ConfigError(
                f"trace event at {self.t} s: action must be 'leave' or 'join', got {self.action!r}"
            )
        profile(self.profile)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    peers: tuple[PeerGroup, ...] = (PeerGroup(profile="4090", count=8), PeerGroup(profile="t4", count=8))
    model: ModelSpec = field(default_factory=ModelSpec)
    stages: int | None = None
    """Pipeline stages; None: the planner chooses."""
    microbatch_size: int = 4
    microbatches_per_step: int = 32
    max_in_flight: int = 8
    """Microbatches a trainer keeps in flight at most, and whose activations a stage keeps."""
    trainers: int | None = None
    """Trainers feeding the swarm, each with its share of a step and its own in-flight window
    (a team, as `swarmtrain train` runs several); None: one per 8 peers."""
    codec: str = "int8"
    policy: str = "readiness"
    """readiness: the readiness router and queue; static: round-robin routes and fixed 1F1B
    order; stochastic: SWARM's wiring, a replica drawn with probability proportional to its
    throughput."""
    replan: bool = True
    """Live re-planning: peers move between stages when the planner's model gains (`Rebalancer`)."""
    rebalance_s: float = 30.0
    """Seconds between re-planning checks (each checks `rebalance_checks` random peers)."""
    rebalance_checks: int = 8
    move_s: float = 20.0
    """Seconds a move or a join takes before the peer serves (loading its stage's state)."""
    preemption_per_hour: float = 0.0
    """Hazard rate of each spot peer's preemption."""
    downtime_s: float = 600.0
    """Mean seconds before a preempted machine comes back, as a new peer (exponential)."""
    stall_per_hour: float = 0.0
    """Rate of stalls per peer: its compute runs `stall_factor` times slower for `stall_s`."""
    stall_s: float = 30.0
    stall_factor: float = 10.0
    jitter: float = 0.05
    """Lognormal sigma of each task's compute time."""
    detect_s: float = 1.0
    """Seconds before a caller notices that a peer it sent work to is gone."""
    service_s: tuple[float, ...] | None = None
    """Calibration: measured seconds of one microbatch's forward and backward (the last stage's
    fused loss task) per stage, on a peer of slowdown 1; replaces the FLOP model (a peer's
    `slowdown` still multiplies it) and fixes the stage count to its length."""
    forward_share: float = 1 / 3
    """Calibration: the forward's part of `service_s` (and of a block's FLOPs)."""
    hop_s: float = 0.0
    """Calibration: seconds every message costs beyond its bytes (serialisation, daemons)."""
    commit_s: float | None = None
    """Calibration: seconds a step's commit takes; None: the averaging model (`PlanConfig`)."""
    regions: tuple[str, ...] = ("us",)
    neighbors: int = 16
    """Replicas of the next stage each router chooses among at most: a random subset per peer,
    drawn again when the stage's replicas change (a partial view of the DHT, as SWARM's peers
    keep); 0: all of them (a choice costs time linear in the replicas)."""
    trace: tuple[TraceEvent, ...] = ()
    duration_s: float = 600.0
    seed: int = 0
    sample_s: float = 10.0
    """Seconds between samples of the time series (tokens/s, queues, utilisation)."""

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.codec not in CODEC_BYTES:
            raise ConfigError(f"codec must be one of {', '.join(CODEC_BYTES)}, got {self.codec!r}")
        for name in ("duration_s", "rebalance_s", "sample_s", "detect_s", "stall_s", "downtime_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("preemption_per_hour", "stall_per_hour", "jitter", "move_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("microbatch_size", "microbatches_per_step", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.service_s is not None and (not self.service_s or any(not x > 0 for x in self.service_s)):
            raise ConfigError(f"service_s must list a positive number per stage, got {self.service_s!r}")
        if (
            not 0 < self.forward_share < 1
            or self.hop_s < 0
            or (self.commit_s is not None and self.commit_s < 0)
        ):
            raise ConfigError("need 0 < forward_share < 1, hop_s >= 0 and commit_s >= 0 (or None)")
        if self.trainers is not None and self.trainers < 1:
            raise ConfigError(f"trainers must be >= 1, got {self.trainers}")
        if self.stages is not None and self.stages < 1:
            raise ConfigError(f"stages must be >= 1, got {self.stages}")
        if not self.regions or any(r not in REGIONS for r in self.regions):
            raise ConfigError(f"regions must be among {REGIONS}, got {self.regions}")
        if sum(g.count for g in self.peers) < 1:
            raise ConfigError("a scenario needs at least one peer")

    @property
    def num_peers(self) -> int:
        return sum(g.count for g in self.peers)


def _peer_group(table: dict) -> PeerGroup:
    known = {f.name for f in fields(PeerGroup)}
    if unknown := set(table) - known:
        raise ConfigError(f"[[peers]]: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return PeerGroup(**table)


def scenario_from_dict(data: dict) -> Scenario:
    """A Scenario from parsed TOML (see the module docstring); ConfigError names a bad key."""
    data = dict(data)
    known = {f.name for f in fields(Scenario)}
    if unknown := set(data) - known:
        raise ConfigError(f"scenario: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    if "peers" in data:
        data["peers"] = tuple(_peer_group(t) for t in data["peers"])
    if "model" in data:
        data["model"] = ModelSpec(**data["model"])
    if "trace" in data:
        data["trace"] = tuple(TraceEvent(**t) for t in data["trace"])
    for key in ("regions", "service_s"):
        if key in data:
            data[key] = tuple(data[key])
    try:
        return Scenario(**data)
    except TypeError as e:
        raise ConfigError(f"scenario: {e}") from None


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"scenario file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"scenario file {path} is not valid TOML: {e}") from None
    return scenario_from_dict(data)


def mix(spec: str) -> tuple[PeerGroup, ...]:
    """Peer groups from 'PROFILE:COUNT,...' (e.g. '4090:100,t4:300')."""
    groups = []
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        if name.lower() not in PROFILES or not count.isdigit():
            raise ConfigError(
                f"--mix {spec!r}: each part is PROFILE:COUNT with PROFILE one of {', '.join(PROFILES)}"
            )
        groups.append(PeerGroup(profile=name.lower(), count=int(count)))
    return tuple(groups)


DEFAULT_MIX = (("a100", 0.1), ("4090", 0.3), ("3090", 0.3), ("t4", 0.3))
"""What `swarmtrain simulate --peers N` is made of."""


def default_mix(n: int) -> tuple[PeerGroup, ...]:
    """`n` peers of DEFAULT_MIX (the remainder to its last profile)."""
    counts = [int(n * share) for _, share in DEFAULT_MIX]
    counts[-1] += n - sum(counts)
    return tuple(
        PeerGroup(profile=name, count=c) for (name, _), c in zip(DEFAULT_MIX, counts, strict=True) if c
    )
