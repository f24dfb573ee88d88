"""The event engine: a clock and a heap of timed callbacks, nothing else.

Events at the same time run in the order they were scheduled, so a run is a pure function
of its scenario and seed. Cancelling is the caller's business (objects carry an epoch and
ignore events of an older one): a heap entry is never removed early.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class Engine:
    """Simulated time in seconds from 0; `run(until)` processes events in time order."""

    def __init__(self):
        self.now = 0.0
        self.events = 0
        """Events processed so far."""
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run `fn(*args)` at time `t` (not before now)."""
        if t < self.now:
            raise ValueError(f"cannot schedule an event at {t:.6f} s, before now ({self.now:.6f} s)")
        heapq.heappush(self._heap, (t, self._seq, fn, args))
        self._seq += 1

    def after(self, delay_s: float, fn: Callable, *args) -> None:
        """Run `fn(*args)` `delay_s` seconds from now."""
        self.at(self.now + delay_s, fn, *args)

    def run(self, until: float) -> None:
        """Process every event up to time `until`; the clock ends at `until`."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        self.now = max(self.now, until)

    @property
    def pending(self) -> int:
        return len(self._heap)
