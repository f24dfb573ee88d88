"""A single-process reference loop: a short supervised warm-up, then GRPO with verifiable rewards.

    python -m swarmtrain.rl.local --task add --json
    python -m swarmtrain.rl.local --task add --grpo-steps 0 --save warm   # a swarm run's start

1. Warm-up: AdamW steps of 'weighted_cross_entropy' on train prompts with their answers
   (`swarmtrain.rl.tasks.warmup_batch`), until greedy accuracy on train prompts reaches
   `warmup_target` (or `warmup_steps` at most): short on purpose, the policy should be right
   sometimes, not mostly, so that GRPO's groups hold both rewards.
2. GRPO: each step samples G completions of `prompts_per_step` train prompts from the current
   policy (on-policy, one optimizer step per batch of rollouts), scores them from their text,
   normalises rewards within groups, and takes one AdamW step on the GRPO loss.
3. Held-out greedy accuracy (`swarmtrain.rl.generate.accuracy`) after each phase.

This is what the swarm's RL runs are checked against. Measured with the defaults (tiny-gpt
2 x 64, add with 2 digits, 2 CPU threads; RECIPE.md has the settings and reasons), held-out
greedy accuracy after warm-up -> after 200 GRPO steps, and the whole run's wall time on a
2-core machine busy with other work:

    seed 0: 0.240 -> 0.680 (+0.44), 414 s (305 s CPU)
    seed 1: 0.253 -> 0.630 (+0.38), 277 s (220 s CPU)
    seed 2: 0.213 -> 0.650 (+0.44), 283 s (231 s CPU)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarmtrain.errors import ConfigError
from swarmtrain.model import build_model, get_loss
from swarmtrain.model.swarm_model import SwarmModel
from swarmtrain.rl.generate import SamplingConfig, accuracy, greedy_accuracy, rollout, train_prompts
from swarmtrain.rl.grpo import GRPOConfig, group_advantages, grpo_loss_fn, grpo_microbatch
from swarmtrain.rl.registry import build_task
from swarmtrain.rl.tasks import Task, warmup_batch
from swarmtrain.train.archive import save_model

DEFAULT_MODEL = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 16}
"""tiny-gpt options: small enough for a CPU; seq_len 16 holds '99+99=198\\n'."""


@dataclass(frozen=True, kw_only=True)
class LocalConfig:
    """One warm-up + GRPO run on one task, in this process."""

    task: str = "add"
    """Task name or allowed import path (swarmtrain.rl.registry)."""
    task_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword options of the task's builder, e.g. {'digits': 2}."""
    model: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))
    """tiny-gpt options (GPTConfig fields)."""
    seed: int = 0
    """Seeds the init, the prompts and the sampling."""
    warmup_steps: int = 1000
    """Most supervised steps before GRPO."""
    warmup_target: float = 0.2
    """The warm-up stops early once greedy accuracy on train prompts reaches this (1: never)."""
    warmup_check_every: int = 50
    """Steps between those checks."""
    warmup_batch_size: int = 64
    """Sequences per supervised step."""
    warmup_lr: float = 3e-3
    """AdamW learning rate of the warm-up."""
    grpo_steps: int = 200
    """GRPO optimizer steps."""
    prompts_per_step: int = 64
    """Prompts (groups) sampled per GRPO step."""
    samples_per_prompt: int = 8
    """G: completions per prompt."""
    lr: float = 3e-4
    """AdamW learning rate of GRPO."""
    grpo: GRPOConfig = GRPOConfig()
    """The GRPO loss's hyper-parameters; its temperature is also the sampling temperature."""
    eval_prompts: int = 400
    """Held-out prompts for greedy accuracy."""
    max_grad_norm: float = 1.0
    """Gradient norm clip of both phases (0: none)."""
    threads: int = 2
    """torch.set_num_threads for the run."""

    def __post_init__(self):
        for name in (
            "warmup_batch_size",
            "warmup_check_every",
            "prompts_per_step",
            "samples_per_prompt",
            "eval_prompts",
            "threads",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.grpo_steps < 0:
            raise ConfigError(
                f"steps must be >= 0, got warmup {self.warmup_steps} and GRPO {self.grpo_steps}"
            )


@dataclass(frozen=True, kw_only=True)
class LocalResult:
    """What a local run measured."""

    warmup_accuracy: float
    """Held-out greedy accuracy after the warm-up."""
    final_accuracy: float
    """Held-out greedy accuracy after GRPO."""
    seconds: float
    """Wall time of the whole run, evaluations included."""
    cpu_seconds: float
    """CPU time of this process over the run, all threads together: on a busy machine,
    cpu_seconds / threads bounds what the wall time would be on idle cores."""
    warmup_seconds: float
    """Wall time of the warm-up and its evaluation."""
    warmup_steps: int
    """Supervised steps the warm-up took."""
    mean_rewards: list[float]
    """Mean sampled reward of each GRPO step's rollouts."""
    losses: list[float]
    """GRPO loss of each step."""


def _step(model: SwarmModel, opt: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()


def warmup(model: SwarmModel, task: Task, cfg: LocalConfig, rng: random.Random) -> int:
    """Supervised steps on the task's answers (answer tokens weighted only), `cfg.warmup_steps`
    at most, stopping once greedy accuracy on `cfg.eval_prompts` train prompts (checked every
    `cfg.warmup_check_every` steps) reaches `cfg.warmup_target`: where an addition model's
    accuracy takes off varies by seed, and GRPO needs a policy right sometimes, not mostly.
    The held-out split is never looked at. Returns the steps taken."""
    loss = get_loss("weighted_cross_entropy")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr)
    checks = train_prompts(task, cfg.eval_prompts, random.Random(f"{cfg.seed}-warmup-checks"))
    for step in range(1, cfg.warmup_steps + 1):
        model.train()
        x, inputs = warmup_batch(task, rng, batch_size=cfg.warmup_batch_size, seq_len=model.input_shape[0])
        _step(model, opt, loss(model(x), inputs), cfg.max_grad_norm)
        if step % cfg.warmup_check_every == 0 and greedy_accuracy(model, task, checks) >= cfg.warmup_target:
            return step
    return cfg.warmup_steps


def warm_up(cfg: LocalConfig, rng: random.Random | None = None) -> tuple[SwarmModel, int]:
    """A fresh tiny-gpt of `cfg.model`, initialised from `cfg.seed` as a run's stages initialise
    it, after `warmup` on `cfg.task` with prompts from `rng` (default: one seeded by `cfg.seed`).
    Returns (the model, the warm-up steps it took). An RL run through a swarm starts from such a
    policy: `save_model` it and name the directory as the run's `init_from`."""
    task = build_task(cfg.task, cfg.task_options)
    model = build_model("tiny-gpt", dict(cfg.model), device="meta")
    model.materialise(cfg.seed)
    steps = warmup(model, task, cfg, random.Random(cfg.seed) if rng is None else rng)
    return model, steps


def grpo_step(
    model: SwarmModel,
    opt: torch.optim.Optimizer,
    task: Task,
    cfg: LocalConfig,
    rng: random.Random,
    generator: torch.Generator,
    step: int,
) -> tuple[float, float]:
    """One on-policy GRPO step: sample, score from text, advantages, loss, optimizer step.
    Returns (mean reward of the rollouts, loss)."""
    sampling = SamplingConfig(
        samples_per_prompt=cfg.samples_per_prompt,
        temperature=cfg.grpo.temperature,
        max_new_tokens=task.max_new_tokens,
    )
    prompts = train_prompts(task, cfg.prompts_per_step, rng)
    trajectories = rollout(model, task, prompts, sampling, generator=generator, policy_version=step)
    rewards = torch.tensor([t.reward for t in trajectories])  # (N,)
    advantages = group_advantages(rewards, cfg.samples_per_prompt)  # (N,)
    x, inputs = grpo_microbatch(
        trajectories, advantages.tolist(), seq_len=model.input_shape[0], temperature=cfg.grpo.temperature
    )
    model.train()
    loss = grpo_loss_fn(cfg.grpo)(model(x), inputs)
    _step(model, opt, loss, cfg.max_grad_norm)
    return float(rewards.mean()), loss.item()


def run_local(cfg: LocalConfig, *, save_to: Path | str | None = None) -> LocalResult:
    """Warm up, evaluate, run GRPO, evaluate: see the module docstring. Runs on `cfg.threads`
    torch threads, restoring the caller's count afterwards. With `save_to`, writes the final
    policy there as an export (`coordinator --init-from` starts a run from it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, save_to)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: LocalConfig, save_to: Path | str | None) -> LocalResult:
    start, cpu_start = time.perf_counter(), time.process_time()
    task = build_task(cfg.task, cfg.task_options)
    rng = random.Random(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    model, warmup_steps = warm_up(cfg, rng)
    warmup_accuracy = accuracy(model, task, cfg.eval_prompts)
    warmup_seconds = time.perf_counter() - start
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    mean_rewards, losses = [], []
    for step in range(cfg.grpo_steps):
        reward, loss = grpo_step(model, opt, task, cfg, rng, generator, step)
        mean_rewards.append(reward)
        losses.append(loss)
    if save_to is not None:
        save_model(model, save_to, builder="tiny-gpt", config=dict(cfg.model))
    return LocalResult(
        warmup_accuracy=warmup_accuracy,
        final_accuracy=accuracy(model, task, cfg.eval_prompts),
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
        warmup_seconds=warmup_seconds,
        warmup_steps=warmup_steps,
        mean_rewards=mean_rewards,
        losses=losses,
    )


def main(argv: list[str] | None = None) -> None:
    """Parse flags into a LocalConfig, run it, print the result."""
    d = LocalConfig()
    p = argparse.ArgumentParser(prog="python -m swarmtrain.rl.local", description=__doc__.split("\n")[0])
    p.add_argument("--task", default=d.task)
    p.add_argument("--task-options", type=json.loads, default={}, help="JSON, e.g. '{\"digits\": 2}'")
    p.add_argument("--model", type=json.loads, default=dict(d.model), help="tiny-gpt options as JSON")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--warmup-lr", type=float, default=d.warmup_lr)
    p.add_argument("--warmup-target", type=float, default=d.warmup_target)
    p.add_argument("--grpo-steps", type=int, default=d.grpo_steps)
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--temperature", type=float, default=d.grpo.temperature)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument(
        "--save", type=Path, help="write the final policy to this directory (coordinator --init-from)"
    )
    a = p.parse_args(argv)
    cfg = LocalConfig(
        task=a.task,
        task_options=a.task_options,
        model=a.model,
        seed=a.seed,
        warmup_steps=a.warmup_steps,
        warmup_lr=a.warmup_lr,
        warmup_target=a.warmup_target,
        grpo_steps=a.grpo_steps,
        prompts_per_step=a.prompts_per_step,
        samples_per_prompt=a.samples_per_prompt,
        lr=a.lr,
        grpo=GRPOConfig(temperature=a.temperature),
        eval_prompts=a.eval_prompts,
        threads=a.threads,
    )
    result = run_local(cfg, save_to=a.save)
    if a.json:
        summary = {k: v for k, v in asdict(result).items() if k not in ("mean_rewards", "losses")}
        print(json.dumps({**summary, "config": {**asdict(cfg), "grpo": asdict(cfg.grpo)}}))
    else:
        print(
            f"{cfg.task}: held-out greedy accuracy {result.warmup_accuracy:.3f} after warm-up, "
            f"{result.final_accuracy:.3f} after {cfg.grpo_steps} GRPO steps ({result.seconds:.0f} s)"
        )
    if a.save is not None:
        print(f"policy written to {a.save}: start a run from it with --init-from {a.save}", file=sys.stderr)


if __name__ == "__main__":
    main()
