"""How many microbatches a trainer keeps in flight (pure): grow while it pays, halve on timeouts.

After each step the trainer reports the step's tokens/s and how many of its calls timed
out. A timeout halves the window (the swarm is overloaded or a peer stalls). Otherwise the
window grows by one while throughput keeps rising by more than `min_gain`; a growth that
did not pay is undone and the window holds, probing upward again every `probe_every` steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    initial: int = 4
    min_size: int = 1
    max_size: int = 64
    min_gain: float = 0.03
    """Relative throughput gain a growth must bring to be kept."""
    probe_every: int = 8
    """Steps at a steady size before trying one more microbatch in flight."""

    def __post_init__(self):
        if not 1 <= self.min_size <= self.initial <= self.max_size:
            raise ValueError(f"need 1 <= min_size <= initial <= max_size, got {self}")


class InFlightWindow:
    """The trainer's in-flight window; `size` is the current value."""

    def __init__(self, config: WindowConfig | None = None):
        self.config = config or WindowConfig()
        self.size = self.config.initial
        self._best = 0.0
        self._grew = False
        self._steady = 0

    def on_step(self, tokens_per_s: float, *, timeouts: int = 0) -> int:
        """Take one step's outcome; returns the window for the next step."""
        cfg = self.config
        if timeouts:
            self.size = max(cfg.min_size, self.size // 2)
            self._best, self._grew, self._steady = 0.0, False, 0
            return self.size
        if self._grew:  # the step ran one microbatch more in flight than before
            self._grew = False
            if tokens_per_s > self._best * (1 + cfg.min_gain):
                self._best = tokens_per_s
                return self._grow()
            self.size = max(cfg.min_size, self.size - 1)  # it did not pay: undo it
            self._steady = 0
            return self.size
        fresh = self._best == 0.0
        self._best = tokens_per_s if fresh else 0.5 * (self._best + tokens_per_s)
        self._steady += 1
        if fresh or self._steady >= cfg.probe_every:
            return self._grow()
        return self.size

    def _grow(self) -> int:
        if self.size < self.config.max_size:
            self.size += 1
            self._grew = True
        self._steady = 0
        return self.size
