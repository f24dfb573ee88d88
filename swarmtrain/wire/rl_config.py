"""What a run manifest says about reinforcement learning: the task, the groups, staleness.

An RL run's manifest carries an `RLConfig` (and names a GRPO loss, `swarmtrain.rl.grpo`, whose
temperature the rollout peers sample at). One optimizer step trains on
`microbatch_size * microbatches_per_step` completions: `prompts_per_step(batch)` prompts of
`samples_per_prompt` completions each, which must divide it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.wire.run_config import _from_dict, _is_int, _is_number

MAX_TASK_CHARS = 200
QUANTIZE_MODES = ("8bit", "4bit")
"""How a rollout peer may keep its policy copies' Linear weights (`swarmtrain.rl.quantize`)."""


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """How an RL run makes its data: rollout peers sample completions of a task's prompts."""

    task: str
    """The task: a registered name ('add', 'sort', 'reverse') or an import path (`swarmtrain.rl.registry`)."""
    task_options: dict = field(default_factory=dict)
    """Keyword arguments of the task's builder (e.g. {'digits': 2})."""
    samples_per_prompt: int = 8
    """G: completions sampled per prompt; the group its advantages are normalised over."""
    max_staleness: int = 2
    """A completion sampled by policy version v trains step s only if s - v <= this; older ones
    are dropped and counted (`--max-staleness`)."""
    weights_codec: str = "none"
    """How rollout peers fetch policy versions: 'none' (exact), 'bf16' or 'int8'."""
    verify_fraction: float = 0.1
    """Share of rollout replies sampled by the version the stages hold whose behaviour log-probs
    the trainer recomputes through the pipeline (`swarmtrain.rl.verify`); 0 checks none
    (`--verify-fraction`)."""
    logprob_tolerance: float = 0.1
    """Nats: a checked reply whose claimed log-probs differ from the pipeline's by more than this
    on average over its completion tokens bans its rollout peer. Honest peers measured on a
    small policy (`benchmarks/logprob_check.py`): ~1e-7 at full precision, under 0.02 from
    bf16/int8-coded or 8-bit weights, up to ~0.09 from 4-bit ones (raise it for those); liars
    0.2 and up (`--logprob-tolerance`)."""

    def __post_init__(self):
        if not isinstance(self.task, str) or not 0 < len(self.task) <= MAX_TASK_CHARS:
            raise ConfigError(f"rl: task must be a task name or import path, got {self.task!r:.100}")
        if not isinstance(self.task_options, dict):
            raise ConfigError("rl: task_options must be a mapping")
        if not _is_int(self.samples_per_prompt) or not 2 <= self.samples_per_prompt <= 1024:
            raise ConfigError(
                f"rl: samples_per_prompt must be an integer in 2..1024 (a group needs two to compare), "
                f"got {self.samples_per_prompt!r} (--samples-per-prompt)"
            )
        if not _is_int(self.max_staleness) or not 0 <= self.max_staleness <= 1000:
            raise ConfigError(
                f"rl: max_staleness must be an integer in 0..1000, got {self.max_staleness!r} (--max-staleness)"
            )
        if not _is_number(self.verify_fraction) or not 0 <= self.verify_fraction <= 1:
            raise ConfigError(
                f"rl: verify_fraction must be a number in [0, 1] (the share of rollout replies checked), "
                f"got {self.verify_fraction!r} (--verify-fraction)"
            )
        tolerance = self.logprob_tolerance
        if not _is_number(tolerance) or not 0 < tolerance < math.inf:
            raise ConfigError(
                f"rl: logprob_tolerance must be a number of nats > 0, got {tolerance!r} (--logprob-tolerance)"
            )
        if self.weights_codec not in ("none", "bf16", "int8"):
            raise ConfigError(
                f"rl: weights_codec must be 'none', 'bf16' or 'int8', got {self.weights_codec!r} (--weights-codec)"
            )

    def prompts_per_step(self, samples_per_step: int) -> int:
        """Prompts one step trains on; ConfigError unless `samples_per_step` is a multiple of G."""
        G = self.samples_per_prompt
        if samples_per_step % G:
            raise ConfigError(
                f"an RL step trains on microbatch_size x microbatches_per_step = {samples_per_step} "
                f"completions, not a multiple of samples_per_prompt={G}: make it one"
            )
        return samples_per_step // G

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> RLConfig:
        return _from_dict(cls, data, "rl")
