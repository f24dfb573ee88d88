"""Trainer to trainer: a feeder's report of its share of a step, and the committer's answer.

| request ('report' frame) | reply ('outcome' frame) | see                    |
|--------------------------|-------------------------|------------------------|
| StepReport               | StepOutcome             | `swarmtrain.train.team`|

Lists that belong together travel as parallel lists of scalars (a frame's meta holds no
nested values); each record checks that their lengths agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from swarmtrain.errors import BadFrameError
from swarmtrain.wire.meta import (
    MAX_MB_ID_CHARS,
    MAX_PEER_ID_CHARS,
    Message,
    _bool,
    _float,
    _floats,
    _int,
    _ints,
    _optional,
    _str,
    _strs,
)

MAX_CAUSE_CHARS = 512

Work = dict[int, dict[str, int]]
"""Per stage, microbatches each replica (peer id) completed."""


def work_lists(work: Work) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
    """`work` as parallel lists (stage, peer, count), for a frame's meta."""
    rows = [(k, p, n) for k, peers in sorted(work.items()) for p, n in sorted(peers.items())]
    return tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows)


def work_of(stages: tuple[int, ...], peers: tuple[str, ...], counts: tuple[int, ...]) -> Work:
    work: Work = {}
    for k, p, n in zip(stages, peers, counts):
        work.setdefault(k, {})[p] = work.get(k, {}).get(p, 0) + n
    return work


def _same_lengths(what: str, **lists) -> None:
    lengths = {name: len(v) for name, v in lists.items()}
    if len(set(lengths.values())) > 1:
        raise BadFrameError(f"{what} meta lists must be of one length, got {lengths}")


@dataclass(frozen=True, kw_only=True)
class StepReport(Message):
    """A feeder's share of a step, once every microbatch of it completed or was dropped."""

    WHAT = "step report"
    FIELDS = {
        "shard": _int(),
        "shards": _int(1),
        "issued": _strs(MAX_MB_ID_CHARS),
        "completed": _strs(MAX_MB_ID_CHARS),
        "losses": _floats(-math.inf, math.inf),
        "dropped": _strs(MAX_MB_ID_CHARS),
        "causes": _strs(MAX_CAUSE_CHARS),
        "samples": _int(),
        "tokens": _int(),
        "replays": _int(),
        "work_stages": _ints(),
        "work_peers": _strs(MAX_PEER_ID_CHARS),
        "work_counts": _ints(),
    }
    shard: int
    shards: int
    """The feeder's shard (`shards.Shard`): the committer refuses shards that overlap."""
    issued: tuple[str, ...]
    """Its microbatch ids of the step."""
    completed: tuple[str, ...] = ()
    losses: tuple[float, ...] = ()
    """The loss of each completed microbatch, in order."""
    dropped: tuple[str, ...] = ()
    causes: tuple[str, ...] = ()
    """Why each dropped microbatch was dropped, in order."""
    samples: int = 0
    tokens: int = 0
    """Of its completed microbatches."""
    replays: int = 0
    work_stages: tuple[int, ...] = ()
    work_peers: tuple[str, ...] = ()
    work_counts: tuple[int, ...] = ()
    """`work_lists` of the replicas its completed microbatches went through."""

    def __post_init__(self):
        _same_lengths(self.WHAT, completed=self.completed, losses=self.losses)
        _same_lengths(self.WHAT, dropped=self.dropped, causes=self.causes)
        _same_lengths(self.WHAT, work_stages=self.work_stages, peers=self.work_peers, counts=self.work_counts)
        if not 0 <= self.shard < self.shards:
            raise BadFrameError(f"step report shard {self.shard}/{self.shards} is not a shard")


class OutcomeKind(StrEnum):
    PENDING = "pending"
    """Not decided yet: report again."""
    REPLAY = "replay"
    """Replay these microbatches of yours (a replica died with them), then report again."""
    ELSEWHERE = "elsewhere"
    """This trainer does not commit the step: `committer` does, as far as it knows."""
    COMMITTED = "committed"
    """The step was applied: which of your microbatches it counted, and the step's summary."""


@dataclass(frozen=True, kw_only=True)
class StepOutcome(Message):
    """The committer's answer to a report (see OutcomeKind); the frame's step is the step's."""

    WHAT = "step outcome"
    FIELDS = {
        "kind": _str(16),
        "committer": _str(MAX_PEER_ID_CHARS),
        "replay": _strs(MAX_MB_ID_CHARS),
        "prefer": _strs(MAX_PEER_ID_CHARS),
        "needed_by": _ints(),
        "counted": _strs(MAX_MB_ID_CHARS),
        "loss": _optional(_float(-math.inf, math.inf)),
        "completed": _int(),
        "adopted": _int(),
        "causes": _strs(MAX_CAUSE_CHARS),
        "cause_counts": _ints(1),
        "samples": _int(),
        "tokens": _int(),
        "grad_norm": _optional(_float(0, math.inf)),
        "replicas_equal": _optional(_bool),
        "compared": _ints(),
        "applied_by": _strs(MAX_PEER_ID_CHARS),
        "work_stages": _ints(),
        "work_peers": _strs(MAX_PEER_ID_CHARS),
        "work_counts": _ints(),
    }
    kind: str
    committer: str = ""
    """ELSEWHERE: the trainer that commits the step ('' if unknown)."""
    replay: tuple[str, ...] = ()
    """REPLAY: the microbatches to replay..."""
    prefer: tuple[str, ...] = ()
    """...per microbatch, per stage (len(replay) x stages, row after row), the replica that holds
    its work already (NO_PREFERENCE: any)..."""
    needed_by: tuple[int, ...] = ()
    """...and per microbatch, the stages that lack it, as bits (stage k: 1 << k)."""
    counted: tuple[str, ...] = ()
    """COMMITTED: the reporter's microbatches the step counted; the others it dropped."""
    loss: float | None = None
    """COMMITTED, the step's summary: the mean loss of its microbatches whose loss is known
    (None: none is)..."""
    completed: int = 0
    """...microbatches counted, of which `adopted` (their trainer left: counted from the
    replicas' buffers, with no loss known)..."""
    adopted: int = 0
    causes: tuple[str, ...] = ()
    cause_counts: tuple[int, ...] = ()
    """...microbatches dropped, by cause..."""
    samples: int = 0
    tokens: int = 0
    grad_norm: float | None = None
    replicas_equal: bool | None = None
    compared: tuple[int, ...] = ()
    """...replicas whose digests were compared, per stage."""
    applied_by: tuple[str, ...] = ()
    """The replicas that applied the step (they serve the next)."""
    work_stages: tuple[int, ...] = ()
    work_peers: tuple[str, ...] = ()
    work_counts: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in set(OutcomeKind):
            raise BadFrameError(f"step outcome kind {self.kind!r} is not one of {', '.join(OutcomeKind)}")
        _same_lengths(self.WHAT, replay=self.replay, needed_by=self.needed_by)
        if self.replay and len(self.prefer) % len(self.replay):
            raise BadFrameError("step outcome prefer must name one replica per stage for each replay")
        _same_lengths(self.WHAT, causes=self.causes, cause_counts=self.cause_counts)
        _same_lengths(self.WHAT, work_stages=self.work_stages, peers=self.work_peers, counts=self.work_counts)
