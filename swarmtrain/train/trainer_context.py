"""What a trainer's step needs from the trainer that runs it (`step`, `committer`, `team`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from swarmtrain.schedule import ReadinessRouter
from swarmtrain.train.hop import HopContext
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.messages import ForwardMeta
from swarmtrain.wire.records import OptimizerConfig


@dataclass(kw_only=True)
class TrainerContext:
    """What a step needs from the trainer that runs it."""

    run_id: str
    trainer_id: str
    """The trainer's peer id: its microbatch ids carry it (`authority.microbatch_id`), and stage 0
    serves a microbatch only to the trainer its id names."""
    num_stages: int
    static: bool
    """The run's schedule is the static baseline (fixed round-robin routes)."""
    router: ReadinessRouter
    transport: TensorTransport
    replicas: Callable[..., Awaitable[dict[int, list[str]]]]
    """`await replicas(refresh=False, wait_for_all=False)`: each stage's live replicas at this
    step; `refresh` reads the swarm again, `wait_for_all` waits until every stage has one."""
    all_replicas: Callable[[], Awaitable[dict[int, list[str]]]]
    """Each stage's live replicas at whatever step (a commit claims them all: some may have
    applied the step already)."""
    wait_for_replica: Callable[[float], Awaitable[None]]
    """Every replica of stage 0 is banned or gone: wait at most this long, then look again."""
    known_step: dict[str, int]
    """Per replica, the step its last commit reply said it is at (updated by the step)."""
    microbatch_timeout_s: float
    max_retries: int
    max_dropped_fraction: float
    verify_replicas: bool
    window: int
    """Microbatches in flight at once."""
    optimizer: OptimizerConfig
    """The run's optimizer settings: the learning-rate schedule and gradient clipping."""
    max_steps: int
    """The run's step count (0: none); no step at or past it is run."""

    @property
    def handler(self) -> str:
        return handler_name(self.run_id)

    def stage0_hops(self) -> HopContext:
        """How this trainer's microbatches (and score passes) reach stage 0."""

        async def stage0() -> list[str]:
            return (await self.replicas()).get(0, [])

        return HopContext(
            router=self.router,
            transport=self.transport,
            handler=self.handler,
            candidates=stage0,
            wait_for_replica=self.wait_for_replica,
        )

    def stage0_frame(
        self, mb_id: str, step: int, x: torch.Tensor, loss_inputs: dict[str, torch.Tensor], meta: ForwardMeta
    ) -> Frame:
        """The forward frame that carries microbatch `mb_id` (inputs `x`, named loss inputs) into stage 0."""
        return Frame(
            kind="forward",
            run_id=self.run_id,
            mb_id=mb_id,
            stage=0,
            step=step,
            tensors={"x": x, **loss_inputs},
            meta=meta.to_meta(),
        )
