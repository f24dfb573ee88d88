"""The trainer: owns the data, pushes microbatches into stage 0, steps the stages.

One optimizer step takes `microbatches_per_step` microbatches, a window of them in flight at
once (grown while throughput grows, halved on timeouts), then commits every stage so that
each microbatch's gradient counts exactly once (the protocol is
`swarmtrain.train.step.TrainerStep`; this process gives it a DHT view and a transport).
Several trainers may feed one run, each its shard of every step (`TrainerConfig.shard`); each
step one of them commits and the others report to it, and any of them may die
(`swarmtrain.train.team`; this trainer serves the others and announces itself:
`trainer_presence`).
Every microbatch is accounted for: completed, or dropped with a cause; replays are counted
by cause; `Trainer.totals` keeps the counts, and each step's are in its StepResult.

`Trainer` is a sync facade over a private event loop on a background thread, so it can be
driven from a plain Python loop over the user's own data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch
from hivemind.utils import get_dht_time

from swarmtrain.errors import BadFrameError, PeerUnreachableError, RemoteError
from swarmtrain.model import ModelSources, SwarmModel
from swarmtrain.model.param_names import model_from_states
from swarmtrain.model.registry import NO_IMPORTS
from swarmtrain.peers.faults import CallFault
from swarmtrain.peers.trainer_config import TrainerConfig, check_authorized, shard_of
from swarmtrain.peers.trainer_layout import follow_layout, plan_layout
from swarmtrain.peers.trainer_presence import TrainerPresence
from swarmtrain.plan import LayoutGate
from swarmtrain.schedule import InFlightWindow, ReadinessRouter, RoundRobinRouter, WindowConfig
from swarmtrain.swarm import SwarmNode, stage_replicas
from swarmtrain.train.authority import claim_limit, committed_step, read_points
from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.layout import wait_for_layout
from swarmtrain.train.rollback import RollbackNeeded, RollbackPlan, plan_rollback
from swarmtrain.train.run_length import (
    RunFinishedError,
    finished_error,
    is_finished,
    last_step_message,
    run_is_over,
    steps_to_run,
)
from swarmtrain.train.scoring import score_pass
from swarmtrain.train.shards import ShardFeed
from swarmtrain.train.step import StepFailedError, StepResult, TrainerContext, TrainerStep
from swarmtrain.train.team import Team
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import Rollback
from swarmtrain.wire.metrics import RLPoint, TrainerPoint
from swarmtrain.wire.records import MAX_BANNED_LISTED, RunManifest

logger = logging.getLogger(__name__)

WAIT_NOTE_FIRST_S = 3.0
"""A trainer waiting for stage peers says so after this long (a swarm still starting up is
normally done by then) and every `WAIT_NOTE_EVERY_S` after."""
WAIT_NOTE_EVERY_S = 10.0

ROLLBACK_TIMEOUT_S = 120.0
"""Longest wait for one replica to take its checkpoint and go back (it may download it)."""
REFRESH_S = 1.0
"""How old the trainer's view of the serving replicas may get before it reads the DHT again."""

__all__ = [
    "RLSource",
    "RunFinishedError",
    "StepFailedError",
    "StepResult",
    "Trainer",
    "TrainerConfig",
    "check_authorized",
]


@runtime_checkable
class RLSource(Protocol):
    """Microbatches of an RL run (`swarmtrain.rl.feed.RolloutFeed`): a trainer fed by one
    publishes what each step trained on with the step's point, and lists the rollout peers it
    banned in its peer record."""

    banned: dict[str, str]
    """Rollout peers banned from the run, with why."""

    def rl_point(self, step: int, seconds: float) -> RLPoint:
        """What step `step`, which took `seconds`, trained on, and the counts so far."""
        ...


class Trainer:
    """Train a run from Python: `for result in trainer.train(batches, steps=100): ...`."""

    def __init__(self, config: TrainerConfig):
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trainer-loop", daemon=True)
        self._thread.start()
        self.node = SwarmNode(config.node)
        try:
            self.manifest: RunManifest = self.node.require_manifest(config.run_id)
            if self.manifest.layout_version == 0:  # trainers wait for the stages the peers that come make
                self.manifest = wait_for_layout(
                    lambda: self.node.get_manifest(self.manifest.run_id), self.manifest, who="this trainer"
                )
            check_authorized(self.manifest, self.node.peer_id)
            self.shard = shard_of(config, self.manifest, self.node.peer_id)
            self.transport = self._run(self._make_transport())
        except BaseException:
            self.close()
            raise
        self.step = 0
        self.layout_moves: list[tuple[int, int, float]] = []
        """(step, layout version, seconds training paused) of each layout move this trainer made."""
        self.failed_layouts: set[int] = set()
        """Layout versions a move to failed (and was undone): not tried again."""
        self.layout_checked = -math.inf
        """When (monotonic) this trainer last read the run's layout (`follow_layout`)."""
        self.replan_checked = time.monotonic()
        """When this trainer last re-planned the run's layout (`plan_layout`)."""
        self.layout_gate = LayoutGate(self.manifest.replan)
        self.replan_costs = None
        """The run's per-block costs for re-planning, once traced; False: this trainer cannot."""
        self.trainer_id = self.node.peer_id  # in full: stage 0 checks its microbatch ids against it
        self.known_step: dict[str, int] = {}
        self._published = None
        self.handler = handler_name(self.manifest.run_id)
        self.router = RoundRobinRouter() if self.manifest.schedule == "static" else ReadinessRouter()
        batch = self.manifest.batch
        self.window = InFlightWindow(
            config.window
            or WindowConfig(
                initial=min(batch.max_in_flight, batch.microbatches_per_step),
                max_size=batch.microbatches_per_step,
            )
        )
        self._replicas: dict[int, list[str]] = {}
        self._replicas_at = -1.0
        self.totals = Counter()
        """completed, replayed, dropped: microbatches since the trainer started."""
        self.presence = TrainerPresence(self.node, self.manifest.run_id)
        self.team = Team(
            self._context(),
            shard=self.shard,
            total=batch.microbatches_per_step,
            members=self.presence.members,
            authorized=lambda peer: not self.manifest.trainers or peer in self.manifest.trainers,
            wait_s=config.microbatch_timeout_s * (config.max_retries + 1),
        )
        self._run(self.transport.serve(self.handler, self.team.handle))

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def submit(self, coro) -> concurrent.futures.Future:
        """Run `coro` on the trainer's event loop (where its node and transport live) in the
        background; returns its future (a data source such as `RolloutFeed` pumps requests so)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def score(
        self, x: torch.Tensor, loss_inputs: dict[str, torch.Tensor], *, step: int | None = None
    ) -> torch.Tensor:
        """The run's loss's per-sample scores of one microbatch on the stages' parameters of
        `step` (default: the trainer's), by a score pass through the pipeline
        (`swarmtrain.train.scoring`): forward only, counted in no step. Raises RemoteError when
        a stage refuses it (it is at another step), ScoreFailedError when it cannot complete."""
        return self._run(self.score_async(x, loss_inputs, step=step))

    async def score_async(
        self, x: torch.Tensor, loss_inputs: dict[str, torch.Tensor], *, step: int | None = None
    ) -> torch.Tensor:
        """`score`, as a coroutine on the trainer's event loop."""
        return await score_pass(self._context(), self.step if step is None else step, x, loss_inputs)

    async def _make_transport(self) -> TensorTransport:
        transport = TensorTransport(
            await self.node.p2p(), self.config.transport, swarm_key=self.node.swarm_key
        )
        CallFault(self.config.fault).wrap(transport)
        return transport

    def close(self) -> None:
        """Close the streams, then the DHT node; safe to call twice."""
        if self._loop.is_closed():
            return
        if getattr(self, "_published", None) is not None:  # let the last step's point reach the DHT
            try:
                self._published.result(timeout=5)
            except Exception as e:
                logger.debug("last trainer point not published: %r", e)
        try:
            self._run(self._aclose(), timeout=10)
        except Exception as e:
            logger.debug("trainer close: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        if hasattr(self, "node"):
            self.node.shutdown()

    async def _aclose(self) -> None:
        if hasattr(self, "node"):
            await self.node.close_p2p()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # routing

    def _step_of(self, record) -> int:
        return max(record.step, self.known_step.get(record.peer_id, -1))

    async def replicas(self, *, refresh: bool = False, wait_for_all: bool = False) -> dict[int, list[str]]:
        """The serving replicas of each stage at the trainer's step, read again when over REFRESH_S old."""
        if wait_for_all:
            self._replicas = await self._replicas_at_step()
            self._replicas_at = time.monotonic()
        elif refresh or time.monotonic() - self._replicas_at > REFRESH_S:
            self._replicas = await self._replicas_at_step(wait=False)
            self._replicas_at = time.monotonic()
            gap = any(not self._replicas.get(k) for k in range(self.manifest.num_stages))
            if gap and (plan := await self._rollback_plan()):  # a stage was lost mid-step
                raise RollbackNeeded(plan)
        return self._replicas

    async def wait_for_replica(self, max_wait_s: float) -> None:
        """Every replica of stage 0 is banned or gone: wait for the first ban to end (at most
        `max_wait_s`, at least a moment), then look again."""
        delay = self.router.bans.next_unban(self._replicas.get(0, []), time.monotonic())
        await asyncio.sleep(min(delay or max_wait_s, max(max_wait_s, 1.0)))
        await self.replicas(refresh=True)

    async def _replicas_at_step(
        self, stages: list[int] | None = None, *, step: int | None = None, wait: bool = True
    ) -> dict[int, list[str]]:
        """Serving replicas of each of `stages` (default: all) at `step` (default: the trainer's;
        -1: any step).

        Waits up to wait_for_stages_s for every stage asked for to have one. A replica whose
        record is a heartbeat behind counts if its last commit reply said it is at `step`;
        a replica that never served counts too (a fresh peer adopts the run's step).
        """
        stages = list(range(self.manifest.num_stages)) if stages is None else stages
        step = self.step if step is None else step
        started = time.monotonic()
        deadline, next_note = started + self.config.wait_for_stages_s, started + WAIT_NOTE_FIRST_S
        while True:
            by_stage = stage_replicas(
                await self.node.peers_async(self.manifest.run_id), self.manifest.layout_version
            )
            eligible = {  # a fresh peer (the seed's state, never served) adopts the run's step
                k: [
                    r.peer_id
                    for r in by_stage.get(k, [])
                    if self._step_of(r) == step or r.served == r.step == 0 or step < 0
                ]
                for k in stages
            }
            missing = [k for k in stages if not eligible[k]]
            if not missing or not wait:
                return eligible
            if plan := await self._rollback_plan():
                raise RollbackNeeded(plan)
            now = time.monotonic()
            if now >= next_note and now <= deadline:  # a wait the user sees, with what would end it
                next_note = now + WAIT_NOTE_EVERY_S
                logger.warning(
                    "waiting for a peer to serve stage(s) %s of run %r (%.0f s of %.0f s): start one with %s",
                    ", ".join(map(str, missing)),
                    self.manifest.run_id,
                    now - started,
                    self.config.wait_for_stages_s,
                    self._join_hint(missing),
                )
            if now > deadline:
                seen = "; ".join(
                    f"stage {k} has replicas at steps {sorted(r.step for r in by_stage[k])}"
                    for k in missing
                    if k in by_stage
                )
                at = f" at step {step}" if step >= 0 else ""
                raise StepFailedError(
                    f"no peer serves stage(s) {', '.join(map(str, missing))} of run {self.manifest.run_id!r}"
                    f"{at}{' (' + seen + ')' if seen else ''}: "
                    f"start one with {self._join_hint(missing)}"
                )
            await asyncio.sleep(0.25)

    def _join_hint(self, missing: list[int]) -> str:
        """The command that would end a wait for stage peers of `missing` stages."""
        peers = self.config.node.initial_peers
        address = peers[0] if peers else "ADDR"
        stage = str(missing[0]) if len(missing) == 1 else "K"
        return f"`swarmtrain join --initial-peers {address} --run-id {self.manifest.run_id} --stage {stage}`"

    async def _rollback_plan(self) -> RollbackPlan | None:
        """The rollback a lost stage calls for, None if none (`swarmtrain.train.rollback`)."""
        records = await self.node.peers_async(self.manifest.run_id)
        steps = {
            k: [self._step_of(r) for r in rs]
            for k, rs in stage_replicas(records, self.manifest.layout_version).items()
        }
        m = self.manifest
        return plan_rollback(steps, records, self.step, m.num_stages, stage_only=m.restore_lost_stage_only)

    async def _roll_back(self, plan: RollbackPlan) -> None:
        """Send every serving replica of every stage the rollback; go on as `plan.step`."""
        logger.warning("%s", plan.describe())
        by_stage = stage_replicas(
            await self.node.peers_async(self.manifest.run_id), self.manifest.layout_version
        )

        async def one(stage: int, peer: str) -> None:
            meta = Rollback(
                checkpoint=plan.checkpoint_for(stage), sources=plan.sources.get(stage, ())
            ).to_meta()
            frame = Frame(kind="step", run_id=self.manifest.run_id, stage=stage, step=plan.step, meta=meta)
            try:
                reply = await self.transport.call(peer, self.handler, frame, timeout_s=ROLLBACK_TIMEOUT_S)
                self.known_step[peer] = reply.step
            except (RemoteError, PeerUnreachableError, BadFrameError) as e:
                logger.warning("replica %s of stage %d did not roll back: %s", peer[-8:], stage, e)

        await asyncio.gather(*(one(k, r.peer_id) for k, rs in by_stage.items() for r in rs))
        self.step = plan.step
        # the step before the one the run goes on as counts as done: a replica that missed the
        # rollback is behind, and may catch up from one that did not (`authority.claim_limit`)
        self._publish_point(plan.step - 1, float("nan"), 0.0, 0, rolled_back=plan.describe())

    def route(self) -> list[str]:
        """One serving peer per stage (the earliest replica), waiting up to wait_for_stages_s."""
        replicas = self._run(self._replicas_at_step())
        return [replicas[k][0] for k in range(self.manifest.num_stages)]

    async def _sync_step(self) -> None:
        """Start from the step the stages' replicas are at: the furthest one, but (a replica's
        answer is only its claim) no further than one past the furthest step a trainer the run
        authorizes reported committed, when one did."""
        by_stage = stage_replicas(
            await self.node.peers_async(self.manifest.run_id), self.manifest.layout_version
        )
        steps = [0]
        for stage, records in by_stage.items():
            for r in records:
                ping = Frame(kind="ping", run_id=self.manifest.run_id, stage=stage)
                try:
                    reply = await self.transport.call(
                        r.peer_id, handler_name(self.manifest.run_id), ping, timeout_s=10
                    )
                except (RemoteError, PeerUnreachableError, BadFrameError):
                    continue
                self.known_step[r.peer_id] = reply.step
                steps.append(reply.step)
        raw = await asyncio.get_running_loop().run_in_executor(
            None, self.node.trainer_points, self.manifest.run_id
        )
        committed = committed_step(read_points(raw), self.manifest.trainers or None)
        if committed is not None:
            steps = [s for s in steps if s <= claim_limit(committed)]
        self.step = max(steps)

    def fetch_states(self) -> list[dict[str, torch.Tensor]]:
        """The parameters of each stage's earliest replica, keyed like `swarmtrain.train.reference`."""
        return [self.fetch_state(k, p) for k, p in enumerate(self.route())]

    def fetch_model(self, sources: ModelSources = NO_IMPORTS) -> SwarmModel:
        """The run's whole model as the stages hold it now, built in this process on the CPU
        (`fetch_states`; the model's builder resolved under `sources`): after `train`, the
        trained model, e.g. an RL run's policy to evaluate. SwarmError if a stage's state is short."""
        return model_from_states(self.manifest, self.fetch_states(), sources)

    def fetch_state(self, stage: int, peer: str) -> dict[str, torch.Tensor]:
        """One replica's parameters, keyed like `swarmtrain.train.reference`."""

        async def fetch() -> dict[str, torch.Tensor]:
            frame = Frame(kind="state", run_id=self.manifest.run_id, stage=stage)
            reply = await self.transport.call(peer, handler_name(self.manifest.run_id), frame, timeout_s=60)
            return {
                k.removeprefix("param."): v.clone()
                for k, v in reply.tensors.items()
                if k.startswith("param.")
            }

        return self._run(fetch())

    def _publish(self, result: StepResult, rl: RLSource | None) -> None:
        """Announce the step's loss and speed under `{run}.trainers` (fire and forget); with an
        RL run's data source, what the step trained on too, and the rollout peers it banned."""
        point = None
        if rl is not None:
            point = rl.rl_point(result.step, result.seconds)
            banned = rl.banned.copy()  # in one piece: the feed bans on the event loop's thread
            self.presence.banned = tuple(sorted(banned))[:MAX_BANNED_LISTED]
        self._publish_point(result.step, result.loss, result.tokens_per_s, result.window, rl=point)

    def _publish_point(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        window: int,
        *,
        rolled_back: str = "",
        rl: RLPoint | None = None,
    ) -> None:
        point = TrainerPoint(
            trainer=self.node.peer_id,
            step=step,
            loss=loss,
            tokens_per_s=tokens_per_s,
            t=get_dht_time(),
            completed=self.totals["completed"],
            replayed=self.totals["replayed"],
            dropped=self.totals["dropped"],
            window=window,
            rolled_back=rolled_back,
            rl=rl,
        )
        self._published = self.node.publish_trainer_point(self.manifest.run_id, point, ttl_s=60)

    # training

    def _context(self) -> TrainerContext:
        cfg = self.config
        return TrainerContext(
            run_id=self.manifest.run_id,
            trainer_id=self.trainer_id,
            num_stages=self.manifest.num_stages,
            static=self.manifest.schedule == "static",
            router=self.router,
            transport=self.transport,
            replicas=self.replicas,
            all_replicas=lambda: self._replicas_at_step(step=-1, wait=False),
            wait_for_replica=self.wait_for_replica,
            known_step=self.known_step,
            microbatch_timeout_s=cfg.microbatch_timeout_s,
            max_retries=cfg.max_retries,
            max_dropped_fraction=cfg.max_dropped_fraction,
            verify_replicas=cfg.verify_replicas,
            window=self.window.size,
            optimizer=self.manifest.optimizer,
            max_steps=self.manifest.max_steps,
        )

    @property
    def finished(self) -> bool:
        """Whether this trainer applied the run's last step (its manifest's max_steps)."""
        return is_finished(self.step, self.manifest.max_steps)

    async def _check_not_over(self) -> None:
        """Raise RunFinishedError if the run applied its last step (`run_length.run_is_over`)."""
        m = self.manifest
        if not m.max_steps:
            return
        raw = await asyncio.get_running_loop().run_in_executor(None, self.node.trainer_points, m.run_id)
        committed = committed_step(read_points(raw), m.trainers or None)
        records = await self.node.peers_async(m.run_id)
        if run_is_over(m.max_steps, committed, records, self.node.owner_of(m.run_id)):
            raise finished_error(m.run_id, m.max_steps)

    def train(self, batches: Iterable, *, steps: int, run_order: bool = False) -> Iterator[StepResult]:
        """Run `steps` optimizer steps over microbatches drawn from `batches`; yield each result.

        Each item of `batches` is one microbatch with the run's microbatch size: (inputs,
        targets), or (inputs, {name: tensor}) naming every input the run's loss takes. The
        trainer feeds its shard's share of each step (all of it without a shard): drawn in
        order from `batches`, or, with `run_order`, from `batches` as the run's whole data
        order from its first microbatch (the shard's items only, from the run's step on: a
        trainer that restarts, or that the run went on without, never feeds data twice).
        A run with a step count (max_steps) stops at its last step, fewer than `steps` if
        that comes first (then `finished` is True, and the log says so). With an `RLSource`
        as `batches`, each step's published point carries what the step trained on.
        Raises StepFailedError when a step cannot complete, RunFinishedError when the run
        has no step left.
        """
        self._run(self._check_not_over())
        self._run(follow_layout(self, force=True))  # the run's newest layout, with its peers on it
        self._run(self._replicas_at_step(step=-1))  # a replica of every stage, at whatever step
        self._run(self._sync_step())
        steps = steps_to_run(self.manifest.run_id, self.step, steps, self.manifest.max_steps)
        m, shard = self.manifest.batch.microbatches_per_step, self.shard
        if run_order:
            feed = ShardFeed.from_run_order(batches, shard, m)
        else:
            feed = ShardFeed(batches, share=shard.share(m), first_step=self.step)
        rl = batches if isinstance(batches, RLSource) else None
        self.team.step, self.team.feeding = self.step, True
        self._run(self._join_team())
        try:
            for _ in range(steps):
                items = feed.take(self.step)
                if items is None:
                    return
                self._run(plan_layout(self))  # the lead trainer re-plans the run's layout
                self._run(follow_layout(self))  # a newer layout of the run: move the swarm to it first
                result = self._run_step([loss_inputs_of(item) for item in items])
                if result.rolled_back:
                    feed.relabel(result.step)
                self.step = result.step + 1
                self.totals.update(
                    completed=result.completed, replayed=result.replays, dropped=result.dropped
                )
                self.window.on_step(result.tokens_per_s, timeouts=result.timeouts)
                self._publish(result, rl)
                if self.finished:
                    logger.info(last_step_message(self.manifest.run_id, self.manifest.max_steps))
                yield result
        finally:
            self.team.feeding = False
            if not self._loop.is_closed():
                self._run(self.presence.stop())

    async def _join_team(self) -> None:
        """Announce this trainer; wait for `min_trainers` of the run (joining ones count)."""
        await self.presence.start()
        if self.config.min_trainers > 1:
            await self.presence.wait_for(self.config.min_trainers, self.config.wait_for_stages_s)
        await self.presence.announce("serving", self.step)

    def _run_step(self, microbatches: list) -> StepResult:
        """This trainer's share of its step, rolling the run back first when a lost stage
        came back from a checkpoint (before the step, or found during it)."""
        m = self.manifest.batch.microbatches_per_step
        rolled_back = None
        while True:
            plan = rolled_back is None and self._run(self._rollback_plan())
            if plan:  # a lost stage came back from a checkpoint: go back with it first
                self._run(self._roll_back(plan))
                rolled_back = plan
            self.presence.step = self.step
            own = TrainerStep(
                self._context(), self.step, microbatches, positions=self.shard.positions(m), total=m
            )
            try:
                result = self._run(self.team.run_step(own))
                break
            except (RollbackNeeded, StepFailedError) as e:  # a stage was lost during the step
                plan = e.plan if isinstance(e, RollbackNeeded) else self._run(self._rollback_plan())
                if plan is None:
                    raise
                if rolled_back is not None:
                    raise StepFailedError(f"step {self.step}: {e} again, right after a rollback") from None
                self._run(self._roll_back(plan))
                rolled_back = plan
        return result if rolled_back is None else replace(result, rolled_back=rolled_back.describe())
