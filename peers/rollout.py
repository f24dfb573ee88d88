"""A rollout peer: a whole copy of an RL run's policy that samples completions for its trainers.

`swarmtrain join --role rollout` starts one. It reads the run's manifest, builds the whole
model twice on its device (the sampling copy and the one the next version loads into), takes
the newest policy version every stage serves (`swarmtrain.rl.weights`), announces itself
under `{run}.peers` (role 'rollout', its step the policy version it samples with, its
sampling rate, its quantization), and answers trainers' rollout requests
(`swarmtrain.rl.worker`). In the background it follows the run: whenever the stages serve a
newer version it fetches it (through the run's `weights_codec`) and swaps it in between
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time

import swarmtrain
from swarmtrain.errors import ConfigError, RemoteError
from swarmtrain.model import ModelSources, build_model
from swarmtrain.model.registry import NO_IMPORTS
from swarmtrain.peers.self_measure import device_label
from swarmtrain.rl.generate import measure_decode
from swarmtrain.rl.grpo import grpo_config
from swarmtrain.rl.quantize import check_mode, parameter_bytes, quantize_model
from swarmtrain.rl.registry import TaskSources, build_task
from swarmtrain.rl.roles import RoleChecker, probe_prompts
from swarmtrain.rl.verify import lie_about_logprobs
from swarmtrain.rl.weights import FetchConfig, fetch_version, latest_version, swarm_source
from swarmtrain.rl.worker import RolloutWorker
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.train.layout import wait_for_layout
from swarmtrain.transport import TensorTransport, TransportConfig, handler_name
from swarmtrain.wire.records import PeerRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """A rollout peer: which swarm and run, and where it samples."""

    node: NodeConfig
    """The swarm to join (its initial peers, this peer's identity and key)."""
    run_id: str | None = None
    """The RL run to sample for; None: the only run the swarm announces."""
    device: str = "cpu"
    """Where both policy copies live and sample ('cpu', 'cuda:0')."""
    num_threads: int | None = None
    """torch threads of this process; None: torch's default."""
    transport: TransportConfig = TransportConfig()
    models: ModelSources = NO_IMPORTS
    """Model import paths this peer may import when the run names one (--allow-model)."""
    tasks: TaskSources = TaskSources()
    """Task import paths this peer may import when the run names one."""
    heartbeat_s: float = 2.0
    """Seconds between announcements of this peer's record."""
    follow_s: float = 0.5
    """Seconds between looks for a newer policy version."""
    wait_for_stages_s: float = 120.0
    """Longest wait at start for every stage to serve a version."""
    quantize: str | None = None
    """'8bit' or '4bit': keep both policy copies' Linear weights quantized (bitsandbytes), to fit
    a small GPU (`swarmtrain.rl.quantize`)."""
    slowdown: float = 1.0
    """Sampling takes this many times longer (emulates a slower GPU)."""
    max_memory_bytes: int | None = None
    """Memory this peer may use: it refuses to start if the two policy copies need more."""
    fault: str | None = None
    """Testing: 'lie' claims reward 1 for every completion; 'lie-logprobs' claims the right
    rewards but wrong behaviour log-probs (`swarmtrain.rl.verify.lie_about_logprobs`). Trainers
    must ban either peer."""
    probe_s: float = 0.3
    """Seconds of sampling timed at start-up: the decode rate the peer announces
    (`capacity['decode_tokens_per_s']`, divided by `slowdown`), which the RL planner reads."""
    capacity: dict = field(default_factory=dict)
    """Capacity keys announced besides the decode rate: a `--role auto` peer's probe and `role_auto`."""
    auto_role: bool = False
    """Started with `--role auto`: every `rebalance_s` it asks the run's planner whether it should
    hold a stage instead (`swarmtrain.rl.roles.RoleChecker`) and leaves to do so (`switch_role`)."""
    rebalance_s: float = 10.0
    """Seconds between role checks (auto peers only)."""
    rebalance_patience: int = 3
    """Consecutive checks a switch must stay worthwhile (by more than 10%) before the peer switches."""


class RolloutPeer:
    """Serve rollout requests for one run until stopped (see the module docstring)."""

    def __init__(self, config: RolloutConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.node = SwarmNode(config.node)
        self.manifest = m = self.node.require_manifest(config.run_id)
        if m.layout_version == 0:  # its stages are planned from the peers that come: wait for them
            try:
                self.manifest = m = wait_for_layout(
                    lambda: self.node.get_manifest(m.run_id), m, who="this rollout peer"
                )
            except BaseException:
                self.node.shutdown()
                raise
        if m.rl is None:
            self.node.shutdown()
            raise ConfigError(
                f"run {m.run_id!r} is not an RL run (its coordinator named no --task): "
                "join it as a stage peer instead (leave out --role rollout)"
            )
        self.task = build_task(m.rl.task, m.rl.task_options, config.tasks)
        check_mode(config.quantize)
        models = []
        for _ in range(2):
            model = build_model(m.model, m.model_config, device=config.device, sources=config.models)
            models.append(model if config.quantize is None else quantize_model(model, config.quantize))
        self.policy_bytes = parameter_bytes(models[0])
        """Bytes one policy copy's parameters take (the peer holds two)."""
        if config.max_memory_bytes is not None and 2 * self.policy_bytes > config.max_memory_bytes:
            self.node.shutdown()
            raise ConfigError(
                f"run {m.run_id!r}: two copies of its policy need {2 * self.policy_bytes / 2**20:.1f} MiB, "
                f"more than --max-memory {config.max_memory_bytes / 2**20:.1f} MiB"
                + ("" if config.quantize == "4bit" else "; --quantize 8bit or 4bit shrinks them")
            )
        self.worker = RolloutWorker(
            run_id=m.run_id,
            model=models[0],
            spare=models[1],
            task=self.task,
            temperature=grpo_config(m.loss).temperature,
            authorized=lambda peer: not m.trainers or peer in m.trainers,
            version=-1,
            quantize=config.quantize,
            slowdown=lambda: config.slowdown,
        )
        if config.fault == "lie":
            self.worker.reward = lambda prompt, completion: 1.0
        elif config.fault == "lie-logprobs":
            rng = random.Random(0)
            self.worker.claim_logprobs = lambda logprobs: lie_about_logprobs(logprobs, rng)
        elif config.fault is not None:
            self.node.shutdown()
            raise ConfigError(
                f"a rollout peer's --inject-fault takes 'lie' or 'lie-logprobs', got {config.fault!r}"
            )
        self.capacity = dict(config.capacity)
        """What the record announces: the decode rate this peer measured, and `config.capacity`."""
        self.capacity.setdefault("decode_tokens_per_s", None)  # an auto peer measured it already
        self.capacity["decode_tokens_per_s"] = self.capacity["decode_tokens_per_s"] or (
            measure_decode(
                models[0],
                self.task,
                samples_per_prompt=m.rl.samples_per_prompt,
                prompts=probe_prompts(m),
                seconds=config.probe_s,
                temperature=grpo_config(m.loss).temperature,
            )
            / config.slowdown
        )
        self._role_checker = None
        if config.auto_role:
            self._role_checker = RoleChecker(m, tasks=config.tasks, patience=config.rebalance_patience)
        self.switch_role: str | None = None
        """Set when the peer left to take another role (`--role auto`): 'stage'."""
        self.on_serving = lambda: None
        self._stop = threading.Event()
        self._since = get_dht_time()

    def record(self, state: str = "serving") -> PeerRecord:
        s = self.worker.stats
        return PeerRecord(
            peer_id=self.node.peer_id,
            role="rollout",
            state=state,
            device=device_label(self.config.device),
            quantize=self.config.quantize,
            version=swarmtrain.__version__,
            served=s.samples,
            step=max(self.worker.version, 0),
            since=self._since,
            service_s=s.sample_seconds / s.samples if s.samples else 0.0,
            bytes_received=s.update_bytes,
            busy_s=s.sample_seconds,
            failed=s.refused,
            capacity=self.capacity,
        )

    def run(self) -> None:
        """Serve until `stop()`, SIGTERM or Ctrl-C; then announce itself draining and shut its
        node down (its DHT process and p2p daemon with it)."""
        try:
            asyncio.run(self._main())
        finally:
            self.node.shutdown()

    def stop(self) -> None:
        self._stop.set()

    async def _main(self) -> None:
        transport = TensorTransport(
            await self.node.p2p(), self.config.transport, swarm_key=self.node.swarm_key
        )
        self.worker.strike = transport.strike
        source = await swarm_source(
            self.node, self.manifest.run_id, transport=transport, sources=self.config.models
        )
        fetch = FetchConfig(codec=self.manifest.rl.weights_codec)
        deadline = time.monotonic() + self.config.wait_for_stages_s
        while not await self._update(source, fetch):
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"no policy version of run {self.manifest.run_id!r} came from its stages in "
                    f"{self.config.wait_for_stages_s:.0f} s: does every stage have a peer?"
                )
            await asyncio.sleep(self.config.follow_s)
        await transport.serve(handler_name(self.manifest.run_id), self.worker.handle)
        for sig in (signal.SIGTERM, signal.SIGINT):  # stop as `stop()` does: `run` then shuts the node down
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: stop() is the way out
                asyncio.get_running_loop().add_signal_handler(sig, self._stop.set)
        await self.node.announce_async(self.manifest.run_id, self.record(), ttl_s=3 * self.config.heartbeat_s)
        self.on_serving()
        beat = checked = time.monotonic()
        wanted = asyncio.Event()
        self.worker.on_wanted = wanted.set
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):  # a trainer named a newer version: fetch it now
                await asyncio.wait_for(wanted.wait(), self.config.follow_s)
            wanted.clear()
            await self._update(source, fetch)
            if time.monotonic() - beat > self.config.heartbeat_s:
                beat = time.monotonic()
                await self.node.announce_async(
                    self.manifest.run_id, self.record(), ttl_s=3 * self.config.heartbeat_s
                )
            if self._role_checker is not None and time.monotonic() - checked >= self.config.rebalance_s:
                checked = time.monotonic()
                self.switch_role = await self._check_role()
                if self.switch_role is not None:
                    logger.warning(
                        "leaving the rollouts to take the %s role the run's planner gives", self.switch_role
                    )
                    break
        await self.node.announce_async(
            self.manifest.run_id, self.record("draining"), ttl_s=self.config.heartbeat_s
        )

    async def _check_role(self) -> str | None:
        try:
            records = await self.node.peers_async(self.manifest.run_id)
            return self._role_checker.check(self.node.peer_id, records)
        except Exception as e:  # a failed check must not stop sampling
            logger.warning("role check failed: %r", e)
            return None

    async def _update(self, source, fetch: FetchConfig) -> bool:
        """Take a newer version than ours if the stages serve one: the one a trainer last asked
        for (it exists; the DHT records may lag by a heartbeat), else the newest the records
        show. True once we hold any."""
        latest = await latest_version(source)
        for version in sorted({self.worker.wanted, -1 if latest is None else latest}, reverse=True):
            if version <= self.worker.version:
                break
            try:
                state, stats = await fetch_version(source, version, fetch)
            except (
                RemoteError
            ) as e:  # not applied yet, or a replica moved on mid-fetch: the next look tries again
                logger.debug("policy version %d not taken: %s", version, e)
                continue
            install = functools.partial(
                self.worker.install, state, stats.version, wire_bytes=stats.wire_bytes, seconds=stats.seconds
            )
            await asyncio.get_running_loop().run_in_executor(None, install)
            logger.info(
                "policy version %d: %.2f MB in %.2f s", stats.version, stats.wire_bytes / 1e6, stats.seconds
            )
            break
        return self.worker.version >= 0
