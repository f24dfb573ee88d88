"""Frames leave a peer one after another at its uplink's rate (`Pacer`).

Without pacing a peer hands every frame to the p2p daemon as soon as it is encoded. Over a
slow link the daemon and the kernel then hold several frames at once, which share the link
and all arrive late: the next stage sees its first activation only when most of the batch has
crossed, and sits idle before it (over 10 Mbit/s the middle stage's uplink was full only about
half of the time it was in use; `benchmarks/wan.py --peers swarm` samples it). Paced, a frame
goes out when the link has carried the one before it, so frames arrive in the order they were
sent, each at the link's full rate.
"""

from __future__ import annotations

import asyncio
import time


class Pacer:
    """Slots on one uplink of `bytes_per_s`, handed out in the order they are asked for."""

    def __init__(self, bytes_per_s: float):
        if not bytes_per_s > 0:
            raise ValueError(f"an uplink rate must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self.waited_s = 0.0
        """Seconds frames have waited for their slot, all together."""

    def reserve(self, nbytes: int, now: float) -> float:
        """Book the link for `nbytes` from when it is next free; returns the seconds to wait."""
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        return start - now

    async def wait(self, nbytes: int) -> None:
        """Wait for the slot of a frame of `nbytes` about to be written."""
        delay = self.reserve(nbytes, time.monotonic())
        if delay > 0:
            self.waited_s += delay
            await asyncio.sleep(delay)
