"""What one stage peer is told: its swarm, run and stage, device, and the knobs of its
heartbeats, draining and moves (`swarmtrain join`'s flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmtrain.errors import ConfigError
from swarmtrain.model import ModelSources
from swarmtrain.peers.faults import FaultInjector
from swarmtrain.rl.registry import TaskSources
from swarmtrain.swarm import NodeConfig
from swarmtrain.train.versions import VersionsConfig
from swarmtrain.transport import TransportConfig


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """A stage peer: which swarm, run and stage, and on what device."""

    node: NodeConfig = field(default_factory=NodeConfig)
    run_id: str | None = None
    """Run to join; None joins the only run the swarm announces."""
    stage: int | None = None
    """Stage to serve; None: a stage with no replica first, else the planner's join rule
    (`swarmtrain.train.placement.choose_stage`)."""
    device: str = "cpu"
    """torch device for compute, e.g. 'cpu' or 'cuda:0'."""
    dtype: str = "fp32"
    """What forward and backward compute in: 'fp32', or 'bf16' / 'fp16' under autocast (parameters,
    gradients and optimizer state stay float32; fp16 is loss-scaled by the stage;
    `probe.resolve_dtype` picks it for --dtype)."""
    num_threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    heartbeat_s: float = 2.0
    """Seconds between announcements in the DHT."""
    ttl_s: float = 6.0
    """Lifetime of an announcement: a peer silent for this long drops out of routing."""
    slowdown: float = 1.0
    """Make compute take this many times longer (emulates a slower device on one machine)."""
    slowdown_file: str | None = None
    """A file holding a number: while it exists, compute takes that many times longer instead
    of `slowdown` (emulates a device that throttles for a while)."""
    max_memory_bytes: int | None = None
    """Memory this peer may use; a stage that needs more is refused."""
    is_spot: bool = False
    """The machine may be preempted at any time (announced; planners prefer others for scarce stages)."""
    rebalance_s: float = 10.0
    """Seconds between checks whether moving to another stage would raise swarm throughput; 0: never move."""
    rebalance_patience: int = 3
    """Consecutive checks a move must stay worthwhile (by more than 10%) before the peer moves."""
    probe_s: float = 0.3
    """Seconds of matmul timing in the start-up capacity probe."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, how long to wait for in-flight microbatches (and their step's commit) before leaving."""
    checkpoint_dir: str | None = None
    """Where this peer writes its stage's checkpoints (None: `<data dir>/checkpoints`)."""
    checkpoint_keep: int = 2
    """Checkpoints of its stage this peer keeps (the newest); at least 1."""
    fault: str | None = None
    """Test hook, 'ACTION:KIND:N': SIGKILL ('kill') or SIGTERM ('term') this peer as its N-th
    'forward' / 'backward' / 'loss' task starts (see peers/faults.py)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    versions: VersionsConfig = field(default_factory=VersionsConfig)
    """Policy versions of its parameters the peer keeps for rollout peers (`--keep-versions`)."""
    models: ModelSources = field(default_factory=ModelSources)
    """Import paths of builders this peer lets a run's manifest name (--allow-model); registered
    names and installed entry points need none."""
    auto_role: bool = False
    """Started with `--role auto`: in an RL run, at every rebalancing check it asks the run's
    planner whether it should sample instead (`swarmtrain.rl.roles.RoleChecker`) and leaves,
    draining, to do so (`StagePeer.switch_role`)."""
    announce: dict = field(default_factory=dict)
    """Capacity keys announced besides the probe's: a `--role auto` peer's decode rate and
    `role_auto`."""
    tasks: TaskSources = field(default_factory=TaskSources)
    """Import paths of RL tasks this peer lets a run's manifest name (the role checks build it)."""

    def __post_init__(self):
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ConfigError(f"need 0 < heartbeat_s < ttl_s, got {self.heartbeat_s} and {self.ttl_s}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"a stage peer computes in fp32, bf16 or fp16, not {self.dtype!r} (--dtype)")
        if self.slowdown < 1:
            raise ConfigError(f"--slowdown must be >= 1, got {self.slowdown}")
        if self.stage is not None and self.stage < 0:
            raise ConfigError(f"--stage must be >= 0, got {self.stage}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"--checkpoint-keep must be >= 1, got {self.checkpoint_keep}")
        if self.fault is not None:
            FaultInjector.parse(self.fault)
