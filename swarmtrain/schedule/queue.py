"""Which compute task a peer runs next: the ready-queue policies (pure).

A stage peer has one compute thread and a queue of tasks: forward passes of microbatches
that arrived, and backward passes whose output gradient came back. Two policies:

- `ReadinessQueue` (the readiness-driven runtime): run whatever is ready. Backward first (it
  frees the activations it holds and unblocks the upstream peer waiting for the input
  gradient), then forward in hint order (the microbatch's place in its step, so the 1F1B
  order survives as a priority). A forward that will hold activations starts only while the
  peer holds fewer than its in-flight budget, so a fast upstream cannot run it out of memory.
- `StaticQueue` (the baseline): a fixed 1F1B order over the microbatches the peer is
  assigned; the next task in that order runs, nothing else, even when other work is ready.
  After `grace_s` without the expected task (it went elsewhere after a failure) it falls
  back to the oldest ready task, so a static swarm stalls instead of deadlocking.

Plain data in, plain data out: the runtime (`schedule.runtime`) owns threads and clocks.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

TASK_KINDS = ("forward", "backward", "loss")
"""forward: run the stage, keep activations; backward: gradient through a held forward;
loss: the last stage's forward, loss and backward in one task (it holds nothing afterwards)."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """One unit of compute a peer may run."""

    kind: str
    """One of TASK_KINDS."""
    mb_id: str
    """Microbatch the task belongs to."""
    step: int
    """Optimizer step of the microbatch."""
    order: int
    """The microbatch's place in its step: the 1F1B hint (lower runs first)."""
    seq: int = 0
    """Arrival number at this peer: ties and the static fallback go oldest first."""

    def __post_init__(self):
        if self.kind not in TASK_KINDS:
            raise ValueError(f"unknown task kind {self.kind!r}, expected one of {TASK_KINDS}")

    @property
    def holds(self) -> bool:
        """Whether the task leaves activations held until a backward (counts against the budget)."""
        return self.kind == "forward"


def in_flight_budget(
    free_bytes: float, activation_bytes_per_microbatch: float, *, reserve: float = 0.2, cap: int = 64
) -> int:
    """Microbatches whose activations fit in `free_bytes` (keeping `reserve` of it spare), 1..cap.

    At least 1, so a peer short of memory still makes progress one microbatch at a time.
    """
    if activation_bytes_per_microbatch <= 0:
        return cap
    fit = math.floor(free_bytes * (1 - reserve) / activation_bytes_per_microbatch)
    return max(1, min(cap, fit))


class ReadinessQueue:
    """Backward first, then forward in (step, order) order, forwards within the budget."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"the in-flight budget must be >= 1, got {budget}")
        self.budget = budget
        self._backward: list[tuple] = []
        self._forward: list[tuple] = []

    def __len__(self) -> int:
        return len(self._backward) + len(self._forward)

    def tasks(self) -> list[Task]:
        return [t for *_, t in self._backward + self._forward]

    def kinds(self) -> list[str]:
        """The kinds of `tasks()`, in the same order."""
        return [e[-1].kind for e in self._backward] + [e[-1].kind for e in self._forward]

    def push(self, task: Task) -> None:
        key = (task.step, task.order, task.seq)
        heapq.heappush(self._backward if task.kind == "backward" else self._forward, (*key, task))

    def pop(self, holding: int, now: float = 0.0) -> Task | None:
        """The task to run next, or None if none may run now. `holding`: activations held."""
        if self._backward:
            return heapq.heappop(self._backward)[-1]
        if not self._forward:
            return None
        if self._forward[0][-1].holds and holding >= self.budget:
            loss = [entry for entry in self._forward if entry[-1].kind != "forward"]  # a loss task holds nothing
            if not loss:
                return None
            entry = min(loss)
            self._forward.remove(entry)
            heapq.heapify(self._forward)
            return entry[-1]
        return heapq.heappop(self._forward)[-1]


def one_f_one_b(orders: list[int], warmup: int, *, fused: bool = False) -> list[tuple[str, int]]:
    """The fixed 1F1B sequence of (kind, order) over the microbatches `orders` of one peer.

    `warmup` forwards first (a stage k of S does S - k before its first backward returns),
    then one backward and one forward alternately, then the remaining backwards. With
    `fused` (the last stage) each microbatch is one 'loss' task, in order.
    """
    if fused:
        return [("loss", n) for n in orders]
    seq: list[tuple[str, int]] = []
    f = b = 0
    for _ in range(min(max(warmup, 1), len(orders))):
        seq.append(("forward", orders[f]))
        f += 1
    while b < len(orders):
        seq.append(("backward", orders[b]))
        b += 1
        if f < len(orders):
            seq.append(("forward", orders[f]))
            f += 1
    return seq


@dataclass(kw_only=True)
class _StepPlan:
    sequence: list[tuple[str, int]]
    position: int = 0
    waiting_since: float | None = None


@dataclass(kw_only=True)
class StaticQueue:
    """Fixed 1F1B order per step; see the module docstring."""

    grace_s: float = 2.0
    """How long the expected task may be missing while others wait before the order is abandoned."""
    _plans: dict[int, _StepPlan] = field(default_factory=dict)
    _ready: dict[tuple[str, int, int], Task] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._ready)

    def tasks(self) -> list[Task]:
        return list(self._ready.values())

    def kinds(self) -> list[str]:
        """The kinds of `tasks()`, in the same order."""
        return [t.kind for t in self._ready.values()]

    def expect(self, step: int, orders: list[int], warmup: int, *, fused: bool) -> None:
        """Announce the microbatches of `step` this peer will get; the first call per step wins."""
        if step not in self._plans:
            self._plans[step] = _StepPlan(sequence=one_f_one_b(sorted(orders), warmup, fused=fused))
            for old in [s for s in self._plans if s < step]:
                del self._plans[old]

    def push(self, task: Task) -> None:
        self._ready[(task.kind, task.step, task.order)] = task

    def pop(self, holding: int, now: float = 0.0) -> Task | None:
        if not self._ready:
            return None
        oldest = min(self._ready.values(), key=lambda t: t.seq)
        plan = self._plans.get(oldest.step)
        if plan is None:  # no order known for this step: first come, first served
            return self._ready.pop((oldest.kind, oldest.step, oldest.order))
        while plan.position < len(plan.sequence):
            kind, order = plan.sequence[plan.position]
            task = self._ready.pop((kind, oldest.step, order), None)
            if task is not None:
                plan.position += 1
                plan.waiting_since = None
                return task
            if plan.waiting_since is None:
                plan.waiting_since = now
            if now - plan.waiting_since < self.grace_s:
                return None
            plan.position += 1  # the expected task is not coming: skip it
            plan.waiting_since = None
        return self._ready.pop((oldest.kind, oldest.step, oldest.order))
