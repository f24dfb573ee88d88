"""Norm bounds: refuse a finite but absurd tensor before a stage uses it.

Frames are checked for NaN and inf on arrival (`wire.frames`), but 1e30 is finite: a peer
could send activations or gradients that large, and a sum of them makes AdamW's second
moment overflow, after which no parameter changes again. So each stream of tensors a stage
takes in has a `NormBound`:
- `activations`: the input `x` of each forward (floating-point inputs only);
- `grads_in`: the gradient of this stage's output that the next stage sends back;
- `exchange`: another replica's gradient sum, received in the exchange;
- `param_grads`: this stage's own parameter gradient of each microbatch.

A value (one tensor or a list) is judged by its L2 norm `n`, computed in fp32, and its RMS
`r = n / sqrt(numel)`:
1. `n` must be finite. A finite fp32 norm means the sum of squares did not overflow, so
   every element's square is finite too (AdamW squares the gradients it is given).
2. `r <= max_rms`, always, from the very first value (see `BoundsConfig.max_rms`).
3. After `warmup` accepted values, `n <= factor * median` of the last `window` accepted
   norms, with `factor` for activations and the looser `grad_factor` for gradient streams.
An accepted value's norm joins the window; a refused one's does not, so a run of absurd
values cannot move the median. A value whose RMS is below `min_recorded_rms` (a zero norm:
a replica that summed no microbatch; or nearly zero: the error-feedback residue such a
replica still sends through a lossy codec) is accepted and not recorded, so steps without
work cannot set a median that real work then exceeds. `NormBound` is pure arithmetic on floats; `tensor_norm` is the
one place that touches tensors.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils import get_total_norm

from swarmtrain.errors import BadFrameError

SQUARE_SAFE = math.sqrt(torch.finfo(torch.float32).max)
"""Largest magnitude whose square is finite in fp32 (about 1.8e19): an optimizer step is
refused unless its gradients' norm stays below this."""


@dataclass(frozen=True, kw_only=True)
class BoundsConfig:
    """How far outside recent experience an incoming or computed tensor may be."""

    window: int = 64
    """Accepted norms the median is taken over (the most recent ones)."""
    warmup: int = 4
    """Accepted values a stream needs before the relative bound applies (the absolute one
    applies from the first)."""
    factor: float = 1e3
    """Activations whose norm exceeds `factor` times the median are refused. Their norms move
    by a few times over a run (under 5x in tiny-gpt, even through a loss spike); a thousandfold
    jump is a broken or hostile peer."""
    grad_factor: float = 1e5
    """The same for gradients (`grads_in`, `exchange`, `param_grads`). Gradients follow the
    loss: a healthy but unstable run (tiny-gpt at lr 1e-2) moved a stage's per-microbatch
    gradient norm 2.6e3 times its running median in one loss spike, so they get more room."""
    max_rms: float = 1e6
    """Absolute cap on a value's RMS. Healthy activations have an RMS of order 1 to 1e2 (a
    few outlier features of 1e3 to 1e4 barely move it) and gradients far less, so this never
    refuses a healthy value, even before the median exists; it refuses 1e30 at once. It also
    keeps every element below 1e6 * sqrt(numel), whose square is finite in fp32."""

    min_recorded_rms: float = 1e-9
    """Values with a smaller RMS are accepted without joining the median: they carry no work
    (a healthy gradient's RMS is many orders above this; such a value is harmless)."""

    def __post_init__(self):
        if self.window < 1 or not 0 <= self.warmup <= self.window:
            raise ValueError(
                f"bounds need window >= 1 and 0 <= warmup <= window, got window={self.window}, "
                f"warmup={self.warmup}"
            )
        for name in ("factor", "grad_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 1):
                raise ValueError(f"bounds {name} must be a finite number above 1, got {value}")
        if not (math.isfinite(self.max_rms) and self.max_rms > 0):
            raise ValueError(f"bounds max_rms must be a finite positive number, got {self.max_rms}")


class NormBound:
    """One stream's running median of accepted norms, and the rules above."""

    def __init__(self, config: BoundsConfig, factor: float | None = None):
        self.config = config
        self.factor = config.factor if factor is None else factor
        self._norms: deque[float] = deque(maxlen=config.window)
        self._accepted = 0

    @property
    def median(self) -> float | None:
        """The median of the recent accepted norms, once the warm-up is over."""
        if self._accepted < self.config.warmup or not self._norms:
            return None
        return statistics.median(self._norms)

    def admit(self, norm: float, numel: int) -> str | None:
        """None when a value of L2 norm `norm` over `numel` elements is accepted (and recorded),
        else why it is refused (and nothing is recorded)."""
        cfg = self.config
        if not math.isfinite(norm):
            return f"its norm is not finite in fp32 ({norm})"
        rms = norm / math.sqrt(max(numel, 1))
        if rms > cfg.max_rms:
            return f"its RMS {rms:.3g} exceeds the cap {cfg.max_rms:.3g}"
        median = self.median
        if median is not None and median > 0 and norm > self.factor * median:
            return f"its norm {norm:.3g} exceeds {self.factor:.3g} x the recent median {median:.3g}"
        if rms >= cfg.min_recorded_rms:
            self._norms.append(norm)
            self._accepted += 1
        return None


class StageBounds:
    """The bounds of one stage replica's streams (see the module docstring)."""

    def __init__(self, config: BoundsConfig | None = None):
        self.config = config = config or BoundsConfig()
        self.activations = NormBound(config)
        self.grads_in = NormBound(config, config.grad_factor)
        self.exchange = NormBound(config, config.grad_factor)
        self.param_grads = NormBound(config, config.grad_factor)


def tensor_norm(tensors: Tensor | Sequence[Tensor]) -> tuple[float, int]:
    """(L2 norm in fp32, element count) of a tensor or of a list of them taken as one vector.

    The norm is inf when any element is inf or its square overflows fp32, NaN when any is NaN.
    """
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if not tensors:
        return 0.0, 0
    floats = [t.float() if t.dtype != torch.float32 else t for t in tensors]
    return float(get_total_norm(floats)), sum(t.numel() for t in tensors)


def admit_frame(bound: NormBound, norm: tuple[float, int], what: str) -> None:
    """Raise BadFrameError unless `bound` admits received tensors of `norm` (`tensor_norm`'s
    (norm, numel)); `what` names them in the message."""
    refused = bound.admit(*norm)
    if refused is not None:
        raise BadFrameError(f"{what} out of bounds: {refused}")
