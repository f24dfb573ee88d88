"""The stage peer process: serves one pipeline stage of a run.

A forward request carries a microbatch and the route (the peer of every stage, chosen by
the trainer). The stage runs its blocks, sends the output straight to the next stage's
peer and waits for that call's reply, which carries the gradient of the output; then it
runs backward and replies upstream with the gradient of its input. The last stage computes
the loss and starts backward. So forward chains peer to peer and gradients come back along
the recorded path: the open calls themselves.

Compute runs on one worker thread, off the event loop; networking stays on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import time
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time

import swarmtrain
from swarmtrain.errors import BadFrameError, ConfigError, PeerUnreachableError, RemoteError
from swarmtrain.model import build_stage
from swarmtrain.peers.planning import choose_stage, stage_memory_bytes
from swarmtrain.swarm import NodeConfig, SwarmNode, stage_replicas
from swarmtrain.train.averaging import GradientInbox, group_sum
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.transport import TensorTransport, TransportConfig, handler_name
from swarmtrain.wire.frames import Frame, error_frame
from swarmtrain.wire.records import PeerRecord, RunManifest

logger = logging.getLogger(__name__)

HOP_MARGIN_S = 0.5
"""Time a stage keeps for itself when it passes the remaining budget downstream."""


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """A stage peer: which swarm, run and stage, and on what device."""

    node: NodeConfig = field(default_factory=NodeConfig)
    run_id: str | None = None
    """Run to join; None joins the only run the swarm announces."""
    stage: int | None = None
    """Stage to serve; None takes the stage with the fewest peers."""
    device: str = "cpu"
    """torch device for compute, e.g. 'cpu' or 'cuda:0'."""
    num_threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    heartbeat_s: float = 2.0
    """Seconds between announcements in the DHT."""
    ttl_s: float = 6.0
    """Lifetime of an announcement: a peer silent for this long drops out of routing."""
    slowdown: float = 1.0
    """Make compute take this many times longer (emulates a slower device on one machine)."""
    max_memory_bytes: int | None = None
    """Memory this peer may use; a stage that needs more is refused."""
    is_spot: bool = False
    """The machine may be preempted at any time (announced; planners prefer others for scarce stages)."""
    rebalance_s: float = 10.0
    """Seconds between checks whether moving to another stage would raise swarm throughput; 0: never move."""
    rebalance_patience: int = 3
    """Consecutive checks a move must stay worthwhile (by more than 10%) before the peer moves."""
    probe_s: float = 0.3
    """Seconds of matmul timing in the start-up capacity probe."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, how long to wait for in-flight microbatches before leaving."""
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self):
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ConfigError(f"need 0 < heartbeat_s < ttl_s, got {self.heartbeat_s} and {self.ttl_s}")
        if self.slowdown < 1:
            raise ConfigError(f"--slowdown must be >= 1, got {self.slowdown}")
        if self.stage is not None and self.stage < 0:
            raise ConfigError(f"--stage must be >= 0, got {self.stage}")


class StagePeer:
    """Serve one stage until stopped. `run()` blocks; `stop()` may be called from any thread."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.node: SwarmNode | None = None
        self.manifest: RunManifest | None = None
        self.stage: int = -1
        self.state = "joining"
        self.served = 0
        self.failed = 0
        self._since = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._in_flight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._inbox = GradientInbox()
        self._beat_soon: asyncio.Task | None = None
        self.capacity: dict = {}
        self._rebalancer = None
        self.moves = 0
        self.on_serving = lambda: None
        """Called once the peer is announced and takes requests (serving or standing by)."""

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
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.node.shutdown()

    async def _serve(self, node: SwarmNode) -> None:
        cfg = self.config
        self.manifest = manifest = node.require_manifest(cfg.run_id)
        self.capacity = await self._loop.run_in_executor(None, self._probe)
        fits = [True] * manifest.num_stages
        if cfg.max_memory_bytes is not None:
            needs = stage_memory_bytes(manifest)
            fits = [n <= cfg.max_memory_bytes for n in needs]
            if cfg.stage is not None and manifest.stage_span(cfg.stage) and not fits[cfg.stage]:
                raise ConfigError(
                    f"stage {cfg.stage} needs about {needs[cfg.stage] / 2**20:.1f} MiB, more than --max-memory "
                    f"{cfg.max_memory_bytes / 2**20:.1f} MiB: pick another --stage or raise --max-memory"
                )
        if cfg.stage is None:
            self.stage = choose_stage(manifest, await node.peers_async(manifest.run_id), fits)
        else:
            self.stage = cfg.stage
        start, end = manifest.stage_span(self.stage)
        self._take_stage(self.stage)
        if cfg.rebalance_s > 0:
            from swarmtrain.peers.planning import StageRebalancer

            self._rebalancer = StageRebalancer(manifest, patience=cfg.rebalance_patience)
        self.transport = TensorTransport(await node.p2p(), cfg.transport)
        await self._sync_from_replica()
        await self._measure_links()
        await self.transport.serve(handler_name(manifest.run_id), self._handle)
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: stop() is the way out
                self._loop.add_signal_handler(sig, self._stop.set)
        self._since = get_dht_time()
        self.state = "serving"
        await self._heartbeat()
        logger.info(
            "serving stage %d (blocks %d-%d) of run %s as %s",
            self.stage,
            start,
            end - 1,
            manifest.run_id,
            node.peer_id,
        )
        self.on_serving()
        beats = asyncio.create_task(self._heartbeats())
        await self._stop.wait()
        await self._drain()
        for task in (beats, self._beat_soon):
            if task is not None:
                task.cancel()
        await asyncio.gather(beats, *([self._beat_soon] if self._beat_soon else []), return_exceptions=True)

    def _take_stage(self, stage: int) -> None:
        """Build `stage`'s blocks (from the run seed) and its optimizer."""
        manifest = self.manifest
        start, end = manifest.stage_span(stage)
        module = build_stage(
            manifest.model,
            manifest.model_config,
            start,
            end,
            num_blocks=manifest.num_blocks,
            seed=manifest.seed,
            device=self.config.device,
        )
        self.stage = stage
        self.runner = StageRunner(module, manifest.optimizer, microbatch_size=manifest.batch.microbatch_size)
        self._inbox = GradientInbox()

    async def _switch_stage(self, stage: int) -> None:
        """Move to `stage`: drain, take its blocks and a live replica's state, serve again."""
        old = self.stage
        self.state = "draining"
        await asyncio.wait_for(self._heartbeat(), timeout=self.config.ttl_s)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._take_stage(stage)
        await self._sync_from_replica()
        self._since, self.state = get_dht_time(), "serving"
        await self._heartbeat()
        self.moves += 1
        logger.warning("moved from stage %d to stage %d to raise swarm throughput", old, stage)

    async def _drain(self) -> None:
        """Stop taking new work, let in-flight microbatches finish, announce we are leaving."""
        self.state = "draining"
        try:
            await asyncio.wait_for(self._heartbeat(), timeout=2.0)
        except Exception as e:  # leaving anyway: the TTL will retire our record
            logger.warning("could not announce draining: %r", e)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        logger.info("stage %d left the swarm (%d microbatches served)", self.stage, self.served)

    def record(self) -> PeerRecord:
        device = self.config.device
        if device.startswith("cuda"):
            device = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
        return PeerRecord(
            peer_id=self.node.peer_id,
            role="stage",
            stage=self.stage,
            state=self.state,
            device=device,
            version=swarmtrain.__version__,
            served=self.served,
            step=self.runner.step,
            capacity=self.capacity,
            since=self._since,
        )

    async def _heartbeat(self) -> None:
        await self.node.announce_async(self.manifest.run_id, self.record(), ttl_s=self.config.ttl_s)

    async def _live_replicas(self) -> list[PeerRecord]:
        """Other serving replicas of this stage, furthest step first."""
        replicas = stage_replicas(await self.node.peers_async(self.manifest.run_id)).get(self.stage, [])
        others = [r for r in replicas if r.peer_id != self.node.peer_id]
        return sorted(others, key=lambda r: -r.step)

    async def _sync_from_replica(self) -> bool:
        """Download parameters and optimizer state from a live replica, if there is one.

        A stage nobody serves keeps its run-seed initialisation. Returns True if state was taken.
        """
        for replica in await self._live_replicas():
            request = Frame(kind="state", run_id=self.manifest.run_id, stage=self.stage)
            try:
                reply = await self.transport.call(
                    replica.peer_id, handler_name(self.manifest.run_id), request, timeout_s=60
                )
                await self._compute(self.runner.import_state, reply.tensors, reply.step)
            except (RemoteError, PeerUnreachableError, BadFrameError) as e:
                logger.warning("could not take state from replica %s: %s", replica.peer_id[-8:], e)
                continue
            logger.info("took the state of step %d from replica %s", reply.step, replica.peer_id[-8:])
            return True
        return False

    async def _resync_if_behind(self, force: bool = False) -> bool:
        """A replica that missed a step (it joined mid-step, or a commit failed) catches up.

        Without `force`, only when idle; returns True if it took a replica's newer state.
        """
        runner = self.runner
        if not force and (self._in_flight or runner.num_pending or runner.num_committed):
            return False
        replicas = await self._live_replicas()
        if replicas and replicas[0].step > runner.step:
            logger.info(
                "stage %d is at step %d, a replica at %d: resyncing",
                self.stage,
                runner.step,
                replicas[0].step,
            )
            return await self._sync_from_replica()
        return False

    async def _heartbeats(self) -> None:
        last_check = time.monotonic()
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if self._rebalancer is not None and time.monotonic() - last_check >= self.config.rebalance_s:
                last_check = time.monotonic()
                try:
                    target = self._rebalancer.check(
                        self.node.peer_id, await self.node.peers_async(self.manifest.run_id)
                    )
                    if target is not None:
                        await self._switch_stage(target)
                except Exception as e:  # a failed check or move must not stop serving
                    logger.warning("rebalancing failed: %r", e)
            try:
                await asyncio.wait_for(self._heartbeat(), timeout=self.config.ttl_s)
                await asyncio.wait_for(self._resync_if_behind(), timeout=10 * self.config.ttl_s)
            except Exception as e:  # a DHT hiccup must not stop serving
                logger.warning("heartbeat failed: %r", e)

    # serving

    async def _measure_links(self, max_peers: int = 3) -> None:
        """RTT and bandwidth to a few stage peers over the real transport; the median
        bandwidth is what this peer announces (the planner's network term)."""
        from swarmtrain.peers.probe import measure_links

        records = await self.node.peers_async(self.manifest.run_id)
        others = [r.peer_id for r in records if r.role == "stage" and r.peer_id != self.node.peer_id][
            :max_peers
        ]
        if not others:
            return
        links = await measure_links(
            self.transport, others, self.manifest.run_id, payload_bytes=2**18, timeout_s=5
        )
        rates = sorted(v["bandwidth_bytes_per_s"] for v in links.values() if "bandwidth_bytes_per_s" in v)
        if rates:
            self.capacity["bandwidth_bytes_per_s"] = rates[len(rates) // 2]
            self.capacity["rtt_s"] = min(v["rtt_s"] for v in links.values() if "rtt_s" in v)

    def _probe(self) -> dict:
        from swarmtrain.peers.probe import probe

        cfg = self.config
        cap = probe(
            cfg.device,
            seconds=cfg.probe_s,
            is_spot=cfg.is_spot,
            max_memory_bytes=cfg.max_memory_bytes,
            slowdown=cfg.slowdown,
        )
        return {
            "flops_per_s": cap.matmul_flops_per_s,
            "memory_bytes": cap.usable_memory_bytes,
            "is_spot": cap.is_spot,
            "device_name": cap.device_name,
            "slowdown": cap.slowdown,
        }

    def _slowed(self, fn, *args):
        """Run `fn`; with --slowdown F, hold the compute thread F times as long in all."""
        started = time.perf_counter()
        result = fn(*args)
        if self.config.slowdown > 1:
            time.sleep((self.config.slowdown - 1) * (time.perf_counter() - started))
        return result

    async def _compute(self, fn, *args):
        """Run `fn` on the compute thread (bookkeeping and state copies: never slowed down)."""
        return await self._loop.run_in_executor(self._pool, fn, *args)

    async def _model_compute(self, fn, *args):
        """Run forward/backward work on the compute thread, slowed down by --slowdown."""
        return await self._loop.run_in_executor(self._pool, self._slowed, fn, *args)

    async def _handle(self, frame: Frame, peer: str) -> Frame:
        run_id = self.manifest.run_id
        if frame.run_id != run_id:
            self.transport.strike(peer, f"frame for run {frame.run_id!r}")
            return error_frame(
                run_id, f"this peer serves run {run_id!r}, not {frame.run_id!r}", retryable=False
            )
        if frame.kind == "ping":
            return Frame(
                kind="pong", run_id=run_id, stage=self.stage, step=self.runner.step, meta=self._status()
            )
        if self.state == "draining" and frame.kind in ("forward", "step"):
            return error_frame(run_id, "this peer is leaving its stage", retryable=True, stage=self.stage)
        if frame.stage != self.stage:
            valid = 0 <= frame.stage < self.manifest.num_stages  # routing may lag a move by a heartbeat
            if not valid:
                self.transport.strike(peer, f"frame for stage {frame.stage}")
            return error_frame(
                run_id,
                f"this peer serves stage {self.stage}, not {frame.stage}",
                retryable=valid,
                stage=self.stage,
            )
        if frame.kind == "step":
            return await self._on_step(frame)
        if frame.kind == "grads":
            try:
                return await self._on_grads(frame, peer)
            except BadFrameError as e:
                self.transport.strike(peer, str(e))
                return error_frame(run_id, f"stage {self.stage} rejected gradients: {e}", retryable=False)
        if frame.kind == "state":
            step = self.runner.step
            state = await self._compute(self.runner.export_state)
            return Frame(kind="state_data", run_id=run_id, stage=self.stage, step=step, tensors=state)
        if frame.kind != "forward":
            return error_frame(run_id, f"stage peers do not take {frame.kind!r} frames", retryable=False)
        if self.state == "draining":
            return error_frame(run_id, "this peer is leaving the swarm", retryable=True, stage=self.stage)
        self._in_flight += 1
        try:
            reply = await self._on_forward(frame)
            self.served += 1
            return reply
        except BadFrameError as e:
            self.failed += 1
            self.transport.strike(peer, str(e))
            return error_frame(
                run_id, f"stage {self.stage} rejected microbatch {frame.mb_id}: {e}", retryable=False
            )
        except RemoteError as e:
            self.failed += 1
            return error_frame(run_id, str(e), retryable=e.retryable, mb_id=frame.mb_id, stage=self.stage)
        except PeerUnreachableError as e:
            self.failed += 1
            return error_frame(
                run_id, f"stage {self.stage + 1} unreachable: {e}", retryable=True, stage=self.stage
            )
        finally:
            self._in_flight -= 1

    def _status(self) -> dict:
        return {
            "state": self.state,
            "served": self.served,
            "failed": self.failed,
            "in_flight": self._in_flight,
            "pending": self.runner.num_pending,
        }

    async def _on_step(self, frame: Frame) -> Frame:
        """Commit a step: check this replica's microbatches, sum gradients with the group, step.

        meta: num_microbatches (this replica's share), group (peer ids of every replica of
        the stage that steps together). A replica whose exchange fails while another
        replica got ahead takes that replica's state instead of stepping on its own.
        """
        run_id, runner = self.manifest.run_id, self.runner
        n, group = frame.meta.get("num_microbatches"), str(frame.meta.get("group", self.node.peer_id)).split()
        if frame.meta.get("abort"):
            await self._compute(runner.discard_step)
            return Frame(kind="step_done", run_id=run_id, stage=self.stage, step=runner.step)
        if frame.meta.get("resync") and runner.step == frame.step:
            if not await self._resync_if_behind(force=True):
                return error_frame(
                    run_id, f"stage {self.stage}: no replica ahead to take state from", retryable=True
                )
            return Frame(kind="step_done", run_id=run_id, stage=self.stage, step=runner.step)
        if not isinstance(n, int) or n < 0 or self.node.peer_id not in group:
            return error_frame(
                run_id, "step frame needs num_microbatches >= 0 and a group naming this peer", retryable=False
            )
        try:
            if await self._compute(runner.check_step, frame.step, n) and len(group) > 1:
                try:
                    await self._exchange(frame.step, [p for p in group if p != self.node.peer_id])
                except (RemoteError, PeerUnreachableError) as e:
                    if not await self._resync_if_behind(force=True):
                        raise RemoteError(f"gradient exchange failed: {e}", retryable=True) from None
                    return Frame(kind="step_done", run_id=run_id, stage=self.stage, step=runner.step)
            new_step = await self._compute(runner.apply_step, frame.step, n)
        except RemoteError as e:
            return error_frame(run_id, f"stage {self.stage}: {e}", retryable=e.retryable, stage=self.stage)
        self._beat_soon = asyncio.create_task(self._heartbeat())  # routing sees the new step now
        return Frame(kind="step_done", run_id=run_id, stage=self.stage, step=new_step)

    async def _exchange(self, step: int, others: list[str], timeout_s: float = 30.0) -> None:
        """Send this replica's gradients to `others`, take theirs, sum them all in place."""
        local = await self._compute(lambda: [g.detach().cpu().clone() for g in self.runner.grads()])
        frame = Frame(
            kind="grads",
            run_id=self.manifest.run_id,
            stage=self.stage,
            step=step,
            tensors={str(i): g for i, g in enumerate(local)},
        )
        name = handler_name(self.manifest.run_id)
        sends = [self.transport.call(p, name, frame, timeout_s=timeout_s) for p in others]
        results = await asyncio.gather(
            *sends, self._inbox.take(step, others, timeout_s), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        total = group_sum(self.node.peer_id, local, results[-1])
        await self._compute(lambda: [g.copy_(t) for g, t in zip(self.runner.grads(), total)])

    async def _on_grads(self, frame: Frame, peer: str) -> Frame:
        if frame.step != self.runner.step:
            return error_frame(
                self.manifest.run_id,
                f"stage {self.stage} is at step {self.runner.step}, not {frame.step}",
                retryable=True,
            )
        grads = [frame.tensors.get(str(i)) for i in range(len(frame.tensors))]
        if any(g is None for g in grads):
            raise BadFrameError("a grads frame names its tensors 0..N-1")
        await self._inbox.put(frame.step, peer, grads, self.runner.grads())
        return Frame(kind="result", run_id=self.manifest.run_id, stage=self.stage, step=frame.step)

    async def _on_forward(self, frame: Frame) -> Frame:
        runner, manifest = self.runner, self.manifest
        started = time.monotonic()
        x, targets = frame.tensors.get("x"), frame.tensors.get("targets")
        if x is None or targets is None:
            raise BadFrameError("a forward frame needs tensors 'x' and 'targets'")
        runner.check_inputs(x, targets)
        loss_scale, budget_s = frame.meta.get("loss_scale"), frame.meta.get("budget_s")
        if not isinstance(loss_scale, float) or not 0 < loss_scale <= 1:
            raise BadFrameError(f"meta loss_scale must be a float in (0, 1], got {loss_scale!r}")
        if not isinstance(budget_s, (int, float)) or budget_s <= 0:
            raise BadFrameError(f"meta budget_s must be a positive number, got {budget_s!r}")
        if frame.step != runner.step:
            if runner.steps_applied == 0 and runner.num_pending == 0 and runner.num_committed == 0:
                runner.step = frame.step  # a fresh peer adopts the run's step
            else:
                raise RemoteError(
                    f"stage {self.stage} is at step {runner.step}, not {frame.step}", retryable=True
                )
        mb = frame.mb_id
        try:
            if self.stage == manifest.num_stages - 1:
                loss, grad_x = await self._model_compute(
                    runner.forward_loss_backward, mb, x, targets, loss_scale
                )
            else:
                loss, grad_x = await self._chain(frame, x, targets, budget_s - (time.monotonic() - started))
        except (BadFrameError, RemoteError, PeerUnreachableError):
            raise
        except (RuntimeError, IndexError, ValueError) as e:  # the model refused this input
            raise BadFrameError(f"forward/backward failed on this input: {e}") from None
        tensors = {} if grad_x is None else {"grad": grad_x}
        meta = {"loss": loss, "service_s": time.monotonic() - started}
        return Frame(
            kind="result",
            run_id=manifest.run_id,
            mb_id=mb,
            stage=self.stage,
            step=frame.step,
            tensors=tensors,
            meta=meta,
        )

    async def _chain(self, frame: Frame, x, targets, budget_s: float) -> tuple[float, torch.Tensor | None]:
        """Forward here, then through the rest of the route; backward here with its gradient."""
        route = str(frame.meta.get("route", "")).split()
        if len(route) != self.manifest.num_stages:
            raise BadFrameError(f"meta route must name {self.manifest.num_stages} peers, got {len(route)}")
        out = await self._model_compute(self.runner.forward, frame.mb_id, x)
        if not bool(torch.isfinite(out).all()):
            self.runner.drop(frame.mb_id)
            raise RemoteError(f"stage {self.stage} produced NaN/inf activations", retryable=False)
        request = Frame(
            kind="forward",
            run_id=frame.run_id,
            mb_id=frame.mb_id,
            stage=self.stage + 1,
            step=frame.step,
            tensors={"x": out, "targets": targets},
            meta=dict(frame.meta, budget_s=budget_s - HOP_MARGIN_S),
        )
        downstream = route[self.stage + 1]
        try:
            reply = await self.transport.call(
                downstream, handler_name(frame.run_id), request, timeout_s=budget_s - HOP_MARGIN_S
            )
            grad, loss = reply.tensors.get("grad"), reply.meta.get("loss")
            if grad is None or not isinstance(loss, float):
                raise BadFrameError("the reply lacks a gradient or a loss")
            grad_x = await self._model_compute(self.runner.backward, frame.mb_id, grad)
            return loss, grad_x
        except BadFrameError as e:  # the downstream peer's fault, not our caller's
            self.transport.strike(downstream, str(e))
            raise RemoteError(f"stage {self.stage + 1} sent a bad reply: {e}", retryable=True) from None
        finally:
            self.runner.drop(frame.mb_id)
