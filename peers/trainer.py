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
from hivemind.utils import get_dht_time

from swarmtrain.errors import BadFrameError, ConfigError, PeerUnreachableError, RemoteError, SwarmError
from swarmtrain.swarm import NodeConfig, SwarmNode, stage_replicas
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
    max_retries: int = 6
    """Replays of a microbatch after retryable failures before the step fails; they back off
    0.5, 1, 2, 4, 4, ... s, so a dead peer's DHT record (TTL) expires before the last one."""
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
    dropped: int = 0
    """Microbatch gradients a stage stepped without: held by a replica that died during the commit."""

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
        self._known_step: dict[str, int] = {}
        self._published = None

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _make_transport(self) -> TensorTransport:
        return TensorTransport(await self.node.p2p(), self.config.transport)

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
        return max(record.step, self._known_step.get(record.peer_id, -1))

    async def _replicas(
        self, stages: list[int] | None = None, *, step: int | None = None
    ) -> dict[int, list[str]]:
        """Serving replicas of each of `stages` (default: all) at `step` (default: the trainer's).

        Waits up to wait_for_stages_s for every stage asked for to have one. A replica whose
        record is a heartbeat behind counts if its last commit reply said it is at `step`;
        a replica that never served counts too (a fresh peer adopts the run's step).
        """
        stages = list(range(self.manifest.num_stages)) if stages is None else stages
        step = self.step if step is None else step
        deadline = time.monotonic() + self.config.wait_for_stages_s
        while True:
            by_stage = stage_replicas(await self.node.peers_async(self.manifest.run_id))
            eligible = {
                k: [r.peer_id for r in by_stage.get(k, []) if self._step_of(r) == step or r.served == 0]
                for k in stages
            }
            missing = [k for k in stages if not eligible[k]]
            if not missing:
                return eligible
            if time.monotonic() > deadline:
                seen = "; ".join(
                    f"stage {k} has replicas at steps {sorted(r.step for r in by_stage[k])}"
                    for k in missing
                    if k in by_stage
                )
                raise StepFailedError(
                    f"no peer serves stage(s) {', '.join(map(str, missing))} of run {self.manifest.run_id!r} "
                    f"at step {step}{' (' + seen + ')' if seen else ''}: "
                    "start one with `swarmtrain join --initial-peers ADDR --stage K`"
                )
            await asyncio.sleep(0.25)

    def route(self) -> list[str]:
        """One serving peer per stage (the earliest replica), waiting up to wait_for_stages_s."""
        replicas = self._run(self._replicas())
        return [replicas[k][0] for k in range(self.manifest.num_stages)]

    async def _sync_step(self) -> None:
        """Start from the step the stages' replicas are at (the furthest one)."""
        by_stage = stage_replicas(await self.node.peers_async(self.manifest.run_id))
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
                self._known_step[r.peer_id] = reply.step
                steps.append(reply.step)
        self.step = max(steps)

    def fetch_states(self) -> list[dict[str, torch.Tensor]]:
        """The parameters of each stage's earliest replica, keyed like `swarmtrain.train.reference`."""
        return [self.fetch_state(k, p) for k, p in enumerate(self.route())]

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

    def _publish(self, result: StepResult) -> None:
        """Announce the step's loss and speed under `{run}.trainers` (fire and forget)."""
        from swarmtrain.swarm.node import trainers_key
        from swarmtrain.wire.metrics import TrainerPoint

        point = TrainerPoint(
            trainer=self.node.peer_id,
            step=result.step,
            loss=result.loss,
            tokens_per_s=result.tokens_per_s,
            t=get_dht_time(),
        )
        self._published = self.node.dht.store(
            trainers_key(self.manifest.run_id),
            point.to_dict(),
            expiration_time=get_dht_time() + 60,
            subkey=self.node.peer_id,
            return_future=True,
        )

    # training

    def train(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, steps: int
    ) -> Iterator[StepResult]:
        """Run `steps` optimizer steps over microbatches drawn from `batches`; yield each result.

        Each item of `batches` is one microbatch (inputs, targets) with the run's microbatch
        size. Raises StepFailedError when a step cannot complete.
        """
        it = iter(batches)
        self._run(self._replicas())
        self._run(self._sync_step())
        m = self.manifest.batch.microbatches_per_step
        for _ in range(steps):
            microbatches = []
            for _ in range(m):
                try:
                    microbatches.append(next(it))
                except StopIteration:
                    return
            result = self._run(_Step(self, microbatches).run())
            self._publish(result)
            yield result


class _Step:
    """One optimizer step: route, send and replay microbatches, then commit every stage."""

    def __init__(self, trainer: Trainer, microbatches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.t = trainer
        self.microbatches = microbatches
        self.step = trainer.step
        self.num_stages = trainer.manifest.num_stages
        self.routes: dict[int, list[str]] = {}
        """The route each microbatch last completed through."""
        self.losses: dict[int, float] = {}
        self.replays = 0
        self.dropped = 0
        self.window = asyncio.Semaphore(trainer.manifest.batch.max_in_flight)

    def _choose(self, eligible: dict[int, list[str]], old: list[str] | None) -> list[str]:
        """Keep the replicas of `old` that still serve (they hold this microbatch's gradients
        already, and dedupe a replay); fill the rest with the least loaded replica."""
        load: dict[str, int] = {}
        for route in self.routes.values():
            for peer in route:
                load[peer] = load.get(peer, 0) + 1
        route = []
        for k in range(self.num_stages):
            if old is not None and old[k] in eligible[k]:
                route.append(old[k])
            else:
                route.append(min(eligible[k], key=lambda p: (load.get(p, 0), eligible[k].index(p))))
            load[route[-1]] = load.get(route[-1], 0) + 1
        return route

    async def _microbatch(self, n: int, old: list[str] | None) -> None:
        t, cfg = self.t, self.t.config
        x, y = self.microbatches[n]
        async with self.window:
            for attempt in range(cfg.max_retries + 1):
                route = self._choose(await t._replicas(), old)
                try:
                    self.losses[n] = await t._send(route, self.step, n, x, y, len(self.microbatches))
                    self.routes[n] = route
                    return
                except (RemoteError, PeerUnreachableError, BadFrameError) as e:
                    if isinstance(e, RemoteError) and not e.retryable:
                        raise StepFailedError(f"step {self.step}, microbatch {n}: {e}") from None
                    if attempt == cfg.max_retries:
                        raise StepFailedError(
                            f"step {self.step}, microbatch {n} failed {attempt + 1} times, last: {e}"
                        ) from None
                    logger.warning("replaying microbatch %d of step %d: %s", n, self.step, e)
                    self.replays += 1
                    old = route
                    await asyncio.sleep(min(0.5 * 2**attempt, 4.0))

    async def _all(self, jobs) -> None:
        tasks = [asyncio.create_task(job) for job in jobs]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise

    async def run(self) -> StepResult:
        started = time.monotonic()
        await self._all(self._microbatch(n, None) for n in range(len(self.microbatches)))
        # A replica that died after its share of work took those gradients with it: replay
        # such microbatches (surviving replicas on their route dedupe them) before committing.
        for _ in range(self.t.config.max_retries + 1):
            eligible = await self.t._replicas()
            lost = [
                n
                for n, r in self.routes.items()
                if any(r[k] not in eligible[k] for k in range(self.num_stages))
            ]
            if not lost:
                break
            self.replays += len(lost)
            await self._all(self._microbatch(n, self.routes[n]) for n in lost)
        await self._all(self._commit(k) for k in range(self.num_stages))
        self.t.step = self.step + 1
        x0 = self.microbatches[0][0]
        samples = sum(x.shape[0] for x, _ in self.microbatches)
        tokens = samples if x0.is_floating_point() else sum(x.numel() for x, _ in self.microbatches)
        return StepResult(
            step=self.step,
            loss=sum(self.losses.values()) / len(self.losses),
            samples=samples,
            tokens=tokens,
            seconds=time.monotonic() - started,
            replays=self.replays,
            dropped=self.dropped,
        )

    async def _commit(self, stage: int) -> None:
        """Step every live replica of `stage` together; a replica lost during the commit is
        left out and its microbatches are counted as dropped for this stage."""
        t, run_id = self.t, self.t.manifest.run_id
        last: Exception | None = None
        for attempt in range(t.config.max_retries + 1):
            records = stage_replicas(await t.node.peers_async(run_id)).get(stage, [])
            replicas = [r.peer_id for r in records if t._step_of(r) == self.step or r.served == 0]
            if not replicas:
                if attempt and any(t._step_of(r) == self.step + 1 for r in records):
                    return  # an earlier attempt stepped every replica; only its replies were lost
                replicas = (await t._replicas([stage]))[stage]  # wait for one to (re)appear
            counts = {p: sum(1 for r in self.routes.values() if r[stage] == p) for p in replicas}
            self.dropped = max(self.dropped, len(self.routes) - sum(counts.values()))

            # Replicas that stepped already hold the step's result: the others take their
            # state rather than step on a smaller group's gradients.
            resync = any(t._step_of(r) == self.step + 1 for r in records)

            async def commit(
                peer: str, counts=counts, group=" ".join(sorted(replicas)), resync=resync
            ) -> None:
                meta = {"num_microbatches": counts[peer], "group": group, "resync": resync}
                frame = Frame(kind="step", run_id=run_id, stage=stage, step=self.step, meta=meta)
                reply = await t.transport.call(peer, handler_name(run_id), frame, timeout_s=60)
                t._known_step[peer] = reply.step

            results = await asyncio.gather(*(commit(p) for p in replicas), return_exceptions=True)
            errors = [e for e in results if isinstance(e, BaseException)]
            if not errors:
                return
            last = errors[0]
            if isinstance(last, RemoteError) and not last.retryable:
                raise StepFailedError(f"step {self.step}: stage {stage} could not step: {last}") from None
            logger.warning("retrying the commit of stage %d, step %d: %s", stage, self.step, last)
            await asyncio.sleep(min(0.5 * 2**attempt, 4.0))
        raise StepFailedError(f"step {self.step}: stage {stage} could not step: {last}")
