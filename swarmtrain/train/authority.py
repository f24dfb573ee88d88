"""Who may ask a stage replica for what, and which step a lagging replica may catch up to.

Requests a replica of stage k serves, and whom from (`refusal`, the pure rule):
- 'ping': anyone.
- 'step' (the commit phases): a trainer the run's owner authorized (`RunManifest.trainers`).
- 'forward', at stage 0: an authorized trainer, and only under its own microbatch ids
  (`microbatch_id` puts the trainer's full peer id in each); at stage k > 0: a replica of
  stage k - 1, for a microbatch of an authorized trainer.
- 'grads': a replica of stage k and, once this replica's exchange named its group, a member
  of that group.
- 'state' (all parameters and optimizer state): a member of stage k (joining or serving),
  or an authorized trainer (it checks what it trained).
- 'weights' (the parameters at a policy version, for rollout peers): anyone, unless the
  manifest lists its weight readers (`RunManifest.weight_readers`); then those, a member of
  stage k, an authorized trainer or the owner. Open by default because a run's weights are
  no secret from whoever reaches its swarm (anyone may join an open swarm as a replica, any
  key holder a private one), and rollout peers come and go too often for the owner to sign a
  manifest for each.
A run whose manifest lists no trainers is open: every peer counts as an authorized trainer,
and only the membership rules hold.

Membership is the run's announced peer records, as this replica last read them. A replica
that joined a heartbeat ago may not be in that view yet, so a refusal that membership
decides is decided again after one refresh of the view (`RunAuthority.check`, at most one
refresh per `refresh_interval_s`). One refresh is not always enough: over a congested link a
DHT read's replies wait behind the frames and it returns what it has, which can still lack a
peer that joined. So a caller that only membership refuses is refused without a strike, and
may ask again, for `unknown_grace_s` after its first such refusal; past that, each one is a
strike (`Refusal.pending`). A replica forwarding a microbatch carries its own signed peer
record with it (`ForwardMeta`'s companion key MEMBER_PROOF), the very record the DHT would
hold, so that a receiver whose view lacks it learns it from the frame (`RunAuthority.prove`).

Resync: a peer record's step is the peer's own claim. A lagging replica catches up only to
a step some authorized trainer committed (`committed_step`, `resync_sources`), and a joining
one tries such replicas first (`join_sources`): a forged high step draws nobody to the forger.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.errors import ConfigError
from swarmtrain.wire.metrics import TrainerPoint
from swarmtrain.wire.records import PeerRecord

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 1.0
"""Least time between two reads of the membership on behalf of refused requests."""
REFRESH_TIMEOUT_S = 5.0
"""Longest wait for one such read: a refused request waits for it."""
UNKNOWN_PEER_GRACE_S = 30.0
"""How long after its first refusal a caller that only the membership refuses is refused
without a strike (see the module docstring): several heartbeats and refreshes."""
MAX_UNKNOWN_PEERS = 4096
"""Callers whose first membership refusal is remembered; the oldest are forgotten past this."""


def microbatch_id(trainer: str, step: int, epoch: int, n: int) -> str:
    """The id of microbatch `n` of `trainer`'s `step` (`epoch` tells a retried step's apart).
    `trainer` is the trainer's full peer id: a stage checks it against the caller."""
    return f"{trainer}:{step}.{epoch}:{n}"


def trainer_of(mb_id: str) -> str | None:
    """The trainer a microbatch id names, None if it is not an id `microbatch_id` makes."""
    parts = mb_id.rsplit(":", 2)
    return parts[0] if len(parts) == 3 and parts[0] else None


def _short(peer: str) -> str:
    return peer if len(peer) <= 12 else f"…{peer[-8:]}"


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: what the caller lacks."""

    reason: str
    membership: bool
    """The run's membership decided it: a fresher view of it may decide otherwise."""
    pending: bool = False
    """Membership decided it within `unknown_grace_s` of the caller's first such refusal: the
    caller may be a peer our view lacks yet, so it is no strike and the caller may ask again."""


def refusal(
    kind: str,
    caller: str,
    *,
    stage: int,
    mb_id: str = "",
    trainers: Collection[str] | None,
    stage_of: Callable[[str], int | None],
    group: Collection[str] | None = None,
    owner: str | None = None,
    weight_readers: Collection[str] | None = None,
) -> Refusal | None:
    """Whether a replica of `stage` refuses a `kind` request from `caller` (see the module
    docstring); None: it may serve it. `trainers` is the run's authorized trainers (None: an
    open run), `stage_of(peer)` the stage a peer is a member of (None: not a member), `group`
    the exchange group a 'grads' request must come from, None while no exchange named one,
    `owner` the run's owner (who may read any stage's state, to archive it), `weight_readers`
    the peers the run lets fetch its weights (None: anyone)."""
    who = f"peer {_short(caller)}"

    def authorized(peer: str) -> bool:
        return trainers is None or peer in trainers

    not_trainer = f"{who} is not a trainer this run's owner authorized"
    if kind == "step" and not authorized(caller):
        return Refusal(f"{not_trainer}: only they may send commit phases", membership=False)
    if kind == "forward" and stage == 0:
        if not authorized(caller):
            return Refusal(f"{not_trainer}: only they may send microbatches into stage 0", membership=False)
        owner = trainer_of(mb_id)
        if owner != caller:
            named = "names no trainer" if owner is None else f"belongs to trainer {_short(owner)}"
            return Refusal(
                f"microbatch {mb_id!r} {named}, not to {who}: a trainer sends only its own microbatches",
                membership=False,
            )
    if kind == "forward" and stage > 0:
        if stage_of(caller) != stage - 1:
            return Refusal(
                f"{who} is not a replica of stage {stage - 1}: only they send microbatches on to stage {stage}",
                membership=True,
            )
        owner = trainer_of(mb_id)
        if owner is None or not authorized(owner):
            return Refusal(
                f"microbatch {mb_id!r} is not one of a trainer this run's owner authorized", membership=False
            )
    if kind == "grads":
        if stage_of(caller) != stage:
            return Refusal(
                f"{who} is not a replica of stage {stage}: only its replicas exchange gradients",
                membership=True,
            )
        if group is not None and caller not in group:
            return Refusal(f"{who} is not in stage {stage}'s exchange group", membership=False)
    if kind == "state" and stage_of(caller) != stage and not authorized(caller) and caller != owner:
        return Refusal(
            f"{who} is neither a member of stage {stage} nor a trainer this run's owner authorized: "
            "only they may download its state",
            membership=True,
        )
    if (
        kind == "weights"
        and weight_readers is not None
        and caller not in weight_readers
        and stage_of(caller) != stage
        and not authorized(caller)
        and caller != owner
    ):
        return Refusal(
            f"{who} is not among the weight readers this run's owner lists, nor a member of stage "
            f"{stage} or an authorized trainer: only they may fetch its weights",
            membership=True,
        )
    return None


@dataclass(kw_only=True)
class RunAuthority:
    """A replica's view of who the run authorizes (see the module docstring)."""

    trainers: Callable[[], Collection[str] | None]
    """The peer ids of the trainers the run's owner authorizes; None: an open run (any peer)."""
    stage_of: Callable[[str], int | None]
    """The stage a peer is a member of (serving, joining or draining), None if it is none."""
    refresh: Callable[[], Awaitable[None]]
    """Read the run's membership again (what `stage_of` answers from)."""
    owner: Callable[[], str | None] = lambda: None
    """The run's owner: it may read any stage's state (the archivist)."""
    weight_readers: Callable[[], Collection[str] | None] = lambda: None
    """The peers the run lets fetch its weights by version; None: anyone (`RunManifest.weight_readers`)."""
    refresh_interval_s: float = REFRESH_INTERVAL_S
    """Least time between two refreshes on behalf of refused requests."""
    prove: Callable[[str, Any], bool] = lambda caller, proof: False
    """Check a membership proof a request carries (the caller's own signed peer record) and, if
    it holds, take the record into the view `stage_of` answers from; True if it did."""
    unknown_grace_s: float = UNKNOWN_PEER_GRACE_S
    """How long after its first refusal a caller that only membership refuses is refused without
    a strike (0: from the first; for views that a refresh makes complete, as in-process)."""
    clock: Callable[[], float] = time.monotonic
    refreshes: int = field(default=0, init=False)
    """Refreshes done on behalf of refused requests."""
    _refreshed_at: float = field(default=-math.inf, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    _unknown_since: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self):
        if self.refresh_interval_s < 0:
            raise ConfigError(f"refresh_interval_s must be >= 0, got {self.refresh_interval_s}")
        if self.unknown_grace_s < 0:
            raise ConfigError(f"unknown_grace_s must be >= 0, got {self.unknown_grace_s}")

    def decide(
        self, kind: str, caller: str, *, stage: int, mb_id: str = "", group: Collection[str] | None = None
    ) -> Refusal | None:
        """`refusal` against the current view."""
        return refusal(
            kind,
            caller,
            stage=stage,
            mb_id=mb_id,
            trainers=self.trainers(),
            stage_of=self.stage_of,
            group=group,
            owner=self.owner(),
            weight_readers=self.weight_readers(),
        )

    async def check(
        self,
        kind: str,
        caller: str,
        *,
        stage: int,
        mb_id: str = "",
        group: Collection[str] | None = None,
        proof: Any = None,
    ) -> Refusal | None:
        """`decide`, and when membership refuses, `decide` again after taking in the caller's
        membership `proof` (its signed peer record, if the request carries one), else after
        refreshing the view (unless it was refreshed less than `refresh_interval_s` ago)."""
        refused = self.decide(kind, caller, stage=stage, mb_id=mb_id, group=group)
        if refused is not None and refused.membership and proof is not None and self.prove(caller, proof):
            refused = self.decide(kind, caller, stage=stage, mb_id=mb_id, group=group)
        if refused is not None and refused.membership and await self._refresh_once():
            refused = self.decide(kind, caller, stage=stage, mb_id=mb_id, group=group)
        if refused is None or not refused.membership:
            return refused
        now = self.clock()
        first = self._unknown_since.setdefault(caller, now)
        if len(self._unknown_since) > MAX_UNKNOWN_PEERS:
            del self._unknown_since[next(iter(self._unknown_since))]
        if now - first < self.unknown_grace_s:
            return dataclasses.replace(refused, pending=True)
        return refused

    async def _refresh_once(self) -> bool:
        """Refresh the view unless that was done less than `refresh_interval_s` ago; True if the
        view is newer than when this was asked (refreshed here or by a concurrent request)."""
        asked = self.clock()
        async with self._lock:
            if self._refreshed_at >= asked:
                return True
            if asked - self._refreshed_at < self.refresh_interval_s:
                return False
            try:
                await asyncio.wait_for(self.refresh(), REFRESH_TIMEOUT_S)
            except Exception as e:  # a DHT hiccup: decide on the view there is
                logger.warning("could not read the run's membership again: %r", e)
                return False
            finally:
                self._refreshed_at = self.clock()
            self.refreshes += 1
            return True


def committed_step(points: Iterable[TrainerPoint], trainers: Collection[str] | None) -> int | None:
    """The furthest step an authorized trainer (any trainer in an open run) reports it
    committed; None if none did."""
    steps = [p.step for p in points if trainers is None or p.trainer in trainers]
    return max(steps, default=None)


def claim_limit(committed: int | None) -> int:
    """The furthest step a replica can truly be at: one past the furthest committed step (a
    replica is at s + 1 once it applied step s); 0 when no step was committed."""
    return 0 if committed is None else committed + 1


def resync_sources(
    replicas: Iterable[tuple[str, int]], own_step: int, committed: int | None
) -> tuple[list[str], list[tuple[str, int]]]:
    """For a replica at `own_step`: (the replicas to catch up from, furthest first; the
    replicas claiming a step past it that no authorized trainer committed) among `replicas`
    (peer id, the step its record claims)."""
    limit = claim_limit(committed)
    ahead = sorted(((p, s) for p, s in replicas if s > own_step), key=lambda r: -r[1])
    return [p for p, s in ahead if s <= limit], [(p, s) for p, s in ahead if s > limit]


def join_sources(replicas: Iterable[tuple[str, int]], committed: int | None) -> list[str]:
    """For a joining replica: the replicas to take state from, in order: the furthest whose
    claimed step some authorized trainer committed first, then the others (furthest first)."""
    limit = claim_limit(committed)
    ordered = sorted(replicas, key=lambda r: (r[1] > limit, -r[1]))
    return [p for p, _ in ordered]


def read_points(raw: Iterable[Any]) -> list[TrainerPoint]:
    """The well-formed trainer points among `raw` (values off the DHT); the others are skipped."""
    points = []
    for value in raw:
        try:
            points.append(TrainerPoint.from_dict(value))
        except ConfigError as e:
            logger.debug("ignoring a malformed trainer point: %s", e)
    return points


class StepClaims:
    """The resync rule for one replica: which siblings it may take state from, by the steps
    their records claim and the trainer points read from the DHT (raw). A sibling claiming a
    step no authorized trainer committed is warned about once."""

    def __init__(self, trainers: Callable[[], Collection[str] | None]):
        self.trainers = trainers
        self._warned: set[str] = set()

    def committed(self, raw_points: Iterable[Any]) -> int | None:
        return committed_step(read_points(raw_points), self.trainers())

    def resync_from(
        self, replicas: Iterable[PeerRecord], own_step: int, raw_points: Iterable[Any]
    ) -> list[str]:
        """`resync_sources` among `replicas` for a replica at `own_step`."""
        committed = self.committed(raw_points)
        sources, unproven = resync_sources([(r.peer_id, r.step) for r in replicas], own_step, committed)
        for peer, step in unproven:
            if peer not in self._warned:
                self._warned.add(peer)
                logger.warning(
                    "replica %s claims step %d, past any step a trainer this run authorizes committed "
                    "(the furthest: %s): not catching up from it",
                    peer[-8:],
                    step,
                    committed,
                )
        return sources

    def join_from(self, replicas: Iterable[PeerRecord], raw_points: Iterable[Any]) -> list[str]:
        """`join_sources` among `replicas`."""
        return join_sources([(r.peer_id, r.step) for r in replicas], self.committed(raw_points))
