"""What one optimizer step reports (`step.TrainerStep.run`): its loss, its accounting of every
microbatch, the replicas' verdict, its learning rate and gradient norm."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepResult:
    step: int
    """Optimizer step just applied (0-based)."""
    loss: float
    """Mean loss over the step's microbatches (those of every trainer that fed it)."""
    samples: int
    tokens: int
    seconds: float
    replays: int
    """Replays after failures (hops replayed by stages, resends by the trainer, repairs at commit)."""
    dropped: int = 0
    """Microbatches left out of the step (see dropped_causes)."""
    completed: int = 0
    """Microbatches whose gradients the step applied (each exactly once per stage)."""
    adopted: int = 0
    """Of the completed, microbatches of a trainer that left mid-step, which every stage held:
    counted, their loss unknown (`loss` is the mean of the known ones)."""
    replay_causes: dict = field(default_factory=dict)
    dropped_causes: dict = field(default_factory=dict)
    work: dict = field(default_factory=dict)
    """Per stage: microbatches each replica (peer id) completed this step."""
    window: int = 0
    """Microbatches in flight at once during the step."""
    timeouts: int = 0
    replicas_equal: bool | None = None
    """With verify_replicas: True when every stage with two or more replicas had them all hash
    to the same parameters, False when some differ, None when nothing was compared (verify is
    off, or no stage had a second replica that answered)."""
    replicas_compared: dict = field(default_factory=dict)
    """With verify_replicas: per stage, how many replicas' digests were compared."""
    rolled_back: str = ""
    """Before this step the run went back to a checkpoint: which stage was lost, to which step,
    and how many steps that cost (`swarmtrain.train.rollback`); empty otherwise."""
    lr: float | None = None
    """The learning rate the step was applied with (`optim.lr_at`)."""
    grad_norm: float | None = None
    """L2 norm of the whole model's gradient as applied, before clipping; None if a stage
    did not report its part."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
