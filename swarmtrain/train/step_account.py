"""What a step counted, for every trainer that fed it (pure).

A step has `total` positions (the run's microbatches per step), each fed by the trainer whose
shard holds it. Each trainer's part is a `Share`: its own, or a feeder's report to the
committer. Once the step is applied, `account` says for every position whether it counted
(exactly once in every stage) or was dropped, and why:
- dropped by its trainer (refused by a stage, say), with the cause it reported;
- LEFT: its trainer left before the step counted it (a microbatch of a trainer that left
  counts only when every stage holds it: `schedule.accounting.orphans`);
- NOT_COUNTED: the step was committed without it (its report came too late);
- NOT_FED: no live trainer fed it (its shard's trainer is not running, or left before the
  microbatch reached a stage).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from swarmtrain.wire.team_messages import Work

NOT_FED = "no live trainer fed it"
LEFT = "its trainer left before the step counted it"
NOT_COUNTED = "the step was committed without it"


def position_of(mb: str) -> int:
    """The position in its step of microbatch `mb` (`authority.microbatch_id`'s last part)."""
    return int(mb.rsplit(":", 1)[-1])


@dataclass(kw_only=True)
class Share:
    """One trainer's part of a step, as the committer knows it (its own, or a feeder's report)."""

    trainer: str
    issued: tuple[str, ...]
    losses: dict[str, float] = field(default_factory=dict)
    """Completed microbatches and their losses."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Dropped microbatches and why."""
    samples: int = 0
    tokens: int = 0
    replays: int = 0
    work: Work = field(default_factory=dict)
    """Per stage, microbatches each replica completed for it."""


def merge_work(works: Iterable[Work]) -> Work:
    out: Work = {}
    for work in works:
        for k, peers in work.items():
            for p, n in peers.items():
                out.setdefault(k, {})[p] = out.get(k, {}).get(p, 0) + n
    return out


@dataclass(frozen=True, kw_only=True)
class Committed:
    """What a step's commit counted and how it went (a feeder learns it in its outcome)."""

    step: int
    counted: frozenset[str]
    """Every microbatch the step counted, exactly once in every stage."""
    adopted: int = 0
    """Of them, orphans: their trainer left; counted from the replicas' buffers, no loss known."""
    loss: float = math.nan
    """The mean loss of the counted microbatches whose loss is known (NaN when none is)."""
    dropped_causes: dict[str, int] = field(default_factory=dict)
    """Positions of the step left out, by cause (counted + dropped = the step's microbatches)."""
    samples: int = 0
    tokens: int = 0
    work: Work = field(default_factory=dict)
    grad_norm: float | None = None
    replicas_equal: bool | None = None
    compared: dict[int, int] = field(default_factory=dict)
    applied_by: tuple[str, ...] = ()
    """The replicas that applied the step."""
    replays: int = 0
    """Replays by every trainer whose share is known."""

    @property
    def dropped(self) -> int:
        return sum(self.dropped_causes.values())


def account(
    *,
    step: int,
    total: int,
    counted: frozenset[str],
    shares: Iterable[Share],
    gone: frozenset[str] = frozenset(),
    adopted: frozenset[str] = frozenset(),
    stranded: frozenset[str] = frozenset(),
    **summary,
) -> Committed:
    """The step's account (see the module docstring): `shares` of the trainers known, `gone`
    the trainers that left, `adopted` and `stranded` the orphans that counted and that some
    stage lacked; `summary` the rest of Committed's fields (grad_norm, replicas_equal, ...)."""
    shares = list(shares)
    causes: Counter = Counter()
    positions = {position_of(mb) for mb in counted}
    left = [(mb, LEFT) for mb in sorted(stranded)]
    for s in shares:
        left += [(mb, s.dropped.get(mb) or (LEFT if s.trainer in gone else NOT_COUNTED)) for mb in s.issued]
    for mb, cause in left:
        if mb not in counted and position_of(mb) not in positions:
            positions.add(position_of(mb))
            causes[cause] += 1
    causes[NOT_FED] += total - len(positions)
    losses = [loss for s in shares for mb, loss in s.losses.items() if mb in counted]
    return Committed(
        step=step,
        counted=counted,
        adopted=len(adopted & counted),
        loss=sum(losses) / len(losses) if losses else math.nan,
        dropped_causes={c: n for c, n in causes.items() if n > 0},
        samples=sum(s.samples for s in shares),
        tokens=sum(s.tokens for s in shares),
        work=merge_work(s.work for s in shares),
        replays=sum(s.replays for s in shares),
        **summary,
    )
