"""A trainer's presence in its run: its record under `{run}.peers`, and the others'.

While it trains, a trainer announces a peer record (role 'trainer', its step, the rollout
peers it banned from an RL run) every `heartbeat_s`, living `ttl_s`: 'joining' while it waits
for the run's other trainers, 'serving' while it feeds, 'draining' once it stops. The other
trainers that announce 'joining' or 'serving' are the members of the run's team
(`swarmtrain.train.team`): candidates to commit a step, and trainers a committer waits for. A record outlives a killed trainer by up to `ttl_s`; the team finds
such a trainer gone by calling it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hivemind.utils import get_dht_time

import swarmtrain
from swarmtrain.swarm import SwarmNode
from swarmtrain.wire.records import PeerRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PresenceConfig:
    heartbeat_s: float = 2.0
    """Seconds between announcements."""
    ttl_s: float = 6.0
    """Lifetime of an announcement."""
    refresh_s: float = 1.0
    """How old the view of the other trainers may get before it is read again."""


class TrainerPresence:
    """Announce one trainer and read the others (see the module docstring)."""

    def __init__(self, node: SwarmNode, run_id: str, config: PresenceConfig | None = None):
        self.node = node
        self.run_id = run_id
        self.config = config or PresenceConfig()
        self.state = "joining"
        self.step = 0
        self.banned: tuple[str, ...] = ()
        """Peers the record lists as banned (at most MAX_BANNED_LISTED): an RL run's rollout
        peers the trainer's feed banned."""
        self._since = get_dht_time()
        self._beat: asyncio.Task | None = None
        self._members: list[str] = []
        self._read_at = -1.0

    def record(self) -> PeerRecord:
        return PeerRecord(
            peer_id=self.node.peer_id,
            role="trainer",
            state=self.state,
            version=swarmtrain.__version__,
            step=self.step,
            since=self._since,
            banned=self.banned,
        )

    async def announce(self, state: str | None = None, step: int | None = None) -> None:
        """Announce the record now (with a new state or step)."""
        self.state = state or self.state
        self.step = self.step if step is None else step
        await self.node.announce_async(self.run_id, self.record(), ttl_s=self.config.ttl_s)

    async def start(self) -> None:
        """Announce 'joining' and keep announcing until `stop`."""
        await self.announce("joining")
        if self._beat is None:
            self._beat = asyncio.create_task(self._heartbeat(), name="trainer-presence")

    async def stop(self) -> None:
        """Announce 'draining' and stop announcing."""
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
            self._beat = None
        await self.announce("draining")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                await asyncio.wait_for(self.announce(), timeout=self.config.ttl_s)
            except Exception as e:  # a DHT hiccup: the next beat tries again
                logger.warning("could not announce this trainer: %r", e)

    async def members(self) -> list[str]:
        """The other trainers that announce they feed the run or are about to (read at most every
        refresh_s)."""
        if time.monotonic() - self._read_at > self.config.refresh_s:
            records = await self.node.peers_async(self.run_id)
            self._members = sorted(
                r.peer_id
                for r in records
                if r.role == "trainer"
                and r.state in ("joining", "serving")
                and r.peer_id != self.node.peer_id
            )
            self._read_at = time.monotonic()
        return self._members

    async def wait_for(self, count: int, timeout_s: float) -> None:
        """Wait until `count` trainers (this one included) announce themselves in the run, at
        most `timeout_s`; then go on with those there are."""
        deadline = time.monotonic() + timeout_s
        while True:
            records = await self.node.peers_async(self.run_id)
            here = {r.peer_id for r in records if r.role == "trainer" and r.state in ("joining", "serving")}
            if len(here | {self.node.peer_id}) >= count:
                return
            if time.monotonic() > deadline:
                logger.warning(
                    "only %d of the %d trainers asked for joined run %r in %.0f s: training with those",
                    len(here | {self.node.peer_id}),
                    count,
                    self.run_id,
                    timeout_s,
                )
                return
            await asyncio.sleep(0.25)
