"""Sampling completions from a whole policy, with the log-probs the GRPO loss needs.

`generate` samples `samples_per_prompt` completions of every prompt (one group per prompt),
through a KV-cached `Decoder` (swarmtrain.rl.decoding), until each row emits a stop token or
runs out of `max_new_tokens`.

The behaviour log-prob of a sampled token is its log-probability under the distribution it
was sampled from: log_softmax(logits / temperature)[token], the temperature-scaled policy,
as TRL and prime-rl define it. The GRPO loss recomputes the same quantity from the trainer's
logits with the same temperature (`GRPOConfig.temperature`), so at an unchanged policy the
ratio is exactly 1 up to float rounding. No top-k or top-p: they would change the sampling
distribution without the loss knowing. Temperature 0 is greedy decoding; its behaviour
log-probs are 0 (the token was chosen with probability 1), meant for evaluation only.

Rewards are not computed here: `rollout` scores completions with a task, from their text.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from swarmtrain.errors import ConfigError
from swarmtrain.model.swarm_model import SwarmModel
from swarmtrain.rl.decoding import decoder_for
from swarmtrain.rl.tasks import PAD_ID, Task


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How `generate` samples."""

    samples_per_prompt: int = 8
    """G: completions sampled per prompt, one group."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 is greedy."""
    max_new_tokens: int = 16
    """Completion budget per row, the stop token included."""

    def __post_init__(self):
        if not isinstance(self.samples_per_prompt, int) or self.samples_per_prompt < 1:
            raise ConfigError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt!r}")
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One sampled completion of one prompt."""

    prompt_ids: tuple[int, ...]
    """The prompt's tokens."""
    completion_ids: tuple[int, ...]
    """The sampled tokens, the stop token included if one was sampled."""
    behaviour_logprobs: tuple[float, ...]
    """log_softmax(logits / temperature) of each completion token under the sampling policy."""
    temperature: float
    """The temperature it was sampled at."""
    policy_version: int
    """Version (optimizer step) of the policy that sampled it."""
    group_id: int
    """Completions of the same prompt in one call share a group id."""
    reward: float | None = None
    """The task's reward for the completion, once scored (`score`); None before."""

    def __post_init__(self):
        if len(self.completion_ids) != len(self.behaviour_logprobs):
            raise ValueError(
                f"{len(self.completion_ids)} completion tokens but {len(self.behaviour_logprobs)} log-probs"
            )


def _left_pad(prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), PAD_ID, dtype=torch.int64)  # (B, P)
    mask = torch.zeros(len(prompts), P, dtype=torch.int64)  # (B, P)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.int64)
        mask[b, P - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def generate(
    model: SwarmModel,
    prompts: list[list[int]],
    cfg: SamplingConfig,
    *,
    stop_id: int,
    generator: torch.Generator | None = None,
    policy_version: int = 0,
    first_group_id: int = 0,
) -> list[Trajectory]:
    """Sample `cfg.samples_per_prompt` completions of each prompt (lists of token ids) from `model`.

    Returns len(prompts) * G trajectories, prompt by prompt (the G of prompt i have group id
    `first_group_id + i`). Sampling draws from `generator` (on the model's device), so a seeded
    generator gives the same completions. The model runs in eval mode (restored afterwards)
    under no_grad. Raises ConfigError if a prompt is empty or a prompt plus the completion
    budget does not fit the model's input length, which the trainer's microbatches must.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generate needs at least one prompt, and no empty prompt")
    longest = max(len(p) for p in prompts) + cfg.max_new_tokens - 1
    if longest > model.input_shape[0]:
        raise ConfigError(
            f"a prompt of {max(len(p) for p in prompts)} tokens plus max_new_tokens={cfg.max_new_tokens} "
            f"takes {longest} positions, more than the model's input length {model.input_shape[0]}"
        )
    G = cfg.samples_per_prompt
    rows = [p for p in prompts for _ in range(G)]
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in _left_pad(rows))  # (B, P), (B, P)
    B = ids.size(0)
    was_training = model.training
    model.eval()
    try:
        decoder = decoder_for(model)
        logits = decoder.prefill(ids, mask)[:, -1]  # (B, V)
        tokens = torch.empty(B, 0, dtype=torch.int64, device=device)  # (B, n)
        logps = torch.empty(B, 0, device=device)  # (B, n)
        done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        for n in range(cfg.max_new_tokens):
            if cfg.temperature == 0:
                tok = logits.argmax(dim=-1)  # (B,)
                lp = torch.zeros(B, device=device)  # (B,)
            else:
                lsm = F.log_softmax(logits.float() / cfg.temperature, dim=-1)  # (B, V)
                tok = torch.multinomial(lsm.exp(), 1, generator=generator)[:, 0]  # (B,)
                lp = lsm.gather(1, tok[:, None])[:, 0]  # (B,)
            tok = torch.where(done, PAD_ID, tok)
            tokens, logps = torch.cat((tokens, tok[:, None]), 1), torch.cat((logps, lp[:, None]), 1)
            done = done | (tok == stop_id)
            if bool(done.all()) or n == cfg.max_new_tokens - 1:
                break
            logits = decoder.step(tok)  # (B, V)
    finally:
        model.train(was_training)
    out = []
    tokens, logps = tokens.tolist(), logps.tolist()
    for b in range(B):
        row = tokens[b]
        length = row.index(stop_id) + 1 if stop_id in row else len(row)
        out.append(
            Trajectory(
                prompt_ids=tuple(rows[b]),
                completion_ids=tuple(row[:length]),
                behaviour_logprobs=tuple(logps[b][:length]),
                temperature=float(cfg.temperature),
                policy_version=policy_version,
                group_id=first_group_id + b // G,
            )
        )
    return out


def score(task: Task, trajectories: list[Trajectory]) -> list[Trajectory]:
    """`trajectories` with their rewards recomputed from text by `task`: the prompt and the
    completion decoded from their token ids. Any reward a trajectory carried is ignored."""
    tok = task.tokenizer
    return [
        replace(t, reward=task.reward(tok.decode(list(t.prompt_ids)), tok.decode(list(t.completion_ids))))
        for t in trajectories
    ]


def rollout(
    model: SwarmModel,
    task: Task,
    prompts: list[str],
    cfg: SamplingConfig,
    *,
    generator: torch.Generator | None = None,
    policy_version: int = 0,
    first_group_id: int = 0,
) -> list[Trajectory]:
    """Sample G completions of each prompt text with `generate` and score them with `task`."""
    tok = task.tokenizer
    trajectories = generate(
        model,
        [tok.encode(p) for p in prompts],
        cfg,
        stop_id=tok.end_id,
        generator=generator,
        policy_version=policy_version,
        first_group_id=first_group_id,
    )
    return score(task, trajectories)


def greedy_accuracy(model: SwarmModel, task: Task, prompts: list[str]) -> float:
    """The mean reward of greedy completions of `prompts`."""
    cfg = SamplingConfig(samples_per_prompt=1, temperature=0.0, max_new_tokens=task.max_new_tokens)
    scored = rollout(model, task, prompts, cfg)
    return sum(t.reward for t in scored) / len(scored)


def accuracy(model: SwarmModel, task: Task, n: int, *, seed: int = 0) -> float:
    """Held-out greedy accuracy: the mean reward of greedy completions of `n` distinct held-out
    prompts (`Task.held_out_prompts(n, seed=seed)`)."""
    return greedy_accuracy(model, task, task.held_out_prompts(n, seed=seed))


def train_prompts(task: Task, n: int, rng: random.Random) -> list[str]:
    """`n` train-split prompts drawn with `rng` (repeats possible)."""
    return [task.train_prompt(rng) for _ in range(n)]


def measure_decode(
    model: SwarmModel,
    task: Task,
    *,
    samples_per_prompt: int,
    prompts: int = 4,
    seconds: float = 0.3,
    temperature: float = 1.0,
) -> float:
    """Decode tokens per second `model` achieves sampling as a rollout peer does: G =
    `samples_per_prompt` completions of `prompts` train prompts at once, repeated for about
    `seconds` (at least once, after one warm-up batch). Every sample counts the task's whole
    completion budget (`task.max_new_tokens`), so the rate in samples per second is this over
    that budget: what the RL planner divides (`swarmtrain.plan.rl`)."""
    if not seconds > 0 or prompts < 1:
        raise ConfigError(f"measure_decode needs seconds > 0 and prompts >= 1, got {seconds!r}, {prompts!r}")
    cfg = SamplingConfig(
        samples_per_prompt=samples_per_prompt, temperature=temperature, max_new_tokens=task.max_new_tokens
    )
    rng = random.Random(0)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    batch = [task.tokenizer.encode(p) for p in train_prompts(task, prompts, rng)]
    generate(model, batch, cfg, stop_id=task.tokenizer.end_id, generator=generator)  # warm-up
    samples, start = 0, time.perf_counter()
    while True:
        samples += len(generate(model, batch, cfg, stop_id=task.tokenizer.end_id, generator=generator))
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return samples * task.max_new_tokens / elapsed
