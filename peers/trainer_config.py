"""A trainer's settings (`TrainerConfig`) and whether the run lets it train (`check_authorized`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmtrain.errors import ConfigError
from swarmtrain.peers.faults import CallFault
from swarmtrain.schedule import WindowConfig
from swarmtrain.swarm import NodeConfig
from swarmtrain.train.shards import WHOLE, Shard, default_shard
from swarmtrain.transport import TransportConfig
from swarmtrain.wire.records import RunManifest


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """A trainer: which swarm and run, and how patient to be."""

    node: NodeConfig = field(default_factory=NodeConfig)
    run_id: str | None = None
    """Run to train; None trains the only run the swarm announces."""
    microbatch_timeout_s: float = 60.0
    """Budget for one microbatch's whole trip: forward through every stage and back."""
    max_retries: int = 6
    """Replays of a microbatch from the trainer after retryable failures before the step fails
    (each failure bans that replica for 1, 2, 4, ... up to 30 s)."""
    wait_for_stages_s: float = 60.0
    """How long to wait for every stage to have a serving peer."""
    max_dropped_fraction: float = 0.0
    """Share of a step's microbatches that may be dropped (refused as bad by a stage: a
    non-finite loss, say) with the step going on, rescaled; past it the step fails."""
    verify_replicas: bool = False
    """Ask every replica for a hash of its parameters after each step (StepResult.replicas_equal)."""
    window: WindowConfig | None = None
    """The in-flight window; None: start at the run's max_in_flight, at most a step's microbatches."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    shard: Shard | str | None = None
    """This trainer's shard of the run's data: it feeds the shard's positions of every step and
    other trainers the rest (`swarmtrain.train.shards`); None: every position (a trainer alone);
    'auto' (`swarmtrain train`'s default): its place among the run's authorized trainers, as the
    manifest lists them."""
    min_trainers: int = 1
    """Wait until this many trainers of the run feed it (this one included) before the first
    step, so trainers started together count all their shards from the first step."""
    fault: str | None = None
    """Testing: 'kill:KIND:N' kills this trainer (kill -9 of its processes) as it sends its N-th
    request of a kind (`peers.faults.CallFault`)."""

    def __post_init__(self):
        if self.microbatch_timeout_s <= 1:
            raise ConfigError(
                f"the microbatch timeout must be over 1 s, got {self.microbatch_timeout_s}: raise --timeout"
            )
        if self.max_retries < 0 or self.wait_for_stages_s < 0:
            raise ConfigError(
                f"max_retries and wait_for_stages_s must be >= 0, got {self.max_retries} and {self.wait_for_stages_s}"
            )
        if not 0 <= self.max_dropped_fraction < 1:
            raise ConfigError(f"max_dropped_fraction must be in [0, 1), got {self.max_dropped_fraction}")
        if isinstance(self.shard, str) and self.shard != "auto":
            object.__setattr__(self, "shard", Shard.parse(self.shard))
        if self.min_trainers < 1:
            raise ConfigError(f"min_trainers must be >= 1, got {self.min_trainers}")
        if self.fault is not None:
            CallFault.parse(self.fault)


def check_authorized(manifest: RunManifest, peer_id: str) -> None:
    """Raise ConfigError unless the run's owner authorizes the trainer `peer_id` (stage peers
    would refuse its every microbatch)."""
    if manifest.trainers and peer_id not in manifest.trainers:
        raise ConfigError(
            f"this trainer ({peer_id}) is not one the owner of run {manifest.run_id!r} authorizes "
            f"({', '.join(manifest.trainers)}): start the run's coordinator with --trainer {peer_id}, "
            "or train with --identity set to an authorized trainer's key file"
        )


def shard_of(config: TrainerConfig, manifest: RunManifest, peer_id: str) -> Shard:
    """The shard `config` gives a trainer of the run `manifest` (ConfigError if it does not
    split the run's steps evenly)."""
    shard = default_shard(manifest.trainers, peer_id) if config.shard == "auto" else config.shard or WHOLE
    shard.check(manifest.batch.microbatches_per_step)
    return shard
