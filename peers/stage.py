"""The stage peer process: serves one pipeline stage of a run.

It joins the swarm, takes a stage (the one that needs a peer most, or `--stage`), downloads
its parameters and optimizer state from a live replica, and serves until stopped. What it
serves is the protocol in `swarmtrain.train` (`service.StageService`: forward and backward
work, the step commit, state downloads); this process wires it to a DHT node, a libp2p
transport and a real clock. Every heartbeat it announces its readiness and counters in the
DHT, reads the replicas of the next stage (where its hops go), catches up if it fell behind,
and may move to another stage when that raises swarm throughput (`placement.StageRebalancer`).
Networking runs on one asyncio loop; compute on one thread, in the schedule's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from functools import partial

import torch
from hivemind.utils import get_dht_time

import swarmtrain
from swarmtrain.errors import ConfigError
from swarmtrain.model import build_stage, resolve_builder
from swarmtrain.peers.checkpoints import (
    StageCheckpointer,
    bring_back,
    default_checkpoint_dir,
)
from swarmtrain.peers.faults import FaultInjector, SlowdownSource
from swarmtrain.peers.relayout import is_layout_state_request, relayout, serve_layout_state
from swarmtrain.peers.self_measure import (
    block_capacity,
    capacity,
    device_label,
    link_figures,
    memory_used_bytes,
)
from swarmtrain.peers.stage_config import StageConfig
from swarmtrain.schedule import (
    ReadinessQueue,
    ReadinessRouter,
    RoundRobinRouter,
    StaticQueue,
    in_flight_budget,
)
from swarmtrain.schedule.runtime import ComputeScheduler
from swarmtrain.swarm import SwarmNode, fresher_view, stage_replicas
from swarmtrain.train.authority import RunAuthority, StepClaims
from swarmtrain.train.context import StageContext
from swarmtrain.train.layout import await_first_layout
from swarmtrain.train.placement import choose_stage, stage_memory_figures, stages_that_fit
from swarmtrain.train.run_length import finished_message, is_finished
from swarmtrain.train.service import StageService
from swarmtrain.train.serving import ServeCounters
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.trust.records import open_member_proof
from swarmtrain.wire.keys import MANIFEST_TTL_S, peers_key
from swarmtrain.wire.records import MAX_BANNED_LISTED, PeerRecord, RunManifest

logger = logging.getLogger(__name__)

MANIFEST_REPUBLISH_S = 10.0
"""Seconds between a stage peer's republications of the run manifest (as coordinators do)."""


class StagePeer:
    """Serve one stage until stopped. `run()` blocks; `stop()` may be called from any thread."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.node: SwarmNode | None = None
        self.manifest: RunManifest | None = None
        self.stage: int = -1
        self.state = "joining"
        self.counters = ServeCounters()
        self.service: StageService | None = None
        self._since = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._beat_soon = self._resync = None  # the tasks of heartbeat_soon and resync_soon
        self.capacity: dict = {}
        self._rebalancer = None
        self._role_checker = None
        self.switch_role: str | None = None
        """Set when the peer left its stage to take another role (`--role auto`): 'rollout'."""
        self._memory: list[tuple[int, int]] = []
        self.layout_snapshot = None
        """Its stage's state when it last moved to another layout (`relayout.LayoutSnapshot`)."""
        self.moves = 0
        self.checkpoints: StageCheckpointer | None = None
        self.restored_from: int | None = None
        """The checkpoint step this peer brought its lost stage back from."""
        self.scheduler: ComputeScheduler | None = None
        self.router: ReadinessRouter | None = None
        self._replicas: dict[int, list[str]] = {}
        self._records: list[PeerRecord] = []
        self._members: dict[str, int] = {}  # peer id -> the stage it is a member of (any state)
        self._claims = StepClaims(lambda: self.manifest.trainers or None)  # None: an open run
        self._slowdown = SlowdownSource(config.slowdown, config.slowdown_file)
        self._faults = FaultInjector(config.fault)
        self.on_serving = lambda: None
        """Called once the peer is announced and takes requests (serving or standing by)."""
        self.on_waiting = lambda message: logger.info("%s", message)
        """Called with a line for people while the peer waits for its run's first layout."""
        self.on_finished = lambda message: logger.info("%s", message)
        """Called with a line for people once the peer applied the run's last step, as it leaves."""

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    # lifecycle

    def run(self) -> None:
        asyncio.run(self.serve())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def serve(self) -> None:
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.node = SwarmNode(cfg.node)
        try:
            await self._serve(self.node)
        finally:
            if self.scheduler is not None:
                self.scheduler.close()
            self.node.shutdown()

    async def _serve(self, node: SwarmNode) -> None:
        cfg = self.config
        self.manifest = manifest = node.require_manifest(cfg.run_id)
        # Anyone may write the manifest: its model passes this peer's own allowance before anything
        # builds it. Once admitted it resolves by name (placement's cost tracing builds it too).
        resolve_builder(manifest.model, cfg.models, named_by=f"the manifest of run {manifest.run_id!r}")
        probe = partial(
            capacity,
            cfg.device,
            seconds=cfg.probe_s,
            is_spot=cfg.is_spot,
            max_memory_bytes=cfg.max_memory_bytes,
            slowdown=cfg.slowdown,
        )
        self.capacity = await self._loop.run_in_executor(None, probe)  # alone: it times compute
        self.capacity.update(
            await self._loop.run_in_executor(
                None, partial(block_capacity, manifest, cfg.device, slowdown=cfg.slowdown, dtype=cfg.dtype)
            )
        )
        self.capacity.update(cfg.announce)
        if manifest.layout_version == 0:  # the coordinator plans the stages from the peers that come
            self.manifest = manifest = await self._await_first_layout(manifest)
            if manifest.layout_version == 0:
                return  # stopped while waiting
        self._memory = await self._loop.run_in_executor(None, stage_memory_figures, manifest)
        fits = stages_that_fit(manifest, self._memory, cfg.max_memory_bytes)
        if cfg.stage is not None and manifest.stage_span(cfg.stage) and not fits[cfg.stage]:
            state, act = self._memory[cfg.stage]
            need = state + manifest.batch.max_in_flight * act
            raise ConfigError(
                f"stage {cfg.stage} needs about {need / 2**20:.1f} MiB, more than --max-memory "
                f"{cfg.max_memory_bytes / 2**20:.1f} MiB: pick another --stage or raise --max-memory"
            )
        planned = manifest.assignments.get(self.peer_id)
        if cfg.stage is None and planned is not None and fits[planned]:
            self.stage = planned  # the layout was planned with this peer on it
        elif cfg.stage is None:
            records = await node.peers_async(manifest.run_id)
            self.stage = choose_stage(manifest, records, fits, self.capacity, peer_id=self.peer_id)
        else:
            self.stage = cfg.stage
        start, end = manifest.stage_span(self.stage)
        self.checkpoints = StageCheckpointer(
            cfg.checkpoint_dir or default_checkpoint_dir(), manifest, keep=cfg.checkpoint_keep
        )
        self.router = RoundRobinRouter() if manifest.schedule == "static" else ReadinessRouter()
        self.transport = TensorTransport(await node.p2p(), cfg.transport, swarm_key=node.swarm_key)
        if cfg.device.startswith("cuda"):  # compressed activations and gradients decode on the GPU
            self.transport.decode_device = torch.device(cfg.device)
        self._take_stage(self.stage)
        if cfg.rebalance_s > 0:
            from swarmtrain.train.placement import StageRebalancer

            self._rebalancer = StageRebalancer(manifest, patience=cfg.rebalance_patience)
            if cfg.auto_role and manifest.rl is not None:
                from swarmtrain.rl.roles import RoleChecker

                self._role_checker = RoleChecker(manifest, tasks=cfg.tasks, patience=cfg.rebalance_patience)
        await self._heartbeat()  # a member of its stage (joining): its replicas hand it their state
        await self._sync_from_replica()
        records = await self.node.peers_async(self.manifest.run_id)  # the planner's network term:
        others = [r.peer_id for r in records if r.role == "stage" and r.peer_id != self.peer_id][:3]
        if others:  # RTT and bandwidth to a few stage peers
            self.capacity.update(await link_figures(self.transport, others, self.manifest.run_id))
        await self.refresh_replicas()
        # the service is replaced when the peer moves: look it up for every request
        await self.transport.serve(handler_name(manifest.run_id), self._handle)
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: stop() is the way out
                self._loop.add_signal_handler(sig, self._stop.set)
        self._since = get_dht_time()
        self.state = "serving"
        await self._heartbeat()
        blocks = f"blocks {start}-{end - 1}"
        logger.info(
            "serving stage %d (%s) of run %s as %s", self.stage, blocks, manifest.run_id, self.peer_id
        )
        self.on_serving()
        beats = asyncio.create_task(self._heartbeats())
        await self._stop.wait()
        if self.state != "finished":  # a finished replica has nothing in flight, nor will have
            await self._drain()
        for task in (beats, self._beat_soon):
            if task is not None:
                task.cancel()
        await asyncio.gather(beats, *([self._beat_soon] if self._beat_soon else []), return_exceptions=True)

    async def _handle(self, frame, caller: str):
        """A request to this peer: a layout move's state request (`relayout`), else the service's."""
        layout = is_layout_state_request(frame)
        if layout is not None and frame.run_id == self.manifest.run_id:
            return await serve_layout_state(self, frame, caller, layout)
        return await self.service.handle(frame, caller)

    async def _await_first_layout(self, manifest: RunManifest) -> RunManifest:
        """Announce this peer, measured, as a candidate of the run's first layout and wait until
        the coordinator publishes it (`layout.await_first_layout`)."""
        record = PeerRecord(
            peer_id=self.peer_id,
            role="candidate",
            state="joining",
            device=device_label(self.config.device),
            version=swarmtrain.__version__,
            capacity=self.capacity,
        )
        return await await_first_layout(
            self.node, manifest, record, stop=self._stop, ttl_s=self.config.ttl_s,
            heartbeat_s=self.config.heartbeat_s, on_waiting=self.on_waiting,
        )  # fmt: skip

    def _take_stage(self, stage: int) -> None:
        """Build `stage`'s blocks (from the run seed), its optimizer and its compute queue."""
        manifest = self.manifest
        start, end = manifest.stage_span(stage)
        module = build_stage(
            manifest.model,
            manifest.model_config,
            start,
            end,
            num_blocks=manifest.num_blocks,
            seed=manifest.seed,
            loss=manifest.loss,
            device=self.config.device,
            sources=self.config.models,
        )
        self.stage = stage
        self.runner = runner = StageRunner(
            module,
            manifest.optimizer,
            microbatch_size=manifest.batch.microbatch_size,
            max_steps=manifest.max_steps,
            versions=self.config.versions,
            compute_dtype=self.config.dtype,
        )
        state_bytes, act_bytes = self._memory[stage]
        free = float(self.capacity.get("memory_bytes", 2**34)) - state_bytes
        self.budget = in_flight_budget(free, act_bytes)
        policy = StaticQueue() if manifest.schedule == "static" else ReadinessQueue(self.budget)
        if self.scheduler is not None:
            self.scheduler.close()
        self.scheduler = ComputeScheduler(
            policy,
            holding=lambda: runner.num_pending,
            fused_last=stage == manifest.num_stages - 1,
            slowdown=self._slowdown.current,
            before_task=self._faults.before_task,
        )
        self.service = StageService(
            StageContext(
                run_id=manifest.run_id,
                peer_id=self.peer_id,
                stage=stage,
                num_stages=manifest.num_stages,
                runner=runner,
                scheduler=self.scheduler,
                router=self.router,
                transport=self.transport,
                compression=manifest.compression,
                replicas=lambda k: self._replicas.get(k, []),
                refresh=self.refresh_replicas,
                link_bandwidth=self._bandwidth_to,
                membership_proof=lambda: self.node.membership_proof(manifest.run_id),
                authority=RunAuthority(
                    trainers=self._claims.trainers,
                    stage_of=lambda peer: self._members.get(peer),
                    refresh=self.refresh_replicas,
                    prove=self._take_proof,
                    owner=lambda: self.node.owner_of(manifest.run_id),
                    weight_readers=lambda: manifest.weight_readers,
                ),
                is_draining=lambda: self.state != "serving",
                on_behind=self.resync_soon,
                on_applied=self._on_applied,
                checkpoint_state=lambda step: self.checkpoints.state_at(
                    stage, step, list(runner.named_params)
                ),
                on_relayout=lambda step, layout: relayout(self, step, layout),
            ),
            self.counters,
        )

    async def _switch_stage(self, stage: int) -> None:
        """Move to `stage`: drain, take its blocks and a live replica's state, serve again."""
        old = self.stage
        self.state = "draining"
        await asyncio.wait_for(self._heartbeat(), timeout=self.config.ttl_s)
        await self._wait_idle(self.config.drain_timeout_s)
        self._take_stage(stage)
        self.state = "joining"  # a member of its new stage: its replicas hand it their state
        await asyncio.wait_for(self._heartbeat(), timeout=self.config.ttl_s)
        await self._sync_from_replica()
        await self.refresh_replicas()
        self._since, self.state = get_dht_time(), "serving"
        await self._heartbeat()
        self.moves += 1
        logger.warning("moved from stage %d to stage %d to raise swarm throughput", old, stage)

    async def _wait_idle(self, timeout_s: float) -> None:
        """Wait until no microbatch is in flight here and leaving loses no gradient: the step was
        exchanged or applied (here, or by replicas that went on without this one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            runner, ahead = self.runner, await self._live_replicas(self._records)  # read every heartbeat
            moved_on = any(r.step > runner.step for r in ahead)
            loses = runner.has_gradients and not self.service.commit.exchanged and not moved_on
            if not self.service.in_flight and not loses:
                return
            await asyncio.sleep(0.05)

    async def _drain(self) -> None:
        """Stop taking new work, let in-flight microbatches and their commit finish, leave."""
        self.state = "draining"
        try:
            await asyncio.wait_for(self._heartbeat(), timeout=2.0)
        except Exception as e:  # leaving anyway: the TTL will retire our record
            logger.warning("could not announce draining: %r", e)
        await self._wait_idle(self.config.drain_timeout_s)
        await self.checkpoints.wait()
        logger.info("stage %d left the swarm (%d microbatches served)", self.stage, self.counters.served)

    def record(self) -> PeerRecord:
        banned = sorted(self.router.bans.banned(time.monotonic()))[:MAX_BANNED_LISTED]
        return PeerRecord(
            peer_id=self.peer_id,
            role="stage",
            stage=self.stage,
            state=self.state,
            device=device_label(self.config.device),
            version=swarmtrain.__version__,
            served=self.counters.served,
            step=self.runner.step,
            capacity=self.capacity,
            since=self._since,
            checkpoints=self.checkpoints.held(self.stage),
            **self.scheduler.readiness(),  # queue_depth, backlog_s, service_s, holding
            in_flight_budget=self.budget,
            memory_used_bytes=memory_used_bytes(self.config.device),
            busy_s=self.scheduler.busy_s,
            exchange_s=self.service.commit.exchange_s,
            replayed=self.counters.replayed,
            failed=self.counters.failed,
            banned=tuple(banned),
            bytes_sent=self.transport.bytes_sent,
            bytes_received=self.transport.bytes_received,
            raw_bytes_sent=self.transport.raw_bytes_sent,
            layout=self.manifest.layout_version,
        )

    async def _heartbeat(self) -> None:
        await self.node.announce_async(self.manifest.run_id, self.record(), ttl_s=self.config.ttl_s)

    def heartbeat_soon(self) -> None:
        self._beat_soon = asyncio.create_task(self._heartbeat())

    def _on_applied(self) -> None:
        """A step was applied: checkpoint it if due; announce the new step, or leave if it was the
        run's last (checkpointed whatever the cadence: the run's result)."""
        last = is_finished(self.runner.step, self.manifest.max_steps)
        self.checkpoints.after_apply(self.runner, self.scheduler, self.stage, force=last)
        if is_finished(self.runner.step, self.manifest.max_steps) and self.state == "serving":
            self.state = "finished"
            self._beat_soon = asyncio.create_task(self._finish())  # its last announcement
        else:
            self.heartbeat_soon()

    async def _finish(self) -> None:
        """This replica applied the run's last step: announce the state 'finished', say so, and
        stop (`run()` returns; `swarmtrain join` exits with code 0)."""
        try:
            await asyncio.wait_for(self._heartbeat(), timeout=self.config.ttl_s)
        except Exception as e:  # leaving anyway: the TTL will retire our record
            logger.warning("could not announce the finished run: %r", e)
        await self.checkpoints.wait()
        self.on_finished(finished_message(self.manifest.run_id, self.runner.step))
        self._stop.set()

    def resync_soon(self) -> None:
        """Work of a later step arrived: this replica fell behind; catch up once idle."""
        if self._resync is None or self._resync.done():
            self._resync = asyncio.create_task(self._resync_when_idle())

    async def _resync_when_idle(self) -> None:
        for _ in range(100):
            if await self._resync_if_behind() or not self.runner.has_gradients:
                return
            await asyncio.sleep(0.1)

    # routing

    async def refresh_replicas(self, wait_s: float = 0.0) -> None:
        """Re-read the swarm's serving peers (after `wait_s`); their readiness feeds the router."""
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        read = await self.node.peers_async(self.manifest.run_id)
        self._records = fresher_view(self._records, read, self.peer_id)  # a read may come back partial
        self._members = {r.peer_id: r.stage for r in self._records if r.role == "stage"}
        by_stage = stage_replicas(self._records, self.manifest.layout_version)
        self._replicas = {
            k: [r.peer_id for r in rs if r.peer_id != self.peer_id] for k, rs in by_stage.items()
        }
        now = time.monotonic()
        for rs in by_stage.values():
            for r in rs:
                self.router.report(
                    r.peer_id, backlog_s=r.backlog_s, service_s=r.service_s, now=now, from_reply=False
                )
        self.router.forget({r.peer_id for r in self._records})

    def _take_proof(self, caller: str, proof) -> bool:
        """Take `caller`'s membership proof (its signed peer record, carried by its forward) into
        this peer's view of the run if it holds; True if it did (`RunAuthority.prove`)."""
        try:
            body = open_member_proof(
                proof, key=peers_key(self.manifest.run_id), signer=caller, now=get_dht_time()
            )
            record = PeerRecord.from_dict(body)
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            logger.warning("membership proof from %s refused: %s", caller[-8:], e)
            return False
        if record.peer_id != caller or record.role != "stage":
            logger.warning(
                "membership proof from %s is a %s record of %s", caller[-8:], record.role, record.peer_id[-8:]
            )
            return False
        logger.info("took %s's membership proof: stage %d", caller[-8:], record.stage)
        self._records = fresher_view(self._records, [record], self.peer_id)
        self._members[caller] = record.stage
        return True

    def _bandwidth_to(self, peer: str) -> float | None:
        """Measured bytes/s to `peer` (its link probe), else this peer's median link."""
        view = self.router.views.get(peer)
        return (view.bandwidth_bytes_per_s if view else None) or self.capacity.get("bandwidth_bytes_per_s")

    async def _live_replicas(self, records: list[PeerRecord] | None = None) -> list[PeerRecord]:
        """Other serving replicas of this stage, furthest step first (from `records`, or a fresh read)."""
        if records is None:
            records = await self.node.peers_async(self.manifest.run_id)
        replicas = stage_replicas(records, self.manifest.layout_version).get(self.stage, [])
        others = [r for r in replicas if r.peer_id != self.peer_id]
        return sorted(others, key=lambda r: -r.step)

    async def _sync_from_replica(self) -> bool:
        """Take parameters and optimizer state from a live replica, those at a committed step first
        (`StepClaims`). When none gives them (none is announced, or those announced are dead: a
        record outlives its peer by up to a TTL) the stage is new or lost (`bring_back`): a run's
        seed initialisation is never kept by default. True if a state was taken."""
        replicas = await self._live_replicas()
        points = await self.node.trainer_points_async(self.manifest.run_id)
        if replicas and await self.service.take_state(self._claims.join_from(replicas, points)) is not None:
            return True
        return await bring_back(self, points)

    async def _resync_if_behind(self) -> bool:
        """A replica that missed a step (it joined mid-step, or left a commit) catches up when
        idle, to a step an authorized trainer committed (a record's step is only its claim)."""
        runner = self.runner
        replicas = await self._live_replicas(self._records)  # refreshed with every heartbeat
        behind = replicas and replicas[0].step > runner.step
        if not behind or self.service.in_flight or runner.num_pending or runner.has_gradients:
            return False
        points = await self.node.trainer_points_async(self.manifest.run_id)
        sources = self._claims.resync_from(replicas, runner.step, points)
        return bool(sources) and await self.service.take_state(sources) is not None

    async def _heartbeats(self) -> None:
        last_check = last_manifest = time.monotonic()
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if time.monotonic() - last_manifest >= MANIFEST_REPUBLISH_S:
                # The coordinator is no master: once it is gone, the serving peers keep the
                # run's manifest alive so new peers can still join.
                last_manifest = time.monotonic()
                try:
                    await self.node.republish_manifest_async(self.manifest, ttl_s=MANIFEST_TTL_S)
                except Exception as e:
                    logger.warning("republishing the manifest failed: %r", e)
            if self._rebalancer is not None and time.monotonic() - last_check >= self.config.rebalance_s:
                last_check = time.monotonic()
                try:
                    records = await self.node.peers_async(self.manifest.run_id)
                    target = self._rebalancer.check(self.peer_id, records)
                    if target is not None:
                        await self._switch_stage(target)
                    elif self._role_checker is not None and self.state == "serving":
                        role = self._role_checker.check(self.peer_id, records)
                        if role is not None:
                            logger.info(
                                "leaving stage %d to take the %s role the run's planner gives",
                                self.stage,
                                role,
                            )
                            self.switch_role = role
                            self._stop.set()
                except Exception as e:  # a failed check or move must not stop serving
                    logger.warning("rebalancing failed: %r", e)
            try:
                await asyncio.wait_for(self._heartbeat(), timeout=self.config.ttl_s)
                await asyncio.wait_for(self.refresh_replicas(), timeout=self.config.ttl_s)
                await asyncio.wait_for(self._resync_if_behind(), timeout=10 * self.config.ttl_s)
            except Exception as e:  # a DHT hiccup must not stop serving
                logger.warning("heartbeat failed: %r", e)
