"""Several trainers of an in-process swarm, each feeding its shard and committing in turn.

`InProcessTeam(swarm)` gives every trainer of `swarm.trainer_names` its own transport on the
swarm's memory network, its own router and its own `team.Team`, serving the others;
`await team.train(data, steps)` runs them together over `data`, the run's whole data order
(trainer i feeds shard i of N, `shards.ShardFeed`), and returns each trainer's results.
`kill(name)` kills a trainer: its calls break, its step stops, and (as a record lingers in the
DHT for its TTL) the others still count it among the run's trainers until they find it gone.
Like the swarm's faults, a kill can be set on the network to strike at an exact point of the
protocol (`kill_when`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.inprocess import TRAINER, InProcessSwarm
from swarmtrain.train.shards import Shard, ShardFeed
from swarmtrain.train.step import TrainerStep
from swarmtrain.train.step_result import StepResult
from swarmtrain.train.team import Team
from swarmtrain.train.trainer_context import TrainerContext
from swarmtrain.wire.frames import Frame

logger = logging.getLogger(__name__)

WAIT_S = 20.0
"""Longest a committer waits for the report of a trainer that feeds its step."""


class InProcessTeam:
    """See the module docstring."""

    def __init__(
        self, swarm: InProcessSwarm, *, shards: dict[str, Shard] | None = None, see_others: bool = True
    ):
        """`see_others=False`: no trainer sees the others announced (a DHT that lags): each
        takes itself for the committer, and the replicas' claims settle it."""
        self.swarm = swarm
        self.see_others = see_others
        names = swarm.trainer_names
        self.shards = shards or {name: Shard(i, len(names)) for i, name in enumerate(names)}
        self.contexts: dict[str, TrainerContext] = {}
        self.teams: dict[str, Team] = {}
        self.dead: set[str] = set()
        self.tasks: dict[str, asyncio.Task] = {}
        self.results: dict[str, list[StepResult]] = {name: [] for name in names}
        per_step = swarm.manifest.batch.microbatches_per_step
        for name in names:
            transport = swarm.trainer if name == TRAINER else swarm.network.transport(name)
            ctx = swarm.trainer_context(name, transport)
            self.contexts[name] = ctx
            self.teams[name] = Team(
                ctx,
                shard=self.shards[name],
                total=per_step,
                members=self._members(name),
                authorized=lambda peer: peer in names,
                wait_s=WAIT_S,
            )

    def _members(self, name: str):
        async def members() -> list[str]:  # a dead trainer's record lingers: it is still listed
            return [n for n in self.swarm.trainer_names if n != name and self.see_others]

        return members

    def kill(self, name: str) -> None:
        """Trainer `name` dies: its calls break and its training stops."""
        self.dead.add(name)
        self.swarm.network.kill(name)
        self._stop(name)

    def _stop(self, name: str) -> None:
        # Cancelled from inside one of its own calls, a task may have the cancel swallowed by
        # `asyncio.wait_for` (the call failed at once): cancel again until it has stopped.
        task = self.tasks.get(name)
        if task is not None and not task.done():
            task.cancel()
            asyncio.get_running_loop().call_later(0.05, self._stop, name)

    def kill_when(self, name: str, when: Callable[[str, str, Frame], bool]) -> None:
        """Kill trainer `name` as it sends a request for which `when(sender, receiver, frame)` holds."""
        self.swarm.network.on_delivery(lambda s, r, f: s == name and when(s, r, f), lambda: self.kill(name))

    async def _train(self, name: str, data: list, steps: int) -> None:
        ctx, team = self.contexts[name], self.teams[name]
        per_step = self.swarm.manifest.batch.microbatches_per_step
        shard = self.shards[name]
        feed = ShardFeed.from_run_order(data, shard, per_step)
        step = 0
        try:
            while step < steps:
                items = feed.take(step)
                if items is None:
                    return
                microbatches = [loss_inputs_of(item) for item in items]
                own = TrainerStep(
                    ctx, step, microbatches, positions=shard.positions(per_step), total=per_step
                )
                result = await team.run_step(own)
                self.results[name].append(result)
                step = result.step + 1
        finally:
            team.feeding = False

    async def train(self, data: list, steps: int) -> dict[str, list[StepResult]]:
        """Every live trainer trains `steps` steps over its shard of `data` (the run's data order);
        each trainer's results. A trainer that fails raises its error here."""
        for name in self.swarm.trainer_names:
            await self.contexts[name].transport.serve(self.contexts[name].handler, self.teams[name].handle)
        for name in self.swarm.trainer_names:
            if name not in self.dead:
                self.tasks[name] = asyncio.create_task(self._train(name, data, steps), name=f"train-{name}")
        pending = set(self.tasks.values())
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for name, task in self.tasks.items():
                if task in done and name not in self.dead and not task.cancelled() and task.exception():
                    for other in pending:
                        other.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    raise task.exception()
        return self.results
