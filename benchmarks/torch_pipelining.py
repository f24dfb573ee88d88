"""torch.distributed.pipelining on swarmtrain's own stages: the baseline `pipeline.py` compares with.

`run_pipelining(config)` spawns one process per stage (gloo on loopback, one torch thread
each), builds each stage with swarmtrain's `build_stage` (so the modules are the swarm's,
parameter for parameter), and trains it with ScheduleGPipe or Schedule1F1B and AdamW on the
same microbatches a swarm trainer draws (`TokenBatches(..., seed=0)`). Each rank measures
its own compute with a `ComputeClock`; the result is plain data for the benchmark's JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from swarmtrain.model.stage import build_stage
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.train.optim import make_optimizer
from swarmtrain.wire.records import BatchConfig, OptimizerConfig

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True, kw_only=True)
class PipeliningConfig:
    """One torch.distributed.pipelining run: the model, its stages, the data and the step counts."""

    model: str = "tiny-gpt"
    model_config: dict = field(default_factory=dict)
    stage_bounds: tuple[int, ...]
    """Rank k holds blocks [stage_bounds[k], stage_bounds[k+1]) (the swarm's stage k)."""
    batch: BatchConfig
    """Microbatch size and microbatches per step (n_microbatches of the schedule)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: str = "1f1b"
    """'1f1b' (Schedule1F1B) or 'gpipe' (ScheduleGPipe)."""
    seed: int = 0
    """Run seed (parameter init) and data seed, as in the swarm runs."""
    text_bytes: int = 2**22
    """Bytes of standard-library text the batches are drawn from."""
    warmup_steps: int = 2
    """Untimed steps first (the first one infers the shapes crossing each stage boundary)."""
    steps: int = 4
    """Timed steps."""

    def __post_init__(self):
        num_stages = len(self.stage_bounds) - 1
        if num_stages < 2:
            raise ValueError(f"pipelining needs 2 or more stages, got bounds {list(self.stage_bounds)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}: choose one of {SCHEDULES}")
        if self.schedule == "1f1b" and self.batch.microbatches_per_step < num_stages:
            raise ValueError(
                f"1F1B needs microbatches_per_step >= stages, got {self.batch.microbatches_per_step} < {num_stages}"
            )
        if self.steps < 1 or self.warmup_steps < 1:
            raise ValueError(
                f"need steps >= 1 and warmup_steps >= 1, got {self.steps} and {self.warmup_steps}"
            )


class ComputeClock:
    """Seconds one process spends computing its stage: forward, loss, backward.

    A forward is timed from `forward_begin` to `forward_end`. A backward pass runs inside one
    autograd call with no waiting in it, so it is timed from its first `backward_event` (the
    gradient reaching the stage's output, or its loss) to its last (a parameter's gradient
    accumulated, or the gradient reaching the stage's input). `close()` ends an open backward.
    """

    def __init__(self):
        self.busy_s = 0.0
        self._forward_t: float | None = None
        self._backward: tuple[float, float] | None = None  # (first event, last event)

    def forward_begin(self) -> None:
        self.close()
        self._forward_t = time.perf_counter()

    def forward_end(self) -> None:
        assert self._forward_t is not None, "forward_end without forward_begin"
        self.busy_s += time.perf_counter() - self._forward_t
        self._forward_t = None

    def backward_event(self) -> None:
        now = time.perf_counter()
        self._backward = (now, now) if self._backward is None else (self._backward[0], now)

    def close(self) -> None:
        if self._backward is not None:
            self.busy_s += self._backward[1] - self._backward[0]
            self._backward = None


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward tells the clock that gradients passed through here."""

    @staticmethod
    def forward(ctx, x: Tensor, clock: ComputeClock) -> Tensor:
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.clock.backward_event()
        return grad, None


class TimedStage(nn.Module):
    """A StageModule whose forward and backward compute a ComputeClock measures."""

    def __init__(self, stage: nn.Module, clock: ComputeClock):
        super().__init__()
        self.stage = stage
        self.clock = clock
        for p in stage.parameters():
            p.register_post_accumulate_grad_hook(lambda _: clock.backward_event())

    def forward(self, x: Tensor) -> Tensor:
        self.clock.forward_begin()
        if x.is_floating_point():  # activations from the previous rank (rank 0 takes token ids)
            x = _BackwardMark.apply(x, self.clock)
        out = _BackwardMark.apply(self.stage(x), self.clock)
        self.clock.forward_end()
        return out


def _worker(rank: int, config: PipeliningConfig, store_path: str, out_dir: str) -> None:
    """Rank `rank`: train its stage for warm-up + timed steps, write its figures to out_dir/rank{rank}.json."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    num_stages = len(config.stage_bounds) - 1
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=num_stages)
    try:
        stage = build_stage(
            config.model,
            config.model_config,
            config.stage_bounds[rank],
            config.stage_bounds[rank + 1],
            seed=config.seed,
        )
        clock = ComputeClock()

        def loss_fn(output: Tensor, targets: Tensor) -> Tensor:  # the last rank's: the model's loss
            clock.forward_begin()
            loss = _BackwardMark.apply(stage.loss(output, {"targets": targets}), clock)
            clock.forward_end()
            return loss

        pipe = PipelineStage(TimedStage(stage, clock), rank, num_stages, torch.device("cpu"))
        schedule_cls = Schedule1F1B if config.schedule == "1f1b" else ScheduleGPipe
        schedule = schedule_cls(pipe, config.batch.microbatches_per_step, loss_fn=loss_fn)
        figures = _train(rank, num_stages, config, stage, schedule, clock)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(figures))


def _train(rank, num_stages, config, stage, schedule, clock) -> dict:
    """Warm up, then time `config.steps` steps; returns this rank's figures (losses on the last rank)."""
    M, B = config.batch.microbatches_per_step, config.batch.microbatch_size
    batches = TokenBatches(
        stdlib_text(config.text_bytes),
        seq_len=config.model_config["seq_len"],
        microbatch_size=B,
        seed=config.seed,
    )
    opt = make_optimizer(stage.parameters(), config.optimizer)
    is_first, is_last = rank == 0, rank == num_stages - 1
    step_s, losses = [], []
    busy_s = cpu_s = opt_s = 0.0
    for step in range(config.warmup_steps + config.steps):
        microbatches = [next(batches) for _ in range(M)]  # every rank draws them: same data stream
        x = torch.cat([mb[0] for mb in microbatches])  # (M*B, T)
        y = torch.cat([mb[1] for mb in microbatches])  # (M*B, T)
        step_losses: list[Tensor] = []
        dist.barrier()
        started, cpu_started, busy_started = time.perf_counter(), time.process_time(), clock.busy_s
        if is_first:
            schedule.step(x)
        elif is_last:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        clock.close()
        computed = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt_done = time.perf_counter()
        dist.barrier()
        if step < config.warmup_steps:
            continue
        step_s.append(time.perf_counter() - started)
        busy_s += clock.busy_s - busy_started
        cpu_s += time.process_time() - cpu_started
        opt_s += opt_done - computed
        if is_last:
            losses.append(sum(float(v.detach()) for v in step_losses) / len(step_losses))
    return {
        "rank": rank,
        "step_s": step_s,
        "busy_s": busy_s,
        "cpu_s": cpu_s,
        "optimizer_s": opt_s,
        "losses": losses,
    }


def run_pipelining(config: PipeliningConfig) -> dict:
    """Spawn one process per stage, train, and summarise: tokens/s per timed step (median),
    per-rank utilization = compute seconds / wall seconds of the timed steps, bubble = 1 - mean.

    Raises RuntimeError (from torch.multiprocessing) if a rank fails.
    """
    num_stages = len(config.stage_bounds) - 1
    with tempfile.TemporaryDirectory(prefix="pipelining-") as tmp:
        mp.spawn(_worker, args=(config, str(Path(tmp, "store")), tmp), nprocs=num_stages, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(num_stages)]
    step_s = ranks[0]["step_s"]  # every rank's step ends at the same barrier
    wall_s = sum(step_s)
    tokens_per_step = (
        config.batch.microbatches_per_step * config.batch.microbatch_size * config.model_config["seq_len"]
    )
    rates = [tokens_per_step / s for s in step_s]
    utilization = [r["busy_s"] / wall_s for r in ranks]
    cpu_utilization = [r["cpu_s"] / wall_s for r in ranks]
    return {
        "schedule": config.schedule,
        "stage_bounds": list(config.stage_bounds),
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "steps": len(step_s),
        "wall_s": wall_s,
        "losses": ranks[-1]["losses"],
        "peers": [
            {
                "rank": r["rank"],
                "stage": r["rank"],
                "utilization": u,
                "cpu_utilization": c,
                "compute_s": r["busy_s"],
                "optimizer_s": r["optimizer_s"],
            }
            for r, u, c in zip(ranks, utilization, cpu_utilization)
        ],
        "bubble_fraction": 1 - statistics.mean(utilization),
        "cpu_bubble_fraction": 1 - statistics.mean(cpu_utilization),
    }
