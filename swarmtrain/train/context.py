"""What the protocol code of one stage replica works through: `StageContext`.

The serving halves of the protocol (`serving.ForwardServer`, `commit.CommitParticipant`,
`service.StageService`) take this small context instead of a peer object. A real stage peer
(`swarmtrain.peers.stage`) fills it from its DHT node and libp2p transport; tests and the
simulator fill it from an in-memory network and a dict of replicas. A replica that moves to
another stage gets a new context (and new servers): nothing in here changes stage.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarmtrain.compress.policy import resolve_codec
from swarmtrain.schedule import ReadinessRouter
from swarmtrain.schedule.runtime import ComputeScheduler
from swarmtrain.train.authority import RunAuthority
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.wire.records import CompressionConfig

WIRE_DTYPES = {
    "activations": {"bf16": "bf16", "fp16": "fp16"},
    "gradients": {"bf16": "bf16", "fp16": "bf16"},
}
"""What a replica computing in 16 bits sends, where the run sets no codec: by direction, by compute dtype."""


def _nothing() -> None:
    return None


@dataclass(kw_only=True)
class StageContext:
    """One replica of one stage, as the protocol sees it."""

    run_id: str
    peer_id: str
    stage: int
    num_stages: int
    runner: StageRunner
    """The stage's compute and optimizer state."""
    scheduler: ComputeScheduler
    """The compute thread, in ready-queue order."""
    router: ReadinessRouter
    """Chooses the next stage's replica for each hop; bans failed ones."""
    transport: TensorTransport
    compression: CompressionConfig
    """The run's codec settings."""
    replicas: Callable[[int], list[str]]
    """Other serving replicas of a stage, as this replica sees them now."""
    refresh: Callable[[float], Awaitable[None]]
    """Wait this many seconds, then read the swarm's replicas again."""
    authority: RunAuthority
    """Who the run authorizes to send this replica what (its trainers, its stages' members)."""
    membership_proof: Callable[[], Any] = lambda: None
    """This replica's signed peer record, which its forwards carry (None: none yet, or in-process)."""
    link_bandwidth: Callable[[str], float | None] = lambda peer: None
    """Measured bytes/s to a peer (None: unknown), for 'auto' codecs."""
    is_draining: Callable[[], bool] = lambda: False
    """The replica is leaving its stage: it refuses new microbatches."""
    on_behind: Callable[[], None] = _nothing
    """Work of a later step arrived: this replica fell behind and should catch up once idle."""
    on_applied: Callable[[], None] = _nothing
    """A step was applied (announce the new step soon, checkpoint it if due)."""
    checkpoint_state: Callable[[int], dict | None] = lambda step: None
    """The state of this stage's checkpoint of `step` on this peer's disk, None if it holds none."""
    on_relayout: Callable[[int, int], Awaitable[int]] | None = None
    """Move this peer to layout version `layout` at `step` (`Relayout`); returns the stage it
    serves there. None: this replica cannot move (refused)."""

    @property
    def handler(self) -> str:
        return handler_name(self.run_id)

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def codec_for(self, direction: str, peer: str, nbytes: int) -> str:
        """The codec to send `nbytes` of `direction` ('activations', 'gradients', 'averaging')
        to `peer` with: the run's setting for the boundary it crosses (activations go over this
        stage's downstream boundary, gradients over its upstream one, averaging stays within the
        stage), or for 'auto' the one the link's bandwidth calls for.

        Where that is 'none' and this replica computes in 16 bits, activations go in its
        compute dtype (half the bytes, and no rounding the compute did not already do) and
        gradients in bf16 (fp16's range would flush the small ones to zero); the gradient
        sums replicas average stay float32, as they must for bit-identical replicas."""
        setting = self.compression.sent_by(direction, self.stage)
        codec = resolve_codec(setting, self.link_bandwidth(peer), nbytes)
        if codec == "none" and direction in WIRE_DTYPES:
            return WIRE_DTYPES[direction].get(self.runner.compute_dtype, "none")
        return codec
