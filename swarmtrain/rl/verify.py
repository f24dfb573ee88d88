"""Checking a rollout peer's behaviour log-probs against the pipeline's (pure).

A rollout peer claims, for each completion token, the log-probability its policy gave that
token (`Trajectory.behaviour_logprobs`); GRPO's importance ratio divides by it, so a peer
that lies about it steers the update as surely as one that lies about rewards, and no
reward check sees it. The trainer recomputes them for a sample of replies through the
pipeline (`swarmtrain.train.scoring`), only for replies sampled by the version the stages
hold, where the two must agree up to the sampler's arithmetic: ~1e-7 nats at full precision,
under 0.02 from bf16/int8-coded or 8-bit weights, up to ~0.09 from 4-bit ones, on the small
policy `benchmarks/logprob_check.py` measures (liars: 0.2 and up).
A reply whose mean absolute gap over its completion tokens exceeds the run's
`RLConfig.logprob_tolerance` bans its peer (`swarmtrain.rl.feed`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from torch import Tensor

from swarmtrain.rl.generate import Trajectory
from swarmtrain.rl.grpo import grpo_microbatch


def check_microbatch(
    trajectories: Sequence[Trajectory],
    rng: random.Random,
    *,
    microbatch_size: int,
    seq_len: int,
    temperature: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A GRPO microbatch of at most `microbatch_size` of `trajectories` (a sample drawn with
    `rng` when there are more), zero advantages: what a score pass takes. Its
    'behaviour_logprobs' are the claims and its 'mask' marks the completion tokens."""
    rows = sorted(rng.sample(range(len(trajectories)), min(len(trajectories), microbatch_size)))
    chosen = [trajectories[i] for i in rows]
    return grpo_microbatch(chosen, [0.0] * len(chosen), seq_len=seq_len, temperature=temperature)


def logprob_gap(recomputed: Tensor, named: dict[str, Tensor]) -> float:
    """Mean |claimed - recomputed| log-prob over the completion tokens of a check microbatch
    (`check_microbatch`); `recomputed` (B, T) are the pipeline's scores."""
    mask = named["mask"]  # (B, T)
    diff = (named["behaviour_logprobs"] - recomputed.float()).abs() * mask  # (B, T)
    return float(diff.sum() / mask.sum().clamp(min=1.0))


def lie_about_logprobs(logprobs: Sequence[Sequence[float]], rng: random.Random) -> list[list[float]]:
    """A lying rollout peer's claims (testing: `--inject-fault lie-logprobs`): each completion's
    log-probs shuffled among its tokens and shifted by -1 nat, so its tokens, and so its
    rewards, stay right while its importance ratios do not."""
    out = []
    for row in logprobs:
        row = list(row)
        rng.shuffle(row)
        out.append([v - 1.0 for v in row])
    return out
