"""The commit phases: what a committing trainer asks of a stage replica, and its answers.

| request (a 'step' frame) | reply ('step_done')   | see                              |
|--------------------------|-----------------------|----------------------------------|
| Claim, Status            | StepStatus            | `swarmtrain.train.commit` claims |
| Prepare                  | Prepared              |                                  |
| Exchange                 | Exchanged             |                                  |
| Apply                    | Applied               |                                  |
| Abort, Rollback          | (none)                |                                  |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from swarmtrain.errors import BadFrameError
from swarmtrain.wire.meta import (
    MAX_MB_ID_CHARS,
    MAX_PEER_ID_CHARS,
    Message,
    _bool,
    _float,
    _int,
    _optional,
    _str,
    _strs,
)


class CommitPhase(StrEnum):
    """The trainer drives a step's commit through these (`swarmtrain.train.commit`)."""

    PREPARE = "prepare"
    EXCHANGE = "exchange"
    APPLY = "apply"
    ABORT = "abort"
    ROLLBACK = "rollback"
    RELAYOUT = "relayout"
    CLAIM = "claim"
    STATUS = "status"


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
        kinds = {
            k.PHASE.value: k for k in (Prepare, Exchange, Apply, Abort, Rollback, Relayout, Claim, Status)
        }
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
class Relayout(CommitRequest):
    """Move to layout version `layout` of the run's manifest at the frame's step, between two
    steps: take the stage the layout gives this peer, its blocks' state by name from the
    holders of the previous layout, and answer once it serves it (`swarmtrain.train.relayout`)."""

    PHASE = CommitPhase.RELAYOUT
    WHAT = "relayout"
    FIELDS = {"layout": _int()}
    layout: int


@dataclass(frozen=True, kw_only=True)
class Claim(CommitRequest):
    """Take (or keep) the commit of the replica's step for the caller; the reply is the
    replica's StepStatus, whose `committer` says who holds the claim now."""

    PHASE = CommitPhase.CLAIM
    WHAT = "claim"
    FIELDS = {"replaces": _strs(MAX_PEER_ID_CHARS)}
    replaces: tuple[str, ...] = ()
    """Trainers the caller found gone: a claim one of them holds passes to the caller."""


@dataclass(frozen=True, kw_only=True)
class Status(CommitRequest):
    """Report the replica's StepStatus and change nothing."""

    PHASE = CommitPhase.STATUS
    WHAT = "status"


@dataclass(frozen=True, kw_only=True)
class StepStatus(Message):
    """Where a replica is in the commit of its step (the reply's frame step) and of the last one."""

    WHAT = "step status"
    FIELDS = {
        "committer": _str(MAX_PEER_ID_CHARS),
        "exchanged": _bool,
        "next_attempt": _int(),
        "applied_step": _optional(_int()),
        "applied_scale": _optional(_float(0, 1e3, lo_open=True)),
        "counted": _strs(MAX_MB_ID_CHARS),
    }
    committer: str = ""
    """The trainer that holds the claim on this step's commit ('' none)."""
    exchanged: bool = False
    """Its group's gradient total of this step is kept, ready to apply."""
    next_attempt: int = 0
    """Exchange rounds of this step must number their attempts from here on (earlier numbers
    may have gradients of an earlier committer waiting in an inbox)."""
    applied_step: int | None = None
    """The last step this replica applied, None if none since it took its state."""
    applied_scale: float | None = None
    """The grad_scale that step was applied with: a committer that finds a step applied on some
    replicas only (its committer died mid-apply) applies it on the others with the same one."""
    counted: tuple[str, ...] = ()
    """The microbatches that step counted (the same in every replica of every stage)."""
