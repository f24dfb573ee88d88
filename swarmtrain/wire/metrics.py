"""Training metrics as the DHT carries them.

`TrainerPoint` is what a trainer reports after an optimizer step, under `{run}.trainers`
(subkey: the trainer's peer id); the dashboard's `SwarmView.add_trainer_point()` takes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from swarmtrain.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TrainerPoint:
    """One optimizer step as seen by the trainer that drove it."""

    trainer: str
    """Who reports: the trainer's peer id (or any stable name)."""
    step: int
    """Optimizer step just completed."""
    loss: float
    """Mean training loss over the step's microbatches."""
    tokens_per_s: float
    """Tokens the step consumed divided by its wall time."""
    t: float
    """Wall-clock time (time.time(), the DHT's clock) the step completed."""
    completed: int = 0
    """Microbatches whose gradients went into a step, since the trainer started."""
    replayed: int = 0
    """Microbatch replays after a failure (timeouts, dead or draining peers), since the trainer started."""
    dropped: int = 0
    """Microbatches left out of their step, each with a cause (see StepResult.dropped_causes)."""
    window: int = 0
    """Microbatches the trainer keeps in flight at once (it adapts to the swarm's throughput)."""
    rolled_back: str = ""
    """Set on the point a trainer publishes when it sent the run back to a checkpoint (a stage
    lost every replica): what was lost and why (`swarmtrain.train.rollback`)."""

    def __post_init__(self):
        if not isinstance(self.trainer, str) or not self.trainer:
            raise ConfigError("trainer point: trainer must be a non-empty name")
        if not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"trainer point: step must be an integer >= 0, got {self.step!r}")
        object.__setattr__(self, "loss", float(self.loss))
        object.__setattr__(self, "tokens_per_s", float(self.tokens_per_s))
        object.__setattr__(self, "t", float(self.t))
        if not math.isfinite(self.tokens_per_s) or self.tokens_per_s < 0:
            raise ConfigError(f"trainer point: tokens_per_s must be finite and >= 0, got {self.tokens_per_s}")
        if not isinstance(self.rolled_back, str) or len(self.rolled_back) > 512:
            raise ConfigError("trainer point: rolled_back must be a text of at most 512 characters")
        for name in ("completed", "replayed", "dropped", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"trainer point: {name} must be an integer >= 0, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TrainerPoint:
        if not isinstance(data, dict):
            raise ConfigError(f"trainer point: expected a mapping, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"trainer point: unknown fields {sorted(unknown)}")
        try:
            return cls(**data)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError(f"trainer point: {e}") from None
