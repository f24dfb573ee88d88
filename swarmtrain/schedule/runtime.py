"""The thin runtime around a ready-queue policy: one compute thread, fed from the event loop.

`await scheduler.run(task, fn, *args)` queues `task` and returns `fn(*args)` once the policy
chose to run it (or raises what `fn` raised). `await scheduler.call(fn, *args)` runs
bookkeeping (state copies, gradient folds) ahead of any queued task and is never slowed
down. The scheduler keeps the figures a peer piggybacks on its replies: queue depth, the
expected seconds of queued work (`backlog_s`), the moving average of a microbatch's compute
(`service_s`) and the total compute time (`busy_s`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from swarmtrain.schedule.queue import ReadinessQueue, StaticQueue, Task

SERVICE_ALPHA = 0.5
"""Weight of the newest task in the service-time averages: a peer that slows down or recovers
shows it within a few microbatches."""
IDLE_OPTIMISM_S = 2.0
"""A peer idle this long reports the best service time it has shown, not its last average:
routers then send it work again, and a peer that was slow and recovered gets its share back
(if it is still slow, the replies to that work say so)."""
IDLE_POLL_S = 0.05
"""How often a waiting policy is asked again (a budget freed by a drop, a static grace ending)."""


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (cancelled); the work is done all the same
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ComputeScheduler:
    """Run compute tasks on one thread in the order `policy` gives; see the module docstring."""

    def __init__(
        self,
        policy: ReadinessQueue | StaticQueue,
        *,
        holding: Callable[[], int],
        fused_last: bool,
        slowdown: Callable[[], float] = lambda: 1.0,
        before_task: Callable[[Task], None] | None = None,
    ):
        """`holding()`: activations held now; `fused_last`: this is the last stage (its
        microbatches are single 'loss' tasks); `slowdown()`: compute takes this many times
        longer (emulates a slower or throttled device); `before_task(task)`: called on the
        compute thread just before a task runs (fault injection)."""
        self.policy = policy
        self._holding = holding
        self._fused_last = fused_last
        self._slowdown = slowdown
        self._before = before_task
        self._cond = threading.Condition()
        self._items: dict[int, tuple] = {}
        self._admin: list[tuple] = []
        self._seq = itertools.count()
        self._closed = False
        self._running: tuple[str, float] | None = None
        self._ewma: dict[str, float] = {}
        self._best_service_s = 0.0
        self._last_done = time.monotonic()
        self.busy_s = 0.0
        self.tasks_run = 0
        self._thread = threading.Thread(target=self._work, name="stage-compute", daemon=True)
        self._thread.start()

    # the loop's side

    async def run(self, task: Task, fn: Callable, *args) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the compute scheduler is closed")
            seq = next(self._seq)
            self.policy.push(replace(task, seq=seq))
            self._items[seq] = (fn, args, future, loop)
            self._cond.notify_all()
        return await future

    async def call(self, fn: Callable, *args) -> Any:
        """Run bookkeeping `fn(*args)` on the compute thread before any queued task."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the compute scheduler is closed")
            self._admin.append((fn, args, future, loop))
            self._cond.notify_all()
        return await future

    def wake(self) -> None:
        """Held activations were freed outside a task: let a waiting forward start."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def expect(self, step: int, orders: list[int], warmup: int) -> None:
        """Static policy only: the microbatches of `step` this peer will get (ignored otherwise)."""
        if isinstance(self.policy, StaticQueue):
            with self._cond:
                self.policy.expect(step, orders, warmup, fused=self._fused_last)
                self._cond.notify_all()

    # readiness

    @property
    def service_s(self) -> float:
        """Compute seconds per microbatch (forward + backward), 0 until measured."""
        e = self._ewma
        if self._fused_last:
            return e.get("loss", 0.0)
        return e.get("forward", 0.0) + e.get("backward", 0.0)

    def readiness(self) -> dict:
        """queue_depth, backlog_s, service_s and holding, as replies and the DHT record carry them."""
        with self._cond:
            tasks = self.policy.tasks()
            backlog = sum(self._ewma.get(t.kind, 0.0) for t in tasks)
            depth = len(tasks)
            if self._running is not None:
                kind, since = self._running
                backlog += max(0.0, self._ewma.get(kind, 0.0) - (time.monotonic() - since))
                depth += 1
            idle = depth == 0 and time.monotonic() - self._last_done > IDLE_OPTIMISM_S
        service = self._best_service_s if idle and self._best_service_s > 0 else self.service_s
        return {
            "queue_depth": depth,
            "backlog_s": round(backlog, 6),
            "service_s": round(service, 6),
            "holding": self._holding(),
        }

    # the compute thread

    def _next(self) -> tuple[Task | None, tuple] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._admin:
                    return None, self._admin.pop(0)
                task = self.policy.pop(self._holding(), time.monotonic())
                if task is not None:
                    self._running = (task.kind, time.monotonic())
                    return task, self._items.pop(task.seq)
                self._cond.wait(IDLE_POLL_S if len(self.policy) else None)

    def _work(self) -> None:
        while (item := self._next()) is not None:
            task, (fn, args, future, loop) = item
            result, error = None, None
            started = time.perf_counter()
            try:
                if task is not None and self._before is not None:
                    self._before(task)
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting coroutine
                error = e
            elapsed = time.perf_counter() - started
            if task is not None:
                factor = self._slowdown()
                if factor > 1:
                    time.sleep((factor - 1) * elapsed)
                    elapsed *= factor
                with self._cond:
                    old = self._ewma.get(task.kind)
                    self._ewma[task.kind] = elapsed if old is None else old + SERVICE_ALPHA * (elapsed - old)
                    self.busy_s += elapsed
                    self.tasks_run += 1
                    self._running = None
                    self._last_done = time.monotonic()
                    known = self._fused_last or {"forward", "backward"} <= self._ewma.keys()
                    service = self.service_s
                    if known and (self._best_service_s == 0 or service < self._best_service_s):
                        self._best_service_s = service
            try:
                loop.call_soon_threadsafe(_resolve, future, result, error)
            except RuntimeError:  # the loop closed while we computed
                return
