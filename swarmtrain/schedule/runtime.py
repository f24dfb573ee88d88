"""The thin runtime around a ready-queue policy: one compute thread, fed from the event loop.

`await scheduler.run(task, fn, *args)` queues `task` and returns `fn(*args)` once the policy
chose to run it (or raises what `fn` raised). `await scheduler.call(fn, *args)` runs
bookkeeping (state copies, gradient folds) ahead of any queued task and is never slowed
down. The scheduler keeps the figures a peer piggybacks on its replies (queue depth, the
expected seconds of queued work `backlog_s`, the moving average of a microbatch's compute
`service_s`) and the total compute time (`busy_s`), through a `ReadinessEstimator` it feeds
under its lock.
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
from swarmtrain.schedule.readiness import ReadinessConfig, ReadinessEstimator

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
        readiness: ReadinessConfig | None = None,
    ):
        """`holding()`: activations held now; `fused_last`: this is the last stage (its
        microbatches are single 'loss' tasks); `slowdown()`: compute takes this many times
        longer (emulates a slower or throttled device); `before_task(task)`: called on the
        compute thread just before a task runs (fault injection); `readiness`: how service
        times are averaged (defaults: `ReadinessConfig()`)."""
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
        self._estimator = ReadinessEstimator(fused_last=fused_last, now=time.monotonic(), config=readiness)
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
        with self._cond:
            return self._estimator.service_s

    @property
    def busy_s(self) -> float:
        """Compute seconds of all tasks run so far (slowdown included)."""
        with self._cond:
            return self._estimator.busy_s

    @property
    def tasks_run(self) -> int:
        """Tasks run so far (bookkeeping calls not counted)."""
        with self._cond:
            return self._estimator.tasks_run

    def readiness(self, now: float | None = None) -> dict:
        """queue_depth, backlog_s, service_s and holding, as replies and the DHT record carry
        them; `now` (monotonic seconds) defaults to the present."""
        with self._cond:
            queued = [t.kind for t in self.policy.tasks()]
            report = self._estimator.report(queued, time.monotonic() if now is None else now)
        return {
            "queue_depth": report.queue_depth,
            "backlog_s": round(report.backlog_s, 6),
            "service_s": round(report.service_s, 6),
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
                    self._estimator.started(task.kind, time.monotonic())
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
                    self._estimator.finished(elapsed, time.monotonic())
            try:
                loop.call_soon_threadsafe(_resolve, future, result, error)
            except RuntimeError:  # the loop closed while we computed
                return
