"""A whole swarm in one process: real stages, the real protocol, an in-memory network.

`InProcessSwarm` builds every replica of every stage of a run as the stage peers do (the
stage module from the run seed, a `StageRunner`, a `ComputeScheduler` thread, a router) and
serves each with `service.StageService` over a `transport.memory.MemoryNetwork`; a trainer
drives steps with `step.TrainerStep`. Routing is exact (no DHT): a killed replica is out of
every route at once. The run authorizes `InProcessConfig.trainers` trainers, `TRAINER` first
(`trainer_names`; several feed the run together through `inprocess_team`); the replicas' authorities
(`authority.RunAuthority`) see the membership as of the last `refresh_members`, so a replica
that `join`s is known to the others one refresh later, as a new peer's record in a DHT is.
Faults are the network's (`swarm.network`: lost replies, delays, duplicates, held frames,
kills) plus `kill_on_task`, which kills a replica as its N-th task of a kind starts, the way
`swarmtrain join --fault` does in a real swarm.

It runs on the caller's event loop: `async with InProcessSwarm(...) as swarm: await swarm.step(...)`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_stage
from swarmtrain.schedule import ReadinessQueue, ReadinessRouter, RoundRobinRouter, StaticQueue, Task
from swarmtrain.schedule.runtime import ComputeScheduler
from swarmtrain.train.authority import RunAuthority
from swarmtrain.train.context import StageContext
from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.run_length import is_finished, last_step_message, steps_to_run
from swarmtrain.train.scoring import score_pass
from swarmtrain.train.service import StageService
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.train.step import Microbatch, StepResult, TrainerContext, TrainerStep
from swarmtrain.transport.memory import MemoryNetwork
from swarmtrain.wire.records import RunManifest

logger = logging.getLogger(__name__)

TRAINER = "trainer"
"""The peer id of the swarm's trainer, the one the run authorizes."""
IN_FLIGHT_BUDGET = 8
"""Activations a replica may hold at once (a real peer derives this from its free memory)."""


class ReplicaKilled(RuntimeError):
    """Raised on a replica's compute thread as it dies (`kill_on_task`)."""


@dataclass(frozen=True, kw_only=True)
class InProcessConfig:
    """An in-process swarm: the run, its replicas, and the trainer's patience."""

    manifest: RunManifest
    replicas: tuple[int, ...]
    """Replicas per stage."""
    slowdowns: dict[str, float] = field(default_factory=dict)
    """Replica name ('s{stage}r{index}') -> compute takes this many times longer."""
    dtypes: dict[str, str] = field(default_factory=dict)
    """Replica name -> what it computes in ('bf16': autocast; default 'fp32')."""
    microbatch_timeout_s: float = 10.0
    max_retries: int = 6
    max_dropped_fraction: float = 0.0
    verify_replicas: bool = True
    window: int = 4
    trainers: int = 1
    """Trainers the run authorizes (`InProcessSwarm.trainer_names`)."""

    def __post_init__(self):
        if len(self.replicas) != self.manifest.num_stages or min(self.replicas) < 1:
            raise ConfigError(
                f"replicas {list(self.replicas)} must give each of the run's {self.manifest.num_stages} stages at least one"
            )


@dataclass(kw_only=True)
class Replica:
    name: str
    """'s{stage}r{index}': also its peer id on the in-memory network."""
    stage: int
    runner: StageRunner
    scheduler: ComputeScheduler
    service: StageService
    started: list[Task] = field(default_factory=list)
    """Tasks started, in order."""

    @property
    def tasks(self) -> dict[str, int]:
        """Tasks started, by kind."""
        return dict(Counter(t.kind for t in self.started))


class InProcessSwarm:
    """See the module docstring."""

    def __init__(self, config: InProcessConfig):
        self.config = config
        self.manifest = m = config.manifest
        self.network = MemoryNetwork()
        self.replicas: dict[str, Replica] = {}
        self.dead: set[str] = set()
        self.trainer_step = 0
        self.known_step: dict[str, int] = {}
        self._kills: dict[str, Callable[[Task, list[Task]], bool]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        static = m.schedule == "static"
        self.router = RoundRobinRouter() if static else ReadinessRouter()
        self.trainer = self.network.transport(TRAINER)
        self.trainer_names = (TRAINER, *(f"{TRAINER}-{i}" for i in range(1, config.trainers)))
        """The trainers the run authorizes; `TRAINER`, the lowest id, drives `step` and `train`."""
        self.members: dict[str, int] = {}
        """Replica -> its stage, as the authorities see the membership (see the module docstring)."""
        for k, count in enumerate(config.replicas):
            for j in range(count):
                self._add(k, f"s{k}r{j}")
        self.members = self._membership()

    def _add(self, stage: int, name: str) -> None:
        m = self.manifest
        start, end = m.stage_span(stage)
        module = build_stage(
            m.model, m.model_config, start, end, num_blocks=m.num_blocks, seed=m.seed, loss=m.loss
        )
        runner = StageRunner(
            module,
            m.optimizer,
            microbatch_size=m.batch.microbatch_size,
            max_steps=m.max_steps,
            compute_dtype=self.config.dtypes.get(name, "fp32"),
        )
        slowdown = self.config.slowdowns.get(name, 1.0)
        scheduler = ComputeScheduler(
            StaticQueue() if m.schedule == "static" else ReadinessQueue(IN_FLIGHT_BUDGET),
            holding=lambda: runner.num_pending,
            fused_last=stage == m.num_stages - 1,
            slowdown=lambda: slowdown,
            before_task=lambda task: self._before_task(name, task),
        )
        transport = self.network.transport(name)
        ctx = StageContext(
            run_id=m.run_id,
            peer_id=name,
            stage=stage,
            num_stages=m.num_stages,
            runner=runner,
            scheduler=scheduler,
            router=RoundRobinRouter() if m.schedule == "static" else ReadinessRouter(),
            transport=transport,
            compression=m.compression,
            replicas=lambda k: [p for p in self.live(k) if p != name],
            refresh=asyncio.sleep,
            authority=RunAuthority(
                trainers=lambda: frozenset(self.trainer_names),
                stage_of=lambda peer: self.members.get(peer),
                refresh=self.refresh_members,
                weight_readers=lambda: m.weight_readers,
                unknown_grace_s=0.0,  # a refresh here reads the whole membership: no peer hides
            ),
        )
        service = StageService(ctx)
        self.replicas[name] = Replica(
            name=name, stage=stage, runner=runner, scheduler=scheduler, service=service
        )

    def _membership(self) -> dict[str, int]:
        return {n: r.stage for n, r in self.replicas.items() if n not in self.dead}

    async def refresh_members(self) -> None:
        """The authorities' view of the membership catches up with the swarm."""
        self.members = self._membership()

    async def join(self, stage: int) -> Replica:
        """A new replica of `stage` joins (between steps): it serves, and takes its parameters
        and optimizer state from a live replica of its stage, as a stage peer does."""
        sources = self.live(stage)
        name = f"s{stage}r{sum(r.stage == stage for r in self.replicas.values())}"
        self._add(stage, name)
        service = self.replicas[name].service
        await service.ctx.transport.serve(service.ctx.handler, service.handle)
        await service.take_state(sources)
        return self.replicas[name]

    def live(self, stage: int) -> list[str]:
        """The replicas of `stage` still alive."""
        return sorted(n for n, r in self.replicas.items() if r.stage == stage and n not in self.dead)

    # faults

    def kill(self, name: str) -> None:
        """The replica dies: out of every view, its calls broken, its compute stopped."""
        self.dead.add(name)
        self.network.kill(name)
        self.replicas[name].scheduler.close()

    def kill_on_task(self, name: str, kind: str, n: int) -> None:
        """Kill replica `name` as its `n`-th task of `kind` ('forward', 'backward', 'loss') starts."""
        self.kill_when(
            name, lambda task, before: task.kind == kind and sum(t.kind == kind for t in before) == n - 1
        )

    def kill_when(self, name: str, when: Callable[[Task, list[Task]], bool]) -> None:
        """Kill replica `name` as a task starts for which `when(task, the tasks started before)` holds."""
        self._kills[name] = when

    def _before_task(self, name: str, task: Task) -> None:
        replica = self.replicas[name]
        when = self._kills.get(name)
        fatal = when is not None and when(task, replica.started)
        replica.started.append(task)
        if fatal:
            self._loop.call_soon_threadsafe(self.kill, name)
            raise ReplicaKilled(
                f"{name} was killed as its {task.kind} task of microbatch {task.mb_id} started"
            )

    # running

    async def __aenter__(self) -> InProcessSwarm:
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas.values():
            await replica.service.ctx.transport.serve(replica.service.ctx.handler, replica.service.handle)
        return self

    async def __aexit__(self, *exc) -> None:
        for replica in self.replicas.values():
            replica.scheduler.close()

    async def _trainer_replicas(
        self, *, refresh: bool = False, wait_for_all: bool = False
    ) -> dict[int, list[str]]:
        return {k: self.live(k) for k in range(self.manifest.num_stages)}

    def trainer_context(self, name: str = TRAINER, transport=None) -> TrainerContext:
        """The context of trainer `name` (another than `TRAINER` brings its own `transport`)."""
        cfg = self.config
        first = name == TRAINER
        return TrainerContext(
            run_id=self.manifest.run_id,
            trainer_id=name,
            num_stages=self.manifest.num_stages,
            static=self.manifest.schedule == "static",
            router=self.router if first else type(self.router)(),
            transport=self.trainer if first else transport,
            replicas=self._trainer_replicas,
            all_replicas=self._trainer_replicas,
            wait_for_replica=asyncio.sleep,
            known_step=self.known_step if first else {},
            microbatch_timeout_s=cfg.microbatch_timeout_s,
            max_retries=cfg.max_retries,
            max_dropped_fraction=cfg.max_dropped_fraction,
            verify_replicas=cfg.verify_replicas,
            window=cfg.window,
            optimizer=self.manifest.optimizer,
            max_steps=self.manifest.max_steps,
        )

    async def step(self, microbatches: list[Microbatch]) -> StepResult:
        """One optimizer step over `microbatches` (inputs, named loss inputs); RunFinishedError
        once the run's last step (its manifest's max_steps) was applied."""
        result = await TrainerStep(self.trainer_context(), self.trainer_step, microbatches).run()
        self.trainer_step = result.step + 1
        return result

    async def score(self, x, loss_inputs: dict, *, step: int | None = None):
        """The loss's per-sample scores of one microbatch by a score pass through the swarm, on
        the parameters of `step` (default: the trainer's); see `scoring.score_pass`."""
        step = self.trainer_step if step is None else step
        return await score_pass(self.trainer_context(), step, x, loss_inputs)

    async def train(self, batches: Iterator, steps: int) -> list[StepResult]:
        """Up to `steps` steps over microbatches drawn from `batches`, as `Trainer.train` runs
        them: no more than the run has left, saying so (a log line) at its last step."""
        m = self.manifest
        results = []
        for _ in range(steps_to_run(m.run_id, self.trainer_step, steps, m.max_steps)):
            mbs = [loss_inputs_of(b) for b in itertools.islice(batches, m.batch.microbatches_per_step)]
            if len(mbs) < m.batch.microbatches_per_step:
                break  # the data ran out
            results.append(await self.step(mbs))
        if is_finished(self.trainer_step, m.max_steps):
            logger.info(last_step_message(m.run_id, m.max_steps))
        return results
