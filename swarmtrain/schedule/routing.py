"""Where a microbatch goes next: the replica choice of one hop, and bans (pure).

Each hop (the trainer into stage 0, stage k into stage k+1) picks one replica of the next
stage. `ReadinessRouter` picks the replica with the lowest expected completion time:

    backlog the replica reported, less what it has worked off since
    + (microbatches we sent it since that report + 1) x its service time per microbatch
    + bytes to send / bandwidth to it

from the readiness every reply piggybacks, refreshed from the DHT between replies. A replica
we have sent nothing for a while (in seconds, or in microbatches routed elsewhere) is probed
with the next microbatch, so a peer that was slow, or whose first microbatches were cold or
caught a hiccup of its machine, gets its share back. `RoundRobinRouter` is the static
baseline: replica `order mod R` in peer-id order (`schedule.static`).

Failures ban a peer with capped exponential backoff (`Bans`; hivemind's Blacklist without
the cap, Petals' retry -> ban -> backoff). When every replica of a stage is banned the
router answers None and the caller waits for a ban to end or a new replica to appear.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from swarmtrain.schedule.static import round_robin

MAX_PROBE_BACKOFF = 4
"""A much slower replica's count-based probes come at most 2**4 = 16 times further apart."""


@dataclass(frozen=True, kw_only=True)
class BanConfig:
    base_s: float = 1.0
    """First ban after a failure."""
    factor: float = 2.0
    """Each further failure in a row multiplies the ban by this."""
    max_s: float = 30.0
    """Longest ban."""

    def __post_init__(self):
        if not (0 < self.base_s <= self.max_s) or self.factor < 1:
            raise ValueError(f"need 0 < base_s <= max_s and factor >= 1, got {self}")


class Bans:
    """Peers banned after failures, each until a time; a success clears a peer's streak."""

    def __init__(self, config: BanConfig | None = None):
        self.config = config or BanConfig()
        self._until: dict[str, float] = {}
        self._streak: dict[str, int] = {}

    def fail(self, peer: str, now: float) -> float:
        """Ban `peer` (longer for each failure in a row); returns the ban's length in seconds.

        A failure while already banned does not lengthen the ban (the calls that failed were
        all made before it), as in hivemind's Blacklist.
        """
        if self.is_banned(peer, now):
            return self._until[peer] - now
        streak = self._streak.get(peer, 0)
        ban = min(self.config.max_s, self.config.base_s * self.config.factor**streak)
        self._until[peer] = now + ban
        self._streak[peer] = streak + 1
        return ban

    def succeed(self, peer: str) -> None:
        self._streak.pop(peer, None)
        self._until.pop(peer, None)

    def is_banned(self, peer: str, now: float) -> bool:
        return self._until.get(peer, -math.inf) > now

    def banned(self, now: float) -> dict[str, float]:
        """Banned peers and when their bans end."""
        for peer in [p for p, t in self._until.items() if t <= now]:
            del self._until[peer]
        return dict(self._until)

    def next_unban(self, peers: list[str], now: float) -> float | None:
        """Seconds until the first of `peers` is allowed again (None if none is banned)."""
        waits = [self._until[p] - now for p in peers if self.is_banned(p, now)]
        return min(waits) if waits else None


@dataclass(kw_only=True)
class ReplicaView:
    """What one router knows about one replica."""

    backlog_s: float = 0.0
    """Seconds of compute queued at the replica when it last reported."""
    service_s: float | None = None
    """Its compute seconds per microbatch (None: never reported)."""
    reported_at: float = -math.inf
    sent_since_report: int = 0
    last_sent: float = -math.inf
    passed_over: int = 0
    """Microbatches routed to other replicas since this one was last chosen."""
    slow_probes: int = 0
    """Count-based probes in a row that found this replica much slower than the best one."""
    bandwidth_bytes_per_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    stale_after_s: float = 3.0
    """A replica we have sent nothing for this long gets the next microbatch as a probe: its
    service time is old news, and a peer that was slow and recovered is seen again."""
    probe_every: int = 16
    """A replica passed over for this many microbatches in a row, with nothing outstanding,
    gets the next one as a probe: the same rule counted in work rather than seconds, so a fast
    swarm (many microbatches a second) does not starve a replica for `stale_after_s` on one
    slow measurement. At most one microbatch in `probe_every + 1` goes to a slow replica."""
    probe_max_slowdown: float = 4.0
    """A replica measured more than this many times slower per microbatch than the one chosen
    is probed by count ever more rarely (`probe_every`, then twice that, up to 16 times): a
    step commits once all its microbatches are done, so a microbatch on a much slower replica
    holds up the whole step. One whose slow measurement was a cold start or a hiccup answers
    its first probe fast and is probed as usual again."""
    bans: BanConfig = field(default_factory=BanConfig)

    def __post_init__(self):
        if (
            not self.stale_after_s > 0
            or not self.probe_max_slowdown >= 1
            or isinstance(self.probe_every, bool)
            or not (isinstance(self.probe_every, int) and self.probe_every >= 1)
        ):
            raise ValueError(
                f"need stale_after_s > 0, an integer probe_every >= 1 and probe_max_slowdown >= 1, got {self}"
            )


def _expected(v: ReplicaView, now: float, nbytes: int, default_service_s: float) -> float:
    service = v.service_s if v.service_s is not None else default_service_s
    backlog = max(0.0, v.backlog_s - max(0.0, now - v.reported_at)) if v.reported_at > -math.inf else 0.0
    transfer = nbytes / v.bandwidth_bytes_per_s if v.bandwidth_bytes_per_s else 0.0
    return backlog + (v.sent_since_report + 1) * service + transfer


class ReadinessRouter:
    """Lowest expected completion time among the replicas that are not banned."""

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.bans = Bans(self.config.bans)
        self.views: dict[str, ReplicaView] = {}
        self.outstanding: dict[str, int] = {}

    def view(self, peer: str) -> ReplicaView:
        v = self.views.get(peer)
        if v is None:
            v = self.views[peer] = ReplicaView()
        return v

    def report(
        self, peer: str, *, backlog_s: float, service_s: float, now: float, from_reply: bool = True
    ) -> None:
        """Take a replica's readiness: from a reply (fresh), or from its DHT record (may be older)."""
        v = self.view(peer)
        if not from_reply and now - v.reported_at < self.config.stale_after_s:
            return  # a reply's readiness beats the DHT's heartbeat
        v.backlog_s, v.reported_at = max(0.0, backlog_s), now
        if service_s > 0:
            v.service_s = service_s
        if from_reply:
            v.sent_since_report = 0

    def expected_s(self, peer: str, now: float, nbytes: int = 0, default_service_s: float = 0.0) -> float:
        """Expected seconds until `peer` would finish a microbatch sent now."""
        return _expected(self.view(peer), now, nbytes, default_service_s)

    def choose(
        self, candidates: list[str], now: float, *, nbytes: int = 0, order: int = 0, prefer: str | None = None
    ) -> str | None:
        """The replica to send a microbatch to, or None when every candidate is banned.

        `prefer` (a replica that already holds this microbatch's work) wins while it is allowed.
        """
        # This runs once per microbatch and hop, on real peers and in the simulator, where a
        # thousand-peer swarm calls it millions of times: one pass over the candidates, the
        # rules of `_expected` and `_due_for_probe` inlined (tests hold them equal).
        allowed, until = set(candidates), self.bans._until
        for p in allowed & until.keys():
            if until[p] > now:
                allowed.discard(p)
        if not allowed:
            return None
        if prefer in allowed:
            return prefer
        get, views = self.views.get, []
        for p in allowed:
            v = get(p)
            if v is None:
                v = self.views[p] = ReplicaView()
            views.append((p, v))
        known = sorted(v.service_s for _, v in views if v.service_s is not None)
        default = known[len(known) // 2] if known else 0.0
        best, best_v, best_key = None, None, None
        for p, v in views:
            service = v.service_s if v.service_s is not None else default
            backlog = v.backlog_s - (now - v.reported_at) if now > v.reported_at else v.backlog_s
            if backlog < 0.0 or v.reported_at == -math.inf:
                backlog = 0.0
            transfer = nbytes / v.bandwidth_bytes_per_s if v.bandwidth_bytes_per_s else 0.0
            key = (backlog + (v.sent_since_report + 1) * service + transfer, p)
            if best_key is None or key < best_key:
                best, best_v, best_key = p, v, key
        # Probe a replica we have sent nothing for a while: its service time is old news, and a
        # peer that was slow and recovered is seen again (at the cost of one microbatch).
        config, outstanding = self.config, self.outstanding
        stale, every, max_slowdown = config.stale_after_s, config.probe_every, config.probe_max_slowdown
        theirs = best_v.service_s
        chosen, chosen_v, chosen_key, best_idle = best, best_v, None, False
        for p, v in views:
            if outstanding.get(p):
                continue
            if now - v.last_sent <= stale:
                mine = v.service_s  # `_due_for_probe`
                if mine is None or theirs is None or mine <= max_slowdown * theirs:
                    v.slow_probes = 0
                if v.passed_over < every << min(v.slow_probes, MAX_PROBE_BACKOFF):
                    continue
            if p == best:
                best_idle = True
            key = (v.last_sent, p)
            if chosen_key is None or key < chosen_key:
                chosen, chosen_v, chosen_key = p, v, key
        if chosen_key is None or best_idle:
            chosen, chosen_v = best, best_v
        if chosen != best and now - chosen_v.last_sent <= stale:
            chosen_v.slow_probes += 1  # a count-based probe: the next one comes later
        for _, v in views:
            v.passed_over += 1
        chosen_v.passed_over = 0
        return chosen

    def _due_for_probe(self, peer: str, best: str) -> bool:
        """Whether `peer` was passed over long enough for a count-based probe: `probe_every`
        microbatches, times 2 for each probe in a row that found it still much slower than `best`."""
        v = self.view(peer)
        mine, theirs = v.service_s, self.view(best).service_s
        if mine is None or theirs is None or mine <= self.config.probe_max_slowdown * theirs:
            v.slow_probes = 0
        return v.passed_over >= self.config.probe_every << min(v.slow_probes, MAX_PROBE_BACKOFF)

    def sent(self, peer: str, now: float) -> None:
        v = self.view(peer)
        v.sent_since_report += 1
        v.last_sent = now
        self.outstanding[peer] = self.outstanding.get(peer, 0) + 1

    def done(self, peer: str, now: float, *, ok: bool) -> float | None:
        """A call to `peer` ended; on failure the peer is banned (returns the ban's seconds)."""
        self.outstanding[peer] = max(0, self.outstanding.get(peer, 0) - 1)
        if ok:
            self.bans.succeed(peer)
            return None
        return self.bans.fail(peer, now)

    def forget(self, keep: set[str]) -> None:
        """Drop what we know of replicas that are gone from the swarm."""
        for peer in [p for p in self.views if p not in keep and not self.outstanding.get(p)]:
            del self.views[peer]


class RoundRobinRouter(ReadinessRouter):
    """The static baseline: microbatch `order` goes to replica `order mod R` (peer-id order);
    banned replicas are skipped, and `prefer` still wins (replays stay where their work is)."""

    def choose(
        self, candidates: list[str], now: float, *, nbytes: int = 0, order: int = 0, prefer: str | None = None
    ) -> str | None:
        ranked = sorted(set(candidates))
        allowed = [p for p in ranked if not self.bans.is_banned(p, now)]
        if not allowed:
            return None
        if prefer in allowed:
            return prefer
        first = round_robin(order, len(ranked))
        for i in range(len(ranked)):
            peer = ranked[(first + i) % len(ranked)]
            if peer in allowed:
                return peer
        return None


class StochasticRouter(ReadinessRouter):
    """SWARM parallelism's wiring (Ryabinin et al. 2023): a replica drawn at random with
    probability proportional to its throughput (1 / its reported service time; a replica
    not measured yet counts as the median of those that are). Banned replicas are skipped,
    and `prefer` still wins. `seed` makes the draws repeatable."""

    def __init__(self, config: RouterConfig | None = None, *, seed: int = 0):
        super().__init__(config)
        self._rng = random.Random(seed)

    def choose(
        self, candidates: list[str], now: float, *, nbytes: int = 0, order: int = 0, prefer: str | None = None
    ) -> str | None:
        allowed = sorted(p for p in set(candidates) if not self.bans.is_banned(p, now))
        if not allowed:
            return None
        if prefer in allowed:
            return prefer
        services = [self.view(p).service_s for p in allowed]
        known = sorted(s for s in services if s)
        default = known[len(known) // 2] if known else 1.0
        weights = [1.0 / (s or default) for s in services]
        return self._rng.choices(allowed, weights=weights)[0]
