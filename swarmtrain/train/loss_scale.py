"""Dynamic loss scaling for a stage that computes in float16, local to the stage.

float16 keeps 5 exponent bits: the small gradients of a deep model underflow to zero in it.
The usual cure (torch's GradScaler) multiplies the loss by a large power of two S, divides
the parameter gradients by S before the optimizer, and when a gradient overflows skips the
step and halves S. A pipeline stage can do all of it by itself, without asking anyone:

- it multiplies the gradient that arrives at its output (or, on the last stage, its loss) by
  S before its backward, and divides the gradients its backward yields (parameters and its
  input) by S, in float32. S is a power of two, so the round trip is exact wherever float16
  was not the limit: what leaves the stage is the float32 gradient, unscaled, as from any
  other stage;
- an overflow (a gradient that is not finite) costs one more backward of that microbatch at
  S/2, never a step: the graph is kept for it (`retain_graph`). Scale 1 that still overflows
  is a microbatch the stage refuses, as in float32;
- after `growth_interval` backward passes in a row without overflow, S doubles.

Replicas of a stage stay bit-identical whatever their scales: each applies the same summed
gradient total (`StageRunner.apply_step`), and the scale only changed how each computed its share.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScale:
    """The scale of one stage's float16 backward passes (a power of two, >= 1)."""

    scale: float = 2.0**16
    growth_interval: int = 500
    """Backward passes in a row without overflow before the scale doubles."""
    max_scale: float = 2.0**24
    overflows: int = 0
    """Backward passes that overflowed (and ran again at half the scale)."""
    _good: int = 0

    def __post_init__(self):
        if not (self.scale >= 1 and float(self.scale).is_integer() and _is_power_of_two(int(self.scale))):
            raise ValueError(f"a loss scale is a power of two >= 1, got {self.scale}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")

    def backoff(self) -> bool:
        """A backward at this scale overflowed: halve it. False when it is 1 already (the
        microbatch's gradient is not finite at any scale)."""
        self._good = 0
        if self.scale <= 1:
            return False
        self.overflows += 1
        self.scale /= 2
        return True

    def passed(self) -> None:
        """A backward at this scale was finite: double it after `growth_interval` in a row."""
        self._good += 1
        if self._good >= self.growth_interval and self.scale < self.max_scale:
            self.scale *= 2
            self._good = 0


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
