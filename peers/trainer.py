"""The trainer: owns the data, pushes microbatches into stage 0, steps the stages.

One optimizer step is a flush: the trainer sends `microbatches_per_step` microbatches
(at most `max_in_flight` at once) through the route, waits for all their losses, then
asks every stage of the route to step. A microbatch that fails for a retryable reason is
replayed (the stages dedupe its gradient by id); one that fails for a non-retryable
reason fails the step with the peer's message.

`Trainer` is a sync facade over a private event loop on a background thread, so it can be
driven from a plain Python loop over the user's own data.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from swarmtrain.errors import BadFrameError, ConfigError, PeerUnreachableError, RemoteError, SwarmError
from swarmtrain.swarm import NodeConfig, SwarmNode, stage_primaries
from swarmtrain.transport import TensorTransport, TransportConfig, handler_name
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.records import RunManifest

logger = logging.getLogger(__name__)


class StepFailedError(SwarmError):
    """A step could not complete; the message says which microbatch or stage and why."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """A trainer: which swarm and run, and how patient to be."""

    node: NodeConfig = field(default_factory=NodeConfig)
    run_id: str | None = None
    """Run to train; None trains the only run the swarm announces."""
    microbatch_timeout_s: float = 60.0
    """Budget for one microbatch's whole trip: forward through every stage and back."""
    max_retries: int = 3
    """Replays of a microbatch after retryable failures before the step fails."""
    wait_for_stages_s: float = 60.0
    """How long to wait for every stage to have a serving peer."""
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self):
        if self.microbatch_timeout_s <= 1:
            raise ConfigError(
                f"the microbatch timeout must be over 1 s, got {self.microbatch_timeout_s}: raise --timeout"
            )
        if self.max_retries < 0 or self.wait_for_stages_s < 0:
            raise ConfigError(
                f"max_retries and wait_for_stages_s must be >= 0, got {self.max_retries} and {self.wait_for_stages_s}"
            )


@dataclass(frozen=True)
class StepResult:
    step: int
    """Optimizer step just applied (0-based)."""
    loss: float
    """Mean loss over the step's microbatches."""
    samples: int
    tokens: int
    seconds: float
    replays: int
    """Microbatches replayed after a retryable failure."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


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
            self.transport = self._run(self._make_transport())
        except BaseException:
            self.close()
            raise
        self.step = 0
        self.trainer_id = self.node.peer_id[-8:]

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _make_transport(self) -> TensorTransport:
        return TensorTransport(await self.node.p2p(), self.config.transport)

    def close(self) -> None:
        """Close the streams, then the DHT node; safe to call twice."""
        if self._loop.is_closed():
            return
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

    def route(self) -> list[str]:
        """Peer ids of the serving peer of each stage, waiting up to wait_for_stages_s."""
        return self._run(self._route())

    async def _route(self) -> list[str]:
        deadline = time.monotonic() + self.config.wait_for_stages_s
        while True:
            primaries = stage_primaries(await self.node.peers_async(self.manifest.run_id))
            missing = [k for k in range(self.manifest.num_stages) if k not in primaries]
            if not missing:
                return [primaries[k].peer_id for k in range(self.manifest.num_stages)]
            if time.monotonic() > deadline:
                raise StepFailedError(
                    f"no peer serves stage(s) {', '.join(map(str, missing))} of run {self.manifest.run_id!r}: "
                    "start one with `swarmtrain join --initial-peers ADDR --stage K`"
                )
            await asyncio.sleep(0.25)

    async def _sync_step(self, route: list[str]) -> None:
        """Start from the step the stages are at (all must agree, fresh peers excepted)."""
        steps = set()
        for stage, peer in enumerate(route):
            ping = Frame(kind="ping", run_id=self.manifest.run_id, stage=stage)
            reply = await self.transport.call(peer, handler_name(self.manifest.run_id), ping, timeout_s=10)
            if reply.meta.get("served", 0) or reply.step:
                steps.add(reply.step)
        if len(steps) > 1:
            raise StepFailedError(f"the stages are at different steps {sorted(steps)}: restart the run")
        self.step = steps.pop() if steps else 0

    def fetch_states(self) -> list[dict[str, torch.Tensor]]:
        """Each stage's parameters, keyed like `swarmtrain.train.reference` keys them."""
        return self._run(self._fetch_states())

    async def _fetch_states(self) -> list[dict[str, torch.Tensor]]:
        route = await self._route()

        async def fetch(stage: int, peer: str) -> dict[str, torch.Tensor]:
            frame = Frame(kind="state", run_id=self.manifest.run_id, stage=stage)
            reply = await self.transport.call(peer, handler_name(self.manifest.run_id), frame, timeout_s=60)
            return {k: v.clone() for k, v in reply.tensors.items()}

        return list(await asyncio.gather(*(fetch(k, p) for k, p in enumerate(route))))

    # training

    def train(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, steps: int
    ) -> Iterator[StepResult]:
        """Run `steps` optimizer steps over microbatches drawn from `batches`; yield each result.

        Each item of `batches` is one microbatch (inputs, targets) with the run's microbatch
        size. Raises StepFailedError when a step cannot complete.
        """
        it = iter(batches)
        self._run(self._sync_step(self._run(self._route())))
        m = self.manifest.batch.microbatches_per_step
        for _ in range(steps):
            microbatches = []
            for _ in range(m):
                try:
                    microbatches.append(next(it))
                except StopIteration:
                    return
            yield self._run(self._train_step(microbatches))

    async def _train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        started = time.monotonic()
        step = self.step
        route = await self._route()
        window = asyncio.Semaphore(self.manifest.batch.max_in_flight)
        replays = 0
        losses: dict[int, float] = {}

        async def one(n: int, x: torch.Tensor, y: torch.Tensor) -> None:
            nonlocal route, replays
            async with window:
                for attempt in range(self.config.max_retries + 1):
                    try:
                        losses[n] = await self._send(route, step, n, x, y, len(microbatches))
                        return
                    except (RemoteError, PeerUnreachableError, BadFrameError) as e:
                        if isinstance(e, RemoteError) and not e.retryable:
                            raise StepFailedError(f"step {step}, microbatch {n}: {e}") from None
                        if attempt == self.config.max_retries:
                            raise StepFailedError(
                                f"step {step}, microbatch {n} failed {attempt + 1} times, last: {e}"
                            ) from None
                        logger.warning("replaying microbatch %d of step %d: %s", n, step, e)
                        replays += 1
                        route = await self._route()

        tasks = [asyncio.create_task(one(n, x, y)) for n, (x, y) in enumerate(microbatches)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        await self._commit(route, step, len(microbatches))
        self.step = step + 1
        x0 = microbatches[0][0]
        samples = sum(x.shape[0] for x, _ in microbatches)
        tokens = sum(x.numel() for x, _ in microbatches) if not x0.is_floating_point() else samples
        return StepResult(
            step=step,
            loss=sum(losses.values()) / len(losses),
            samples=samples,
            tokens=tokens,
            seconds=time.monotonic() - started,
            replays=replays,
        )

    async def _send(self, route: list[str], step: int, n: int, x, y, m: int) -> float:
        budget = self.config.microbatch_timeout_s
        frame = Frame(
            kind="forward",
            run_id=self.manifest.run_id,
            mb_id=f"{self.trainer_id}:{step}:{n}",
            stage=0,
            step=step,
            tensors={"x": x, "targets": y},
            meta={"loss_scale": 1.0 / m, "budget_s": budget, "route": " ".join(route)},
        )
        reply = await self.transport.call(
            route[0], handler_name(self.manifest.run_id), frame, timeout_s=budget
        )
        loss = reply.meta.get("loss")
        if not isinstance(loss, float):
            raise BadFrameError("stage 0 replied without a loss")
        return loss

    async def _commit(self, route: list[str], step: int, m: int) -> None:
        async def commit(stage: int, peer: str) -> None:
            frame = Frame(
                kind="step", run_id=self.manifest.run_id, stage=stage, step=step, meta={"num_microbatches": m}
            )
            try:
                await self.transport.call(peer, handler_name(self.manifest.run_id), frame, timeout_s=30)
            except (RemoteError, PeerUnreachableError) as e:
                raise StepFailedError(f"step {step}: stage {stage} could not step: {e}") from None

        await asyncio.gather(*(commit(k, p) for k, p in enumerate(route)))
