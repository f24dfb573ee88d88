"""Typed protocol messages: the meta of every frame kind, validated in one place.

A frame (`swarmtrain.wire.frames`) carries tensors and a small `meta` mapping of scalars and
lists of scalars. Each kind of frame gives its meta one of the records below. A sender builds
the record and calls `to_meta()`; a receiver calls `Record.from_meta(frame.meta)`, which
checks every field's type and range and raises BadFrameError naming the first bad field, so
the protocol code after it works on typed values and never parses strings.

| frame kind          | meta record                         | direction              |
|---------------------|-------------------------------------|------------------------|
| forward             | ForwardMeta                         | trainer/stage -> stage |
| result              | ResultMeta                          | reply to forward       |
| step                | Prepare, Exchange, Apply, Abort     | trainer -> stage       |
| step_done           | Prepared, Exchanged, Applied, none  | reply to step          |
| grads               | GradsMeta                           | replica -> replica     |
| pong                | PongMeta                            | reply to ping          |
| error               | see `frames.error_frame` (cause)    | any reply              |
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from swarmtrain.errors import BadFrameError
from swarmtrain.wire.frames import MAX_META_LIST

MAX_PEER_ID_CHARS = 128
MAX_MB_ID_CHARS = 256


def _fail(what: str, name: str, expected: str, value: Any) -> None:
    raise BadFrameError(f"{what} meta {name!r} must be {expected}, got {value!r:.80}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, float) or _is_int(v)) and math.isfinite(v)


# Field checkers: (value, what, name) -> the typed value, or BadFrameError.


def _float(lo: float, hi: float, *, lo_open: bool = False):
    def check(v, what, name):
        if not _is_number(v) or v > hi or v < lo or (lo_open and v == lo):
            _fail(what, name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]", v)
        return float(v)

    return check


def _int(lo: int = 0, hi: int | None = None):
    def check(v, what, name):
        if not _is_int(v) or v < lo or (hi is not None and v > hi):
            _fail(what, name, f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]", v)
        return v

    return check


def _bool(v, what, name):
    if not isinstance(v, bool):
        _fail(what, name, "a bool", v)
    return v


def _str(max_chars: int):
    def check(v, what, name):
        if not isinstance(v, str) or len(v) > max_chars:
            _fail(what, name, f"a string of at most {max_chars} characters", v)
        return v

    return check


def _strs(max_chars: int):
    def check(v, what, name):
        if not isinstance(v, list) or not all(isinstance(i, str) and len(i) <= max_chars for i in v):
            _fail(what, name, f"a list of strings of at most {max_chars} characters", v)
        return tuple(v)

    return check


def _ints(lo: int = 0):
    def check(v, what, name):
        if not isinstance(v, list) or not all(_is_int(i) and i >= lo for i in v):
            _fail(what, name, f"a list of ints >= {lo}", v)
        return tuple(v)

    return check


def _optional(check):
    def optional(v, what, name):
        return None if v is None else check(v, what, name)

    return optional


class Message:
    """Base of the meta records: `to_meta()` and a validating `from_meta()`.

    Subclasses are frozen dataclasses that name their wire `WHAT` (for error messages) and a
    checker per field in `FIELDS`; tuple fields travel as lists. Fields with defaults may be
    absent from the meta; unknown keys are refused.
    """

    WHAT: ClassVar[str] = "frame"
    FIELDS: ClassVar[dict[str, Any]] = {}

    def to_meta(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_meta(cls, meta: dict[str, Any], *, ignore: frozenset[str] = frozenset()):
        if not isinstance(meta, dict):
            raise BadFrameError(f"{cls.WHAT} meta must be a mapping")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(meta) - set(fields) - ignore
        if unknown:
            raise BadFrameError(f"{cls.WHAT} meta has unknown fields {sorted(unknown)}")
        values = {}
        for name, f in fields.items():
            if name not in meta:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise BadFrameError(f"{cls.WHAT} meta lacks {name!r}")
                continue
            values[name] = cls.FIELDS[name](meta[name], cls.WHAT, name)
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Readiness(Message):
    """How busy a stage replica is; rides on every result and pong (short keys) and in the DHT."""

    WHAT = "readiness"
    FIELDS = {"r_backlog": _float(0, 1e9), "r_service": _float(0, 1e9), "r_queue": _int()}
    r_backlog: float = 0.0
    """Seconds of compute queued at the replica."""
    r_service: float = 0.0
    """Its compute seconds per microbatch (0: not measured yet)."""
    r_queue: int = 0
    """Tasks queued or running."""

    @classmethod
    def of(cls, ready: dict) -> Readiness:
        """From `ComputeScheduler.readiness()`."""
        return cls(r_backlog=ready["backlog_s"], r_service=ready["service_s"], r_queue=ready["queue_depth"])


NO_PREFERENCE = ""
"""In a route preference: any replica of that stage will do."""


@dataclass(frozen=True, kw_only=True)
class ForwardMeta(Message):
    """A microbatch on its way forward: what each stage needs to serve and pass it on."""

    WHAT = "forward"
    FIELDS = {
        "loss_scale": _float(0, 1, lo_open=True),
        "budget_s": _float(0, 1e6, lo_open=True),
        "order": _int(),
        "replay": _bool,
        "prefer": _strs(MAX_PEER_ID_CHARS),
        "needed_by": _ints(),
        "slots": _ints(),
        "slot_counts": _ints(1),
        # A step's microbatch ids travel in one meta list (the commit's), so it has no more;
        # each stage counts through them when it is given them.
        "microbatches": _optional(_int(1, MAX_META_LIST)),
    }
    loss_scale: float
    """Factor on the loss (1 / microbatches in the step), so the gradient sum is the step's mean."""
    budget_s: float
    """Seconds left for the whole trip from this stage on and back."""
    order: int = 0
    """The microbatch's index in its step: the 1F1B priority hint."""
    replay: bool = False
    """Sent again after a failure: replicas keep its gradient apart until the commit decides."""
    prefer: tuple[str, ...] = ()
    """Per stage, the replica that already holds this microbatch's work (NO_PREFERENCE: any)."""
    needed_by: tuple[int, ...] = ()
    """Stages that lost this microbatch with a dead replica: they must recompute, not answer
    from a kept input gradient."""
    slots: tuple[int, ...] = ()
    """Static schedule: per stage, the replica index this microbatch goes to..."""
    slot_counts: tuple[int, ...] = ()
    """...out of this many replicas (see `swarmtrain.schedule.static`)."""
    microbatches: int | None = None
    """Static schedule: microbatches in the step."""

    def __post_init__(self):
        if len(self.slots) != len(self.slot_counts) or any(
            j >= r for j, r in zip(self.slots, self.slot_counts)
        ):
            raise BadFrameError(
                f"forward meta slots {list(self.slots)} must name one replica index below each of "
                f"slot_counts {list(self.slot_counts)}"
            )
        if self.slots and self.microbatches is None:
            raise BadFrameError("forward meta with slots needs microbatches")

    def preferred(self, stage: int) -> str | None:
        """The replica of `stage` this microbatch should go to, if any."""
        if stage < len(self.prefer) and self.prefer[stage] != NO_PREFERENCE:
            return self.prefer[stage]
        return None


@dataclass(frozen=True, kw_only=True)
class ResultMeta(Readiness):
    """The reply to a forward: the loss came back (and, but at stage 0, the input gradient),
    with the replying replica's readiness."""

    WHAT = "result"
    FIELDS = {
        "loss": _float(-math.inf, math.inf),
        "route": _strs(MAX_PEER_ID_CHARS),
        "replays": _int(),
        "service_s": _float(0, 1e9),
        **Readiness.FIELDS,
    }
    loss: float
    """The microbatch's loss (unscaled)."""
    route: tuple[str, ...]
    """The replicas that served it, from the replying stage to the last."""
    replays: int = 0
    """Hops replayed on the way (by the stages from here on)."""
    service_s: float = 0.0
    """Seconds the replying stage spent on it, waiting included."""


class CommitPhase(StrEnum):
    """The trainer drives a step's commit through these (`swarmtrain.train.commit`)."""

    PREPARE = "prepare"
    EXCHANGE = "exchange"
    APPLY = "apply"
    ABORT = "abort"
    ROLLBACK = "rollback"


@dataclass(frozen=True, kw_only=True)
class CommitRequest(Message):
    """A 'step' frame: one phase of the commit."""

    WHAT = "commit"
    PHASE: ClassVar[CommitPhase]

    def to_meta(self) -> dict[str, Any]:
        return {"phase": self.PHASE.value, **super().to_meta()}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], *, ignore: frozenset[str] = frozenset()):
        if isinstance(meta, dict) and meta.get("phase") != cls.PHASE.value:
            raise BadFrameError(
                f"{cls.WHAT} meta must have phase {cls.PHASE.value!r}, got {meta.get('phase')!r}"
            )
        return super().from_meta(meta, ignore=ignore | {"phase"})

    @staticmethod
    def parse(meta: dict[str, Any]) -> CommitRequest:
        """The typed request of a 'step' frame's meta; BadFrameError for an unknown phase."""
        phase = meta.get("phase") if isinstance(meta, dict) else None
        kinds = {k.PHASE.value: k for k in (Prepare, Exchange, Apply, Abort, Rollback)}
        if not isinstance(phase, str) or phase not in kinds:  # a list here is unhashable
            raise BadFrameError(f"unknown commit phase {phase!r} (known: {', '.join(kinds)})")
        return kinds[phase].from_meta(meta)


@dataclass(frozen=True, kw_only=True)
class Prepare(CommitRequest):
    """Report what this step's gradient buffers hold, and accept gradients again."""

    PHASE = CommitPhase.PREPARE
    WHAT = "prepare"


@dataclass(frozen=True, kw_only=True)
class Prepared(Message):
    """A replica's answer to prepare."""

    WHAT = "prepared"
    FIELDS = {"fresh": _strs(MAX_MB_ID_CHARS), "held": _strs(MAX_MB_ID_CHARS)}
    fresh: tuple[str, ...] = ()
    """Microbatches whose gradients are in its buffer."""
    held: tuple[str, ...] = ()
    """Replayed microbatches whose gradients it keeps apart."""


@dataclass(frozen=True, kw_only=True)
class Exchange(CommitRequest):
    """Close the step: check the buffer, fold in held copies, swap gradient sums in the group."""

    PHASE = CommitPhase.EXCHANGE
    WHAT = "exchange"
    FIELDS = {
        "fresh": _strs(MAX_MB_ID_CHARS),
        "take": _strs(MAX_MB_ID_CHARS),
        "group": _strs(MAX_PEER_ID_CHARS),
        "attempt": _int(),
    }
    fresh: tuple[str, ...]
    """What the replica's buffer must still hold exactly (as it reported)."""
    take: tuple[str, ...]
    """Held microbatches to fold into its buffer (the others are discarded)."""
    group: tuple[str, ...]
    """Every replica of the stage in this commit, this one included."""
    attempt: int = 0
    """The commit round: gradients of an earlier round are never mixed in."""


@dataclass(frozen=True, kw_only=True)
class Exchanged(Message):
    """A replica's answer to exchange: the size of the gradient total its group will apply."""

    WHAT = "exchanged"
    FIELDS = {"grad_sq_norm": _optional(_float(0, math.inf))}
    grad_sq_norm: float | None = None
    """The squared L2 norm of the group's gradient total (every replica of a stage holds the
    same total): the trainer adds one per stage into the whole model's gradient norm, for
    clipping. None: the replica did not say."""


@dataclass(frozen=True, kw_only=True)
class Apply(CommitRequest):
    """Every stage exchanged: write the group's total and step the optimizer."""

    PHASE = CommitPhase.APPLY
    WHAT = "apply"
    FIELDS = {"grad_scale": _float(0, 1e3, lo_open=True), "digest": _bool}
    grad_scale: float = 1.0
    """Factor on the summed gradients, the same for every stage: microbatches issued / completed
    (when some were dropped) times the clip coefficient of the whole model's gradient norm
    (`swarmtrain.train.optim.clip_coefficient`, 1 without clipping)."""
    digest: bool = False
    """Reply with a hash of the parameters after the step."""


@dataclass(frozen=True, kw_only=True)
class Applied(Message):
    WHAT = "applied"
    FIELDS = {"digest": _optional(_str(128))}
    digest: str | None = None


@dataclass(frozen=True, kw_only=True)
class Abort(CommitRequest):
    """Discard this step's gradients (the stage's buffers cannot be made exact)."""

    PHASE = CommitPhase.ABORT
    WHAT = "abort"


@dataclass(frozen=True, kw_only=True)
class Rollback(CommitRequest):
    """Take the state of checkpoint step `checkpoint` (held here, or from one of `sources`), and
    go on from it as the frame's step: a stage lost its last replica and came back from that
    checkpoint, so every stage goes back with it. Step numbers never go back (a replica that
    missed the rollback is behind, and catches up from one that did not)."""

    PHASE = CommitPhase.ROLLBACK
    WHAT = "rollback"
    FIELDS = {"checkpoint": _int(), "sources": _strs(128)}
    checkpoint: int
    sources: tuple[str, ...] = ()
    """Peers that hold this stage's checkpoint of step `checkpoint`."""


@dataclass(frozen=True, kw_only=True)
class StateRequest(Message):
    """A request for a replica's state: its live state, or the checkpoint of step `checkpoint`."""

    WHAT = "state request"
    FIELDS = {"checkpoint": _optional(_int())}
    checkpoint: int | None = None


@dataclass(frozen=True, kw_only=True)
class GradsMeta(Message):
    """A replica's gradient sum for its group, tensors named '0'..'N-1' in parameter order."""

    WHAT = "grads"
    FIELDS = {"attempt": _int()}
    attempt: int = 0


@dataclass(frozen=True, kw_only=True)
class PongMeta(Readiness):
    """The reply to a ping: the replica's state, counters and readiness."""

    WHAT = "pong"
    FIELDS = {
        "state": _str(16),
        "served": _int(),
        "failed": _int(),
        "in_flight": _int(),
        **Readiness.FIELDS,
    }
    state: str
    served: int = 0
    failed: int = 0
    in_flight: int = 0


__all__ = [
    "Abort",
    "Applied",
    "Apply",
    "CommitPhase",
    "CommitRequest",
    "Exchange",
    "Exchanged",
    "ForwardMeta",
    "GradsMeta",
    "Message",
    "NO_PREFERENCE",
    "PongMeta",
    "Prepare",
    "Prepared",
    "Readiness",
    "ResultMeta",
    "Rollback",
    "StateRequest",
]
