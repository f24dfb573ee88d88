"""`swarmtrain demo --rl`: a short supervised warm-up on a task, then GRPO through a local swarm.

The warm-up runs in this process (`swarmtrain.rl.local.warm_up`): it teaches tiny-gpt the
task's format and a little of its answers, on purpose no more, and ends with the held-out
greedy accuracy. The swarm then starts from those weights (`coordinator --init-from`): a
coordinator naming the task, one stage peer per stage, rollout peers (`join --role rollout`)
and a trainer in this process, which trains GRPO on the rollout peers' completions and
prints each step's mean reward. At the end the demo fetches the trained policy from the
stages and measures the same held-out accuracy again.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from swarmtrain.errors import ConfigError
from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
from swarmtrain.rl.feed import RolloutFeed
from swarmtrain.rl.generate import accuracy
from swarmtrain.rl.local import DEFAULT_MODEL, LocalConfig, warm_up
from swarmtrain.rl.registry import build_task
from swarmtrain.train.archive import save_model
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from swarmtrain.wire.rl_config import RLConfig


@dataclass(frozen=True, kw_only=True)
class RLDemoConfig:
    task: str = "add"
    task_options: dict = field(default_factory=lambda: {"digits": 2})
    model_config: dict = field(default_factory=lambda: dict(DEFAULT_MODEL))
    warmup_steps: int = 1000
    """Most supervised steps in this process before the swarm starts; the warm-up stops
    sooner, once greedy accuracy on train prompts reaches `warmup_target` (short on purpose:
    GRPO needs a policy that is right sometimes, not mostly)."""
    warmup_target: float = 0.2
    warmup_lr: float = 3e-3
    steps: int = 200
    """GRPO steps through the swarm."""
    num_stages: int = 2
    rollout_peers: int = 2
    samples_per_prompt: int = 8
    prompts_per_step: int = 64
    lr: float = 3e-4
    max_grad_norm: float = 1.0
    eval_prompts: int = 400
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "num_stages", "rollout_peers", "prompts_per_step", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"demo --rl: {name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.warmup_steps < 0:
            raise ConfigError(f"demo --rl: warmup steps must be >= 0, got {self.warmup_steps}")

    @property
    def rl(self) -> RLConfig:
        """The run's task and groups (the coordinator's --task, --samples-per-prompt)."""
        return RLConfig(
            task=self.task, task_options=self.task_options, samples_per_prompt=self.samples_per_prompt
        )

    @property
    def batch(self) -> BatchConfig:
        """A step's prompts x G completions, in 8 microbatches (or one per prompt's group)."""
        per_step = self.prompts_per_step * self.samples_per_prompt
        microbatches = 8 if self.prompts_per_step % 8 == 0 else self.prompts_per_step
        return BatchConfig(
            microbatch_size=per_step // microbatches,
            microbatches_per_step=microbatches,
            max_in_flight=microbatches,
        )


def run_rl_demo(config: RLDemoConfig, *, quiet: bool = False) -> dict:
    """Warm up, train GRPO through a local swarm, and return what was measured."""
    console = Console(stderr=True, quiet=quiet)
    task = build_task(config.task, config.task_options)
    t0 = time.monotonic()
    local = LocalConfig(
        task=config.task,
        task_options=config.task_options,
        model=config.model_config,
        warmup_steps=config.warmup_steps,
        warmup_target=config.warmup_target,
        warmup_lr=config.warmup_lr,
        seed=config.seed,
    )
    console.print(
        f"warm-up on {config.task!r} in this process, until greedy accuracy on train prompts reaches "
        f"{config.warmup_target} (at most {config.warmup_steps} steps)"
    )
    model, warmup_steps = warm_up(local)
    warm_accuracy = accuracy(model, task, config.eval_prompts)
    console.print(
        f"held-out accuracy after {warmup_steps} warm-up steps: {warm_accuracy:.3f} ({time.monotonic() - t0:.0f} s)"
    )

    with tempfile.TemporaryDirectory(prefix="swarmtrain-rl-demo-") as tmp:
        warm = save_model(model, Path(tmp) / "warm", builder="tiny-gpt", config=config.model_config)
        swarm_config = LocalSwarmConfig(
            run_id="rl-demo",
            model_config=config.model_config,
            num_stages=config.num_stages,
            rl=config.rl,
            rollout_peers=config.rollout_peers,
            init_from=str(warm),
            batch=config.batch,
            optimizer=OptimizerConfig(
                name="adamw", lr=config.lr, weight_decay=0.0, max_grad_norm=config.max_grad_norm
            ),
            seed=config.seed,
            log_dir=str(Path(tmp) / "logs"),
            coordinator_args=("--checkpoint-every", "0"),
        )
        console.print(
            f"starting a swarm: {config.num_stages} stage peers, {config.rollout_peers} rollout peers, "
            f"GRPO on {config.prompts_per_step} prompts x {config.samples_per_prompt} completions a step"
        )
        with LocalSwarm(swarm_config) as swarm:
            trained, rewards, lags, grpo_seconds = _train(swarm, config, console)
    final_accuracy = accuracy(trained, task, config.eval_prompts)
    console.print(
        f"held-out accuracy: {warm_accuracy:.3f} after the warm-up, {final_accuracy:.3f} after "
        f"{config.steps} GRPO steps ({final_accuracy - warm_accuracy:+.3f})"
    )
    return {
        "task": config.task,
        "task_options": config.task_options,
        "warmup_steps": warmup_steps,
        "warmup_accuracy": warm_accuracy,
        "final_accuracy": final_accuracy,
        "gain": final_accuracy - warm_accuracy,
        "steps": config.steps,
        "rewards": rewards,
        "policy_lag": lags,
        "grpo_seconds": grpo_seconds,
        "seconds": time.monotonic() - t0,
    }


def _train(swarm: LocalSwarm, config: RLDemoConfig, console: Console):
    """GRPO through the swarm: (the trained policy, each step's reward, its policy lag, seconds)."""
    rewards, lags = [], []
    with swarm.trainer() as trainer:
        feed = RolloutFeed(trainer)
        t0 = time.monotonic()
        for result in trainer.train(feed, steps=config.steps):
            report = feed.report(result.step)
            rewards.append(report["reward"])
            lags.append(report["policy_lag"])
            console.print(
                f"step {result.step:3d}  reward {report['reward']:.3f}  policy lag {report['policy_lag']:.1f}  "
                f"{result.seconds:.1f} s  stale {report['stale']}"
            )
        seconds = time.monotonic() - t0
        return trainer.fetch_model(), rewards, lags, seconds
