"""What a stage peer tells routers about its compute: queue depth, backlog and service time.

A `ReadinessEstimator` keeps a moving average of the compute seconds of each task kind
('forward', 'backward', or the last stage's fused 'loss'), and from it the expected seconds
of work ahead of a new task: every queued task's average, plus what remains of the running
one's. A peer idle for a while reports the best service time it has shown rather than its
latest average, so routers send it work again (a peer that was slow and recovered gets its
share back; if it is still slow, the replies to that work say so).

Pure: the caller reports when a task starts and how long it took, and passes the time `now`
(monotonic seconds) to every question; nothing here reads a clock, starts a thread or takes
a lock (`ComputeScheduler` calls it under its own lock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from swarmtrain.errors import ConfigError

SERVICE_ALPHA = 0.5
"""Weight of the newest task in the service-time averages: a peer that slows down or recovers
shows it within a few microbatches."""
IDLE_OPTIMISM_S = 2.0
"""Seconds without work after which a peer reports the best service time it has shown."""


@dataclass(frozen=True, kw_only=True)
class ReadinessConfig:
    """How a peer averages its service times and when it turns optimistic."""

    service_alpha: float = SERVICE_ALPHA
    """Weight of the newest task in each kind's moving average, in (0, 1]; 1: the last task only."""
    idle_optimism_s: float = IDLE_OPTIMISM_S
    """A peer with nothing queued or running for longer than this reports its best service time."""

    def __post_init__(self):
        alpha = self.service_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ConfigError(f"ReadinessConfig: service_alpha must be in (0, 1], got {alpha!r}")
        idle = self.idle_optimism_s
        if (
            isinstance(idle, bool)
            or not isinstance(idle, (int, float))
            or not (idle >= 0 and math.isfinite(idle))
        ):
            raise ConfigError(f"ReadinessConfig: idle_optimism_s must be a finite number >= 0, got {idle!r}")


@dataclass(frozen=True, kw_only=True)
class Readiness:
    """One report of a peer's readiness, as its replies and DHT record carry it."""

    queue_depth: int
    """Tasks queued or running."""
    backlog_s: float
    """Expected compute seconds ahead of a task queued now."""
    service_s: float
    """Compute seconds one microbatch costs (the best shown, after an idle spell)."""


class ReadinessEstimator:
    """Service-time averages per task kind and the readiness figures built on them.

    `fused_last`: the peer serves the last stage, whose microbatches are single 'loss' tasks
    (forward, loss and backward at once) rather than a 'forward' and a 'backward'. `now`: the
    time of construction, from which the first idle spell counts. Call `started` when a task
    begins and `finished` when it ends, one task at a time.
    """

    def __init__(self, *, fused_last: bool, now: float, config: ReadinessConfig | None = None):
        self.config = config or ReadinessConfig()
        self.fused_last = fused_last
        self.busy_s = 0.0
        """Compute seconds of all finished tasks."""
        self.tasks_run = 0
        """Tasks finished."""
        self._average: dict[str, float] = {}
        self._runs: dict[str, int] = {}
        self._best_service_s = 0.0
        self._running: tuple[str, float] | None = None  # (kind, started at)
        self._last_done = now

    def service_of(self, kind: str) -> float:
        """The moving average of a `kind` task's compute seconds; 0 until one has run."""
        return self._average.get(kind, 0.0)

    @property
    def service_s(self) -> float:
        """Compute seconds per microbatch: the 'loss' average on the last stage, else forward +
        backward; 0 until measured."""
        if self.fused_last:
            return self.service_of("loss")
        return self.service_of("forward") + self.service_of("backward")

    def started(self, kind: str, now: float) -> None:
        """A task of `kind` starts running at `now`."""
        assert self._running is None, f"a {self._running[0]} task is still running"
        self._running = (kind, now)

    def finished(self, elapsed_s: float, now: float) -> None:
        """The running task ended at `now` after `elapsed_s` seconds of compute; fold it into its
        kind's average. The first run of a kind sets the average and the second replaces it: a
        process's first task is cold (allocations, kernel choices, caches), often many times
        slower than the rest, and averaging it in would keep routers away for several tasks."""
        assert self._running is not None, "no task is running"
        kind, _ = self._running
        old = self._average.get(kind)
        runs = self._runs.get(kind, 0)
        alpha = self.config.service_alpha
        self._average[kind] = elapsed_s if runs < 2 else old + alpha * (elapsed_s - old)
        self._runs[kind] = runs + 1
        self.busy_s += elapsed_s
        self.tasks_run += 1
        self._running = None
        self._last_done = now
        known = self.fused_last or {"forward", "backward"} <= self._average.keys()
        service = self.service_s
        if known and (self._best_service_s == 0 or service < self._best_service_s):
            self._best_service_s = service

    def backlog_s(self, queued: Iterable[str], now: float) -> float:
        """Expected seconds before a new task could start: the average of every queued task's
        kind (`queued`), plus the running task's average less the time it has run (not below 0)."""
        average = self._average
        backlog = sum(average.get(kind, 0.0) for kind in queued)
        if self._running is not None:
            kind, since = self._running
            backlog += max(0.0, self.service_of(kind) - (now - since))
        return backlog

    def is_idle(self, queue_depth: int, now: float) -> bool:
        """Nothing queued or running (`queue_depth` 0) and no task finished for over `idle_optimism_s`."""
        return queue_depth == 0 and now - self._last_done > self.config.idle_optimism_s

    def report(self, queued: Iterable[str], now: float) -> Readiness:
        """The readiness to announce at `now`, with the kinds of the queued tasks in `queued`."""
        queued = list(queued)
        depth = len(queued) + (self._running is not None)
        service = self.service_s
        if self.is_idle(depth, now) and self._best_service_s > 0:
            service = self._best_service_s
        return Readiness(queue_depth=depth, backlog_s=self.backlog_s(queued, now), service_s=service)
