"""Training metrics as the DHT carries them.

`TrainerPoint` is what a trainer reports after an optimizer step, under `{run}.trainers`
(subkey: the trainer's peer id); the dashboard's `SwarmView.add_trainer_point()` takes it.
A trainer of an RL run adds an `RLPoint`: what the step's completions earned and how old they
were, and what its rollout feed counted so far (`swarmtrain.rl.feed`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.wire.run_config import _from_dict, _is_int, _is_number

RL_COUNTS = ("samples", "stale", "rejected", "lost", "banned", "verified", "verify_failed")
"""An RLPoint's counts: integers >= 0."""


@dataclass(frozen=True, kw_only=True)
class RLPoint:
    """One optimizer step of an RL run, as the trainer's rollout feed saw it.

    The means over the step's completions are NaN exactly when it trained on none (`samples`
    0); the counts after `samples` are the feed's since it started, not the step's."""

    samples: int
    """Completions this trainer fed into the step."""
    reward: float
    """Their mean reward."""
    accuracy: float
    """The fraction of them that were fully right (the task's full reward), in [0, 1]."""
    policy_lag: float
    """Their mean policy lag: the step minus the policy version that sampled each."""
    samples_per_s: float
    """Completions fed into the step divided by the step's wall time."""
    stale: int = 0
    """Completions dropped as older than the run's max_staleness."""
    rejected: int = 0
    """Completions refused with their rollout peer (malformed, a wrong reward, lying log-probs)."""
    lost: int = 0
    """Completions asked of a rollout peer that failed or died before answering."""
    banned: int = 0
    """Rollout peers banned from the run."""
    verified: int = 0
    """Replies whose behaviour log-probs the pipeline recomputed and found to hold."""
    verify_failed: int = 0
    """Replies whose behaviour log-probs did not hold."""

    def __post_init__(self):
        for name in RL_COUNTS:
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ConfigError(f"trainer point: rl.{name} must be an integer >= 0, got {value!r}")
        for name in ("reward", "accuracy", "policy_lag", "samples_per_s"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ConfigError(f"trainer point: rl.{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        means = {"reward": self.reward, "accuracy": self.accuracy, "policy_lag": self.policy_lag}
        for name, value in means.items():
            if self.samples and not math.isfinite(value):
                raise ConfigError(
                    f"trainer point: rl.{name} must be finite for a step of {self.samples} samples, got {value}"
                )
            if not self.samples and not math.isnan(value):
                raise ConfigError(
                    f"trainer point: rl.{name} must be NaN for a step of no samples, got {value}"
                )
        if self.samples and not 0 <= self.accuracy <= 1:
            raise ConfigError(f"trainer point: rl.accuracy must be in [0, 1], got {self.accuracy}")
        if not math.isfinite(self.samples_per_s) or self.samples_per_s < 0:
            raise ConfigError(
                f"trainer point: rl.samples_per_s must be finite and >= 0, got {self.samples_per_s}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> RLPoint:
        return _from_dict(cls, data, "trainer point: rl")


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
    rl: RLPoint | None = None
    """An RL run's step: its rewards, policy lag and the feed's counts; None: not an RL run."""

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
        if isinstance(self.rl, dict):
            object.__setattr__(self, "rl", RLPoint.from_dict(self.rl))
        if self.rl is not None and not isinstance(self.rl, RLPoint):
            raise ConfigError(f"trainer point: rl must be a mapping or null, got {type(self.rl).__name__}")

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
