"""Typed records that travel through the DHT: the run manifest and peer announcements.

Each record is a frozen dataclass with `to_dict()` (msgpack-friendly primitives) and
`from_dict()`, which validates what came off the network and raises `ConfigError` with the
offending field. Records are validated here, at the boundary, and trusted after that.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.wire.layout_record import MAX_LAYOUT_NOTE, ReplanConfig, check_assignments
from swarmtrain.wire.rl_config import QUANTIZE_MODES, RLConfig
from swarmtrain.wire.run_config import (  # noqa: F401  (re-exported: the records' settings)
    CODEC_CHOICES,
    BatchConfig,
    CompressionConfig,
    OptimizerConfig,
    _from_dict,
)

WIRE_VERSION = 14
"""14: live re-planning by the trainers (the manifest's replan rule, layout records), the
replica exchange's measured seconds in stage peer records.
12: trainer points carry an RL step's figures (`metrics.RLPoint`), rollout peer records their
quantization (`PeerRecord.quantize`), trainer records the rollout peers they ban.
9: RL runs (the manifest's rl, rollout peers and their requests).
8: policy versions ('weights' requests, the cause 'version_gone'), the run's weight readers.
7: checkpoints (the run's cadence, the steps a peer holds, the 'lost' state).
6: signed records, the run's authorized trainers, the private swarm's stream challenge.
5: typed protocol meta (lists as lists), error causes, named loss inputs, the run's loss."""
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LOSS_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
"""What a registered loss name looks like (swarmtrain.model.losses checks names against it too)."""
PEER_ROLES = ("coordinator", "stage", "trainer", "rollout", "candidate")
"""'candidate': a stage peer that measured itself and waits for its run's first layout (a run
whose coordinator plans the stage bounds from the peers that come: `RunManifest.layout_version`
0); it serves no stage yet (stage -1)."""
SCHEDULES = ("readiness", "static")
"""How stage peers order their work and route microbatches (see swarmtrain/schedule)."""
PEER_STATES = ("joining", "serving", "draining", "lost", "finished")
"""'lost': a stage peer waiting for a checkpoint of a stage nobody serves any more
(swarmtrain.peers.checkpoints); 'finished': a stage peer that applied the run's last step (as
it leaves), or the coordinator of a run whose last step was committed (swarmtrain.train.run_length)."""
PEER_ID_PATTERN = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")
"""A libp2p peer id as libp2p prints it: base58btc, e.g. 12D3KooW... or Qm..."""
MAX_TRAINERS = 64
"""Trainers a manifest may authorize."""
MAX_WEIGHT_READERS = 256
"""Peers a manifest may list as weight readers."""
MAX_BANNED_LISTED = 16
"""Banned peers a peer record lists at most (a record stays small whatever a peer sees)."""
MAX_CHECKPOINTS_LISTED = 16
"""Checkpoint steps a peer record lists at most."""


def check_run_id(run_id: str) -> str:
    """Return `run_id` if it is a valid run id, else raise ConfigError saying what is allowed."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise ConfigError(
            f"invalid run id {run_id!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return run_id


def check_loss_name(name: str) -> str:
    """Return `name` if it can name a registered loss, else raise ConfigError saying what is allowed."""
    if not isinstance(name, str) or not LOSS_NAME_PATTERN.match(name):
        raise ConfigError(
            f"invalid loss name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter "
            "(--loss cross_entropy, say; leave --loss out for the model's own loss)"
        )
    return name


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"peer record: {name} must be an integer >= 0, got {value!r}")


def even_split(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Stage boundaries for `num_stages` contiguous stages of (nearly) equal block counts.

    Returns `num_stages + 1` block indices: stage k holds blocks [b[k], b[k+1]).
    """
    if num_stages < 1:
        raise ConfigError(f"the number of stages must be >= 1, got {num_stages}: give --stages 1 or more")
    if num_stages > num_blocks:
        raise ConfigError(
            f"cannot split {num_blocks} blocks into {num_stages} stages: use at most {num_blocks} stages "
            f"(--stages {num_blocks}), or a model with more blocks"
        )
    base, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for k in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return tuple(bounds)


@dataclass(frozen=True, kw_only=True)
class RunManifest:
    """Everything a peer needs to take part in a run; published by the coordinator."""

    run_id: str
    """Names the run; every DHT key and stream handler of the run is under it."""
    model: str
    """Model builder: a registered name ('tiny-gpt') or an import path ('pkg.module:function')."""
    model_config: dict = field(default_factory=dict)
    """Keyword arguments for the builder."""
    num_blocks: int
    """Blocks the model has (checked by every peer against the builder's output)."""
    stage_bounds: tuple[int, ...]
    """Stage k serves blocks [stage_bounds[k], stage_bounds[k+1])."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    seed: int = 0
    """Run seed: block i initialised from it is bit-identical on every peer."""
    max_steps: int = 0
    """Steps the run lasts (0: until stopped): trainers stop after step max_steps - 1, and stage
    peers that applied it leave (swarmtrain.train.run_length)."""
    schedule: str = "readiness"
    """'readiness': each peer runs whatever work is ready (backward first, then forward in 1F1B
    order) and each hop goes to the replica expected to finish soonest. 'static': round-robin
    replicas and a fixed 1F1B order, the baseline readiness is measured against."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Codecs of activations, gradients and replica averaging on the wire."""
    loss: str | None = None
    """The loss the last stage computes, by registered name ('cross_entropy',
    'weighted_cross_entropy', or one the builder's module registers); None: the model's own.
    It fixes the named inputs every microbatch carries (swarmtrain.model.losses)."""
    trainers: tuple[str, ...] = ()
    """Peer ids of the trainers the run's owner authorizes to drive it: only they may send a
    stage its microbatches (under their own ids) and its commit phases."""
    weight_readers: tuple[str, ...] | None = None
    """Who may fetch a stage's parameters by policy version ('weights' requests, for rollout
    peers), besides the run's trainers, its owner and the stage's own members: None, any peer
    that reaches the swarm (an open run's weights are no secret: anyone may join as a replica
    and read them); a tuple, only the peer ids it lists (empty: nobody else)."""
    checkpoint_every: int = 100
    """Every stage replica checkpoints its stage when it has applied a multiple of this many
    steps (all stages at the same steps, so they can be put together); 0: never."""
    allow_reinit: bool = False
    """A stage that lost its last replica, with no checkpoint of it anywhere, starts again from
    the run seed (False: it waits in the 'lost' state for a checkpoint to appear)."""
    instance: str = ""
    """Tells this run apart from an earlier one under the same run id (a new run gets a fresh
    one; a resumed run keeps its checkpoint's): checkpoints are kept under `disk_key`."""
    restore_lost_stage_only: bool = False
    """A stage that lost every replica comes back from its checkpoint alone, the others keeping
    their state (False: the whole run goes back to that checkpoint)."""
    init_from: str | None = None
    """A directory every stage peer reads its starting state from (only its own tensors): an
    exported model or a run checkpoint (`swarmtrain.train.archive`); None: the run seed."""
    resume: bool = False
    """With `init_from` a run checkpoint: take its optimizer state and step too (the run goes on
    where it stopped) instead of its parameters alone."""
    rl: RLConfig | None = None
    """An RL run's task and sampling (`swarmtrain.wire.rl_config`): rollout peers make its data;
    None: the trainers feed data of their own."""
    layout_version: int = 1
    """Version of the run's layout (its `stage_bounds`, and `assignments`). 0: pending, the
    bounds are a placeholder: stage peers announce themselves as candidates and wait, and the
    coordinator plans the bounds from their measured capacity (`--min-peers`, `--plan-wait`),
    then publishes version 1 (`swarmtrain.train.layout`). Trainers wait for it too."""
    layout_note: str = ""
    """Why the layout is what it is, for people: e.g. 'planned from 5 peers: ...'."""
    layout_at: float = 0.0
    """DHT time the layout was planned (0: set with the run)."""
    assignments: dict[str, int] = field(default_factory=dict)
    """The stage the layout gives each peer it was planned from (peer id -> stage); a peer
    without a --stage of its own takes it."""
    replan: ReplanConfig | None = None
    """The run's rule for re-planning its layout while it runs (`coordinator --replan`): the
    lead trainer moves the swarm to the planner's layout for the serving peers when it beats
    the live one by `min_gain` for `patience` checks (`swarmtrain.wire.layout_record`); None:
    the layout stays as planned."""
    wire_version: int = WIRE_VERSION

    def __post_init__(self):
        check_run_id(self.run_id)
        version = self.layout_version
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**31:
            raise ConfigError(f"manifest: layout_version must be an integer >= 0, got {version!r}")
        at = self.layout_at
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not (at >= 0 and math.isfinite(at)):
            raise ConfigError(f"manifest: layout_at must be a DHT time >= 0, got {at!r}")
        if not isinstance(self.layout_note, str) or len(self.layout_note) > MAX_LAYOUT_NOTE:
            raise ConfigError(f"manifest: layout_note must be text of at most {MAX_LAYOUT_NOTE} characters")
        if self.init_from is not None and (
            not isinstance(self.init_from, str) or not 0 < len(self.init_from) <= 4096
        ):
            raise ConfigError(f"manifest: init_from must be a directory path, got {self.init_from!r}")
        if not isinstance(self.resume, bool) or (self.resume and self.init_from is None):
            raise ConfigError("manifest: resume must be true or false, and true only with init_from")
        if (
            not isinstance(self.checkpoint_every, int)
            or isinstance(self.checkpoint_every, bool)
            or self.checkpoint_every < 0
        ):
            raise ConfigError(
                f"manifest: checkpoint_every must be an integer >= 0, got {self.checkpoint_every!r}"
            )
        if not isinstance(self.instance, str) or not re.fullmatch(r"[0-9a-f]{0,32}", self.instance):
            raise ConfigError(f"manifest: instance must be up to 32 hex digits, got {self.instance!r}")
        if not isinstance(self.restore_lost_stage_only, bool):
            raise ConfigError(
                f"manifest: restore_lost_stage_only must be true or false, got {self.restore_lost_stage_only!r}"
            )
        if not isinstance(self.allow_reinit, bool):
            raise ConfigError(f"manifest: allow_reinit must be true or false, got {self.allow_reinit!r}")
        trainers = self.trainers
        if (
            not isinstance(trainers, list | tuple)
            or len(trainers) > MAX_TRAINERS
            or not all(isinstance(t, str) and PEER_ID_PATTERN.match(t) for t in trainers)
        ):
            raise ConfigError(
                f"manifest: trainers must list at most {MAX_TRAINERS} peer ids, got {trainers!r}"
            )
        object.__setattr__(self, "trainers", tuple(trainers))
        readers = self.weight_readers
        if readers is not None:
            if (
                not isinstance(readers, list | tuple)
                or len(readers) > MAX_WEIGHT_READERS
                or not all(isinstance(r, str) and PEER_ID_PATTERN.match(r) for r in readers)
            ):
                raise ConfigError(
                    f"manifest: weight_readers must be null (anyone) or list at most {MAX_WEIGHT_READERS} "
                    f"peer ids, got {readers!r:.200}"
                )
            object.__setattr__(self, "weight_readers", tuple(readers))
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("manifest: model must be a builder name or an import path")
        if self.loss is not None:
            try:
                check_loss_name(self.loss)
            except ConfigError as e:
                raise ConfigError(f"manifest: {e}") from None
        if not isinstance(self.model_config, dict):
            raise ConfigError("manifest: model_config must be a mapping")
        object.__setattr__(self, "stage_bounds", tuple(int(b) for b in self.stage_bounds))
        b = self.stage_bounds
        if (
            len(b) < 2
            or b[0] != 0
            or b[-1] != self.num_blocks
            or any(x >= y for x, y in zip(b, b[1:], strict=False))
        ):
            raise ConfigError(
                f"manifest: stage_bounds {list(b)} must rise strictly from 0 to num_blocks={self.num_blocks}"
            )
        if isinstance(self.optimizer, dict):
            object.__setattr__(self, "optimizer", OptimizerConfig.from_dict(self.optimizer))
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError("manifest: optimizer must be a mapping")
        if not isinstance(self.max_steps, int) or isinstance(self.max_steps, bool) or self.max_steps < 0:
            raise ConfigError(
                f"manifest: max_steps must be an integer >= 0, got {self.max_steps!r} (--steps)"
            )
        self.optimizer.check_run_length(self.max_steps)
        if isinstance(self.batch, dict):
            object.__setattr__(self, "batch", BatchConfig.from_dict(self.batch))
        if isinstance(self.compression, dict):
            object.__setattr__(self, "compression", CompressionConfig.from_dict(self.compression))
        if not isinstance(self.compression, CompressionConfig):
            raise ConfigError("manifest: compression must be a mapping")
        self.compression.check_stages(self.num_stages)
        if isinstance(self.rl, dict):
            object.__setattr__(self, "rl", RLConfig.from_dict(self.rl))
        if self.rl is not None:
            if not isinstance(self.rl, RLConfig):
                raise ConfigError("manifest: rl must be a mapping or null")
            if self.loss is None:
                raise ConfigError("manifest: an RL run must name its GRPO loss (--loss grpo)")
            self.rl.prompts_per_step(self.batch.microbatch_size * self.batch.microbatches_per_step)
        object.__setattr__(
            self, "assignments", check_assignments(self.assignments, self.num_stages, "manifest")
        )
        if isinstance(self.replan, dict):
            object.__setattr__(self, "replan", ReplanConfig.from_dict(self.replan))
        if self.replan is not None and not isinstance(self.replan, ReplanConfig):
            raise ConfigError("manifest: replan must be a mapping or null")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"unknown schedule {self.schedule!r}: choose {' or '.join(map(repr, SCHEDULES))} (--schedule)"
            )
        if self.wire_version != WIRE_VERSION:
            raise ConfigError(
                f"run {self.run_id!r} speaks wire version {self.wire_version}, this peer speaks {WIRE_VERSION}: "
                "install the swarmtrain version the coordinator runs"
            )

    @property
    def disk_key(self) -> str:
        """The directory (under a checkpoint root) this run's checkpoints go to: 'RUN/INSTANCE'."""
        return f"{self.run_id}/{self.instance}" if self.instance else self.run_id

    @property
    def num_stages(self) -> int:
        return len(self.stage_bounds) - 1

    def stage_span(self, stage: int) -> tuple[int, int]:
        """Blocks [start, end) of `stage`; raises ConfigError for a stage the run does not have."""
        if not isinstance(stage, int) or not 0 <= stage < self.num_stages:
            last = self.num_stages - 1
            raise ConfigError(
                f"stage {stage} is out of range: run {self.run_id!r} has stages 0..{last}; "
                f"give --stage 0..{last}, or leave --stage out to take the stage that needs a peer most"
            )
        return self.stage_bounds[stage], self.stage_bounds[stage + 1]

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "model": self.model,
            "model_config": dict(self.model_config),
            "num_blocks": self.num_blocks,
            "stage_bounds": list(self.stage_bounds),
            "optimizer": self.optimizer.to_dict(),
            "batch": self.batch.to_dict(),
            "seed": self.seed,
            "max_steps": self.max_steps,
            "schedule": self.schedule,
            "compression": self.compression.to_dict(),
            "loss": self.loss,
            "trainers": list(self.trainers),
            "weight_readers": None if self.weight_readers is None else list(self.weight_readers),
            "checkpoint_every": self.checkpoint_every,
            "allow_reinit": self.allow_reinit,
            "restore_lost_stage_only": self.restore_lost_stage_only,
            "instance": self.instance,
            "init_from": self.init_from,
            "resume": self.resume,
            "rl": None if self.rl is None else self.rl.to_dict(),
            "layout_version": self.layout_version,
            "layout_note": self.layout_note,
            "layout_at": self.layout_at,
            "assignments": dict(self.assignments),
            "replan": None if self.replan is None else self.replan.to_dict(),
            "wire_version": self.wire_version,
        }

    @classmethod
    def from_dict(cls, data: Any) -> RunManifest:
        # The version first: a newer manifest may add fields, and the helpful message is the version's.
        if isinstance(data, dict) and data.get("wire_version", WIRE_VERSION) != WIRE_VERSION:
            raise ConfigError(
                f"run {data.get('run_id')!r} speaks wire version {data['wire_version']}, this peer speaks "
                f"{WIRE_VERSION}: install the swarmtrain version the coordinator runs"
            )
        return _from_dict(cls, data, "manifest")


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    """What a peer announces about itself under `{run}.peers`, refreshed by heartbeats."""

    peer_id: str
    """base58 libp2p peer id; the DHT subkey is the same string."""
    role: str
    """One of PEER_ROLES."""
    stage: int = -1
    """Stage served (stage peers), else -1."""
    state: str = "serving"
    """One of PEER_STATES."""
    device: str = "cpu"
    """Device the peer computes on, e.g. 'cpu' or 'cuda:0 (NVIDIA A100)'."""
    version: str = ""
    """swarmtrain version of the peer."""
    served: int = 0
    """Microbatches served so far (forward+backward)."""
    step: int = 0
    """Optimizer step the peer's parameters are at (stage peers)."""
    capacity: dict = field(default_factory=dict)
    """What the peer's probe measured: flops_per_s, memory_bytes, is_spot, device_name (may be empty)."""
    since: float = 0.0
    """DHT time the peer started serving its stage; the earliest serving peer is the stage's primary."""
    # readiness (what routers weigh) and counters (what the dashboard shows), stage peers only
    queue_depth: int = 0
    """Compute tasks (forward and backward) waiting or running on the peer."""
    backlog_s: float = 0.0
    """Expected seconds of compute queued on the peer: how long new work would wait."""
    service_s: float = 0.0
    """Moving average of the compute seconds one microbatch costs the peer (forward + backward)."""
    in_flight_budget: int = 0
    """Microbatches whose activations the peer may hold at once (from its free memory); 0: unknown."""
    holding: int = 0
    """Microbatches whose activations the peer holds now, waiting for their backward."""
    memory_used_bytes: int = 0
    """Memory the peer's compute uses now (CUDA: allocated by torch; CPU: the process's resident set)."""
    busy_s: float = 0.0
    """Seconds of compute since the peer started (its utilization is the rate this grows at)."""
    exchange_s: float = 0.0
    """Moving average of the seconds a step's replica exchange takes the peer (its gradient sum
    swapped with its stage's other replicas: what replicas cost a step); 0: it never exchanged."""
    replayed: int = 0
    """Microbatches the peer re-sent to another replica downstream after a failure."""
    failed: int = 0
    """Requests the peer answered with an error."""
    banned: tuple[str, ...] = ()
    """Peers this peer bans now (timeouts, errors, bad frames), at most MAX_BANNED_LISTED."""
    bytes_sent: int = 0
    """Tensor bytes sent, as they went on the wire (after compression)."""
    bytes_received: int = 0
    """Tensor bytes received, as they came off the wire."""
    raw_bytes_sent: int = 0
    """Tensor bytes sent, before compression (bytes_sent / raw_bytes_sent is the compression ratio)."""
    checkpoints: tuple[int, ...] = ()
    """Steps of the checkpoints of its stage the peer holds and serves, at most MAX_CHECKPOINTS_LISTED."""
    quantize: str | None = None
    """Rollout peers: the mode their policy copies' weights are quantized in (one of
    QUANTIZE_MODES); None: full precision."""
    layout: int = 1
    """Stage peers: the version of the run's layout (`RunManifest.layout_version`) whose stage
    they serve; routers send work only to peers of their own layout."""

    def __post_init__(self):
        _check_count("layout", self.layout)
        if self.role not in PEER_ROLES:
            raise ConfigError(f"peer record: unknown role {self.role!r}")
        if self.state not in PEER_STATES:
            raise ConfigError(f"peer record: unknown state {self.state!r}")
        if not isinstance(self.stage, int) or (self.role == "stage" and self.stage < 0):
            raise ConfigError(f"peer record: bad stage {self.stage!r}")
        for name in ("queue_depth", "in_flight_budget", "holding", "replayed", "failed"):
            _check_count(name, getattr(self, name))
        for name in ("bytes_sent", "bytes_received", "raw_bytes_sent", "memory_used_bytes"):
            _check_count(name, getattr(self, name))
        for name in ("backlog_s", "service_s", "busy_s", "exchange_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e12:
                raise ConfigError(f"peer record: {name} must be a number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        banned = self.banned
        if not isinstance(banned, (list, tuple)) or len(banned) > MAX_BANNED_LISTED:
            raise ConfigError(f"peer record: banned must list at most {MAX_BANNED_LISTED} peer ids")
        if not all(isinstance(b, str) and 0 < len(b) <= 128 for b in banned):
            raise ConfigError("peer record: banned must hold peer ids")
        object.__setattr__(self, "banned", tuple(banned))
        held = self.checkpoints
        if not isinstance(held, (list, tuple)) or len(held) > MAX_CHECKPOINTS_LISTED:
            raise ConfigError(f"peer record: checkpoints must list at most {MAX_CHECKPOINTS_LISTED} steps")
        for step in held:
            _check_count("a checkpoint step", step)
        object.__setattr__(self, "checkpoints", tuple(held))
        if self.quantize is not None and self.quantize not in QUANTIZE_MODES:
            raise ConfigError(
                f"peer record: quantize must be null or one of {list(QUANTIZE_MODES)}, got {self.quantize!r:.40}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"banned": list(self.banned), "checkpoints": list(self.checkpoints)}

    @classmethod
    def from_dict(cls, data: Any) -> PeerRecord:
        return _from_dict(cls, data, "peer record")
