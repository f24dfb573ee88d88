"""The settings a run manifest carries for training: optimizer, batching, compression.

Frozen dataclasses with `to_dict()`/`from_dict()` like every record (`swarmtrain.wire.records`):
`from_dict` validates what came off the network and raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from swarmtrain.errors import ConfigError

CODEC_CHOICES = ("none", "fp16", "bf16", "int8", "nf4", "uint4", "int8-s16", "nf4-s16", "uint4-s16", "auto")
"""Codec settings a manifest may name: swarmtrain.compress's codecs (the -s16 ones keep their
block scales in fp16), or 'auto' (chosen per link by swarmtrain.compress.policy from its
measured bandwidth)."""


LR_SCHEDULES = ("constant", "cosine")
"""Learning-rate schedules after warmup (swarmtrain.train.optim.lr_at)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _from_dict(cls, data: Any, what: str):
    """Build dataclass `cls` from a dict off the wire, rejecting unknown and missing fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{what}: unknown fields {sorted(unknown)}")
    try:
        return cls(**data)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # e.g. int("a") while __post_init__ normalises a field
        raise ConfigError(f"{what}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer every stage runs over its own parameters."""

    name: str = "adamw"
    """'adamw' or 'sgd'."""
    lr: float = 3e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (ignored by sgd)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    momentum: float = 0.0
    """SGD momentum (ignored by adamw)."""
    warmup_steps: int = 0
    """Steps of linear warmup: step s < warmup_steps runs at lr * (s + 1) / warmup_steps (--warmup-steps)."""
    schedule: str = "constant"
    """The learning rate after warmup, one of LR_SCHEDULES (--lr-schedule): 'constant' keeps lr;
    'cosine' follows half a cosine from lr down to min_lr at the run's last step (max_steps - 1)."""
    min_lr: float = 0.0
    """Where the cosine schedule ends, an absolute learning rate in [0, lr] (--min-lr); the
    constant schedule takes none (0)."""
    max_grad_norm: float = 0.0
    """Clip the whole model's gradient, every stage's together, to this L2 norm, as
    torch.nn.utils.clip_grad_norm_ would in one process (--max-grad-norm); 0: no clipping."""

    def __post_init__(self):
        if self.name not in ("adamw", "sgd"):
            raise ConfigError(f"unknown optimizer {self.name!r}: choose 'adamw' or 'sgd' (--optimizer)")
        if not (self.lr > 0):
            raise ConfigError(f"learning rate must be > 0, got {self.lr}: give a positive --lr, e.g. 3e-3")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0 or self.momentum < 0:
            raise ConfigError(
                f"weight_decay and momentum must be >= 0, got {self.weight_decay} and {self.momentum}: "
                "give a --weight-decay of 0 or more"
            )
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ConfigError(
                f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}: give --warmup-steps 0 or more"
            )
        if self.schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"unknown learning-rate schedule {self.schedule!r}: choose "
                f"{' or '.join(map(repr, LR_SCHEDULES))} (--lr-schedule)"
            )
        for name in ("min_lr", "max_grad_norm"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < math.inf:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}: give {flag} 0 or more")
            object.__setattr__(self, name, float(value))
        if self.schedule == "constant" and self.min_lr != 0:
            raise ConfigError(
                f"min_lr {self.min_lr} ends a cosine schedule, and this one is constant: "
                "give --lr-schedule cosine, or leave --min-lr out"
            )
        if self.min_lr > self.lr:
            raise ConfigError(
                f"min_lr {self.min_lr} is above the learning rate {self.lr}: give a --min-lr of at most --lr"
            )

    def check_run_length(self, max_steps: int) -> None:
        """Raise ConfigError unless the schedule fits a run of `max_steps` steps (0: until stopped)."""
        if self.schedule == "cosine" and max_steps <= 0:
            raise ConfigError(
                "the cosine schedule decays over the run's steps, and this run has no step count: "
                "give the coordinator --steps N, or --lr-schedule constant"
            )
        if 0 < max_steps <= self.warmup_steps:
            raise ConfigError(
                f"warmup_steps {self.warmup_steps} would last the whole run of {max_steps} steps: "
                "give --warmup-steps below --steps"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"betas": list(self.betas)}

    @classmethod
    def from_dict(cls, data: Any) -> OptimizerConfig:
        return _from_dict(cls, data, "optimizer")


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How much data one optimizer step sees."""

    microbatch_size: int = 8
    """Sequences per microbatch."""
    microbatches_per_step: int = 4
    """Microbatches accumulated into one optimizer step (the flush boundary)."""
    max_in_flight: int = 4
    """Microbatches a trainer keeps in the pipeline at once."""

    def __post_init__(self):
        for name in ("microbatch_size", "microbatches_per_step", "max_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{name} must be a positive integer, got {value!r}: give {flag} 1 or more")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> BatchConfig:
        return _from_dict(cls, data, "batch")


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """How tensors are compressed on the wire, per direction and per boundary (DESIGN.md section 7).

    Each direction is one codec of CODEC_CHOICES for the whole pipeline, or a comma-separated
    list of them, one per place it applies: activations and gradients one per boundary
    (boundary k joins stage k to stage k+1, so a run of S stages has S-1), averaging one per
    stage. So `activations="none,int8,nf4"` sends stage 0's output raw (say the first two stages
    share a LAN), stage 1's as int8 and stage 2's as nf4. The default, 'none' everywhere, sends
    raw values.
    """

    activations: str = "none"
    """Codec(s) of the activations a stage sends forward to the next (--compress-activations)."""
    gradients: str = "none"
    """Codec(s) of the activation gradients a stage sends backward (--compress-gradients)."""
    averaging: str = "none"
    """Codec(s) of the gradient sums the replicas of a stage exchange (--compress-averaging)."""
    error_feedback: bool = True
    """Gradient and averaging codecs carry what they dropped into the next send (--error-feedback)."""

    DIRECTIONS: ClassVar[tuple[str, ...]] = ("activations", "gradients", "averaging")

    def __post_init__(self):
        for name in self.DIRECTIONS:
            object.__setattr__(self, name, _parse_codecs(name, getattr(self, name)))
        if not isinstance(self.error_feedback, bool):
            raise ConfigError(
                f"error_feedback must be true or false, got {self.error_feedback!r} "
                "(--error-feedback / --no-error-feedback)"
            )

    def codecs(self, direction: str) -> tuple[str, ...]:
        """The codecs `direction` names: one (for every boundary or stage), or one per each."""
        return tuple(getattr(self, direction).split(","))

    def codec(self, direction: str, index: int) -> str:
        """The setting of `direction` at boundary `index` (activations, gradients: the boundary
        between stage index and index+1) or at stage `index` (averaging)."""
        choices = self.codecs(direction)
        return choices[0] if len(choices) == 1 else choices[index]

    def sent_by(self, direction: str, stage: int) -> str:
        """The setting of what `stage` sends in `direction`: its activations cross its downstream
        boundary (stage), its gradients its upstream one (stage - 1), its sums stay in the stage."""
        return self.codec(direction, max(stage - 1, 0) if direction == "gradients" else stage)

    def check_stages(self, num_stages: int) -> None:
        """Raise ConfigError unless every per-boundary list fits a run of `num_stages` stages."""
        for name in self.DIRECTIONS:
            given = len(self.codecs(name))
            wanted = num_stages if name == "averaging" else num_stages - 1
            if given == 1 or given == wanted:
                continue
            where = (
                f"{num_stages} stages"
                if name == "averaging"
                else f"{wanted} boundar{'y' if wanted == 1 else 'ies'} between its {num_stages} stages"
            )
            fix = (
                f"give one codec for all of them, or {wanted} separated by commas"
                if wanted > 1
                else "give one codec"
            )
            raise ConfigError(
                f"--compress-{name} names {given} codecs ({getattr(self, name)!r}), but the run has {where}: {fix}"
            )

    @property
    def is_enabled(self) -> bool:
        """Whether any direction compresses anywhere."""
        return any(c != "none" for n in self.DIRECTIONS for c in self.codecs(n))

    def describe(self) -> str:
        """One line for people: 'activations int8, gradients none,int8, ...'."""
        parts = [f"{n} {getattr(self, n)}" for n in self.DIRECTIONS]
        return ", ".join(parts) + f", error feedback {'on' if self.error_feedback else 'off'}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> CompressionConfig:
        return _from_dict(cls, data, "compression")


def _parse_codecs(name: str, value: Any) -> str:
    """A direction's setting checked and made canonical: 'int8', or 'none,int8' for a list
    (a list or tuple of names is accepted too; spaces around names are dropped)."""
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        entries = [v.strip() for v in value]
    elif isinstance(value, str):
        entries = [v.strip() for v in value.split(",")]
    else:
        entries = None
    if entries is None or (len(entries) == 1 and entries[0] not in CODEC_CHOICES):
        raise ConfigError(
            f"unknown codec {value!r} for {name}: choose one of {', '.join(CODEC_CHOICES)} "
            f"(--compress-{name}), or one per boundary separated by commas"
        )
    for i, entry in enumerate(entries):
        if entry not in CODEC_CHOICES:
            place = "stage" if name == "averaging" else "boundary"
            raise ConfigError(
                f"unknown codec {entry!r} for {name} at {place} {i} of {','.join(entries)!r}: choose one of "
                f"{', '.join(CODEC_CHOICES)} (--compress-{name})"
            )
    return ",".join(entries)
