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
|                     | (a score pass: tensor 'scores')     |                        |
| step                | a commit phase (`commit_messages`)  | trainer -> stage       |
| step_done           | its answer (`commit_messages`)      | reply to step          |
| report              | StepReport (`team_messages`)        | trainer -> trainer     |
| outcome             | StepOutcome (`team_messages`)       | reply to report        |
| grads               | GradsMeta                           | replica -> replica     |
| weights             | WeightsRequest                      | any peer -> stage      |
| weights_data        | (none: tensors '0'..'N-1')          | reply to weights       |
| pong                | PongMeta                            | reply to ping          |
| error               | see `frames.error_frame` (cause)    | any reply              |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarmtrain.errors import BadFrameError
from swarmtrain.wire.commit_messages import (
    Abort,
    Applied,
    Apply,
    Claim,
    CommitPhase,
    CommitRequest,
    Exchange,
    Exchanged,
    Prepare,
    Prepared,
    Relayout,
    Rollback,
    Status,
    StepStatus,
)
from swarmtrain.wire.frames import MAX_TENSORS
from swarmtrain.wire.meta import (
    MAX_META_LIST,
    MAX_PEER_ID_CHARS,
    Message,
    _bool,
    _float,
    _int,
    _ints,
    _optional,
    _str,
    _strs,
)


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


MEMBER_PROOF = "member"
"""Meta key beside ForwardMeta's fields: the sending replica's signed peer record
(`trust.records.member_proof`), for a receiver whose view of the run lacks it."""


@dataclass(frozen=True, kw_only=True)
class ForwardMeta(Message):
    """A microbatch on its way forward: what each stage needs to serve and pass it on."""

    WHAT = "forward"
    FIELDS = {
        "loss_scale": _float(0, 1, lo_open=True),
        "budget_s": _float(0, 1e6, lo_open=True),
        "order": _int(),
        "replay": _bool,
        "score": _bool,
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
    score: bool = False
    """A score pass, not training: every stage runs it forward only (no gradient, nothing kept,
    not counted in any step) on the parameters of exactly this frame's step, and the last stage
    answers with the loss's per-sample scores (tensor 'scores', `Loss.score`) instead of a
    gradient (`swarmtrain.train.scoring`)."""
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
        if self.score and (self.slots or self.needed_by):
            raise BadFrameError("a score pass takes no static slots and no repair (needed_by)")

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
    """The microbatch's loss (unscaled; for a score pass, the loss it has at that step)."""
    route: tuple[str, ...]
    """The replicas that served it, from the replying stage to the last."""
    replays: int = 0
    """Hops replayed on the way (by the stages from here on)."""
    service_s: float = 0.0
    """Seconds the replying stage spent on it, waiting included."""


@dataclass(frozen=True, kw_only=True)
class StateRequest(Message):
    """A request for a replica's state: its live state, or the checkpoint of step `checkpoint`;
    with `layout`, its stage's state in that layout version by swarm name (parameters and
    optimizer state: `StageRunner.export_named_state`), for a layout move."""

    WHAT = "state request"
    FIELDS = {"checkpoint": _optional(_int()), "layout": _optional(_int())}
    checkpoint: int | None = None
    layout: int | None = None


MAX_PARAM_NAME_CHARS = 256
"""Longest parameter name a weights request may name."""
MAX_CODEC_NAME_CHARS = 16


@dataclass(frozen=True, kw_only=True)
class WeightsRequest(Message):
    """A request for some of a stage's parameters at one policy version
    (`swarmtrain.train.versions`): each piece is parameter `names[i]`, rows (dim 0)
    `starts[i]` to `ends[i]` (exclusive; a 0-d parameter is one row), sent with `codec`. The
    reply ('weights_data', its step the version) holds piece i as tensor 'i'."""

    WHAT = "weights request"
    FIELDS = {
        "version": _int(),
        "codec": _str(MAX_CODEC_NAME_CHARS),
        "names": _strs(MAX_PARAM_NAME_CHARS),
        "starts": _ints(),
        "ends": _ints(1),
    }
    version: int
    """The policy version: the parameters after the run applied steps 0..version-1."""
    codec: str = "none"
    """How the pieces travel: 'none' (exact) or a registered codec ('bf16', 'int8', ...)."""
    names: tuple[str, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def __post_init__(self):
        n = len(self.names)
        if not 0 < n <= MAX_TENSORS or len(self.starts) != n or len(self.ends) != n:
            raise BadFrameError(
                f"weights request must name 1..{MAX_TENSORS} pieces with a start and an end each, got "
                f"{n} names, {len(self.starts)} starts, {len(self.ends)} ends"
            )
        if any(s >= e for s, e in zip(self.starts, self.ends)):
            raise BadFrameError("weights request pieces must each start before they end")

    def pieces(self) -> list[tuple[str, int, int]]:
        """(parameter name, first row, row past the last) of every piece, in order."""
        return list(zip(self.names, self.starts, self.ends))


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
    "Claim",
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
    "Relayout",
    "Rollback",
    "StateRequest",
    "Status",
    "StepStatus",
    "WeightsRequest",
]
