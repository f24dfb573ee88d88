"""RL post-training with verifiable rewards (GRPO), the single-process core.

- `tasks`, `registry`: tasks whose answers can be checked from text, and where they come from;
- `decoding`, `generate`: KV-cached sampling from a whole policy, with behaviour log-probs;
- `grpo`: group-normalised advantages and the GRPO loss, registered as named losses
  ('grpo', 'grpo_kl') the pipeline's last stage can compute;
- `local`: warm-up + GRPO in one process, the reference for swarm runs (RECIPE.md); `warm_up`
  makes the policy a swarm run starts from;
- `feed`: `RolloutFeed`, an RL run's data through a swarm (also `swarmtrain.RolloutFeed`).

Importing this package registers the GRPO losses.
"""

from importlib import import_module

from swarmtrain.rl.generate import SamplingConfig, Trajectory, accuracy, generate, rollout, score
from swarmtrain.rl.grpo import GRPOConfig, group_advantages, grpo_config, grpo_microbatch, register_grpo_loss
from swarmtrain.rl.registry import TaskSources, build_task, register_task, registered_tasks, resolve_task
from swarmtrain.rl.tasks import ByteTokenizer, Task, warmup_batch

__all__ = [
    "DEFAULT_MODEL",
    "ByteTokenizer",
    "GRPOConfig",
    "LocalConfig",
    "SamplingConfig",
    "Task",
    "TaskSources",
    "Trajectory",
    "accuracy",
    "build_task",
    "generate",
    "group_advantages",
    "grpo_config",
    "grpo_microbatch",
    "register_grpo_loss",
    "register_task",
    "registered_tasks",
    "resolve_task",
    "rollout",
    "score",
    "warm_up",
    "warmup_batch",
]

_LOCAL = ("DEFAULT_MODEL", "LocalConfig", "warm_up")
"""Loaded on first use: `python -m swarmtrain.rl.local` must find its module not imported yet."""


def __getattr__(name: str):
    if name in _LOCAL:
        return getattr(import_module("swarmtrain.rl.local"), name)
    raise AttributeError(f"module 'swarmtrain.rl' has no attribute {name!r}")
