"""Trainer <-> rollout peer: a request for completions of some prompts, and its answer.

| frame kind   | meta record     | tensors                                                    |
|--------------|-----------------|------------------------------------------------------------|
| rollout      | RolloutRequest  | prompts (N, L) int64, prompt_lengths (N,) int64             |
| rollout_data | RolloutReply    | completions (N*G, M) int64, lengths (N*G,) int64,           |
|              |                 | logprobs (N*G, M) float32, rewards (N*G,) float32           |

Prompts are right-padded token ids; completion row i answers prompt i // G. `decode_reply`
checks everything a trainer can check without the model (shapes, token ids, lengths, finite
log-probs that are probabilities' logs, a policy version the swarm has served) and raises
BadFrameError naming the first thing wrong: such a reply is the rollout peer's fault.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from swarmtrain.errors import BadFrameError
from swarmtrain.wire.meta import Message, _int

MAX_PROMPTS = 4096
MAX_NEW_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class RolloutRequest(Message):
    """Sample `samples_per_prompt` completions of each prompt with a policy version at least
    `min_version` (a rollout peer further behind refuses before it starts: its work would
    arrive too stale); `latest_version` is the newest one the stages hold (a peer behind it
    fetches it at once, rather than when the DHT records show it); `seed` seeds the sampling."""

    WHAT = "rollout request"
    FIELDS = {
        "samples_per_prompt": _int(1, 1024),
        "max_new_tokens": _int(1, MAX_NEW_TOKENS),
        "min_version": _int(),
        "latest_version": _int(),
        "seed": _int(0, 2**63 - 1),
    }
    samples_per_prompt: int
    max_new_tokens: int
    min_version: int = 0
    latest_version: int = 0
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class RolloutReply(Message):
    """The policy version that sampled every completion of the reply."""

    WHAT = "rollout reply"
    FIELDS = {"version": _int()}
    version: int


def encode_prompts(prompts: list[list[int]]) -> dict[str, Tensor]:
    """Prompts (lists of token ids) as the request's tensors, right-padded with 0."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.int64)  # (N, L)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
    return {"prompts": ids, "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.int64)}


def decode_prompts(tensors: dict[str, Tensor], vocab_size: int, max_len: int) -> list[list[int]]:
    """The request's prompts; BadFrameError if they are malformed or longer than `max_len`."""
    _names(tensors, {"prompts", "prompt_lengths"}, "rollout request")
    ids, lengths = tensors["prompts"], tensors["prompt_lengths"]
    if ids.dtype != torch.int64 or ids.dim() != 2 or not 0 < ids.size(0) <= MAX_PROMPTS:
        raise BadFrameError(f"rollout request: prompts must be (N <= {MAX_PROMPTS}, L) int64")
    if lengths.dtype != torch.int64 or tuple(lengths.shape) != (ids.size(0),):
        raise BadFrameError("rollout request: prompt_lengths must be (N,) int64, one per prompt")
    if bool(((lengths < 1) | (lengths > min(ids.size(1), max_len))).any()):
        raise BadFrameError(f"rollout request: every prompt must have 1..{min(ids.size(1), max_len)} tokens")
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise BadFrameError(f"rollout request: prompt token ids must be in [0, {vocab_size})")
    return [ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]


def encode_completions(
    completions: list[tuple[int, ...]], logprobs: list[tuple[float, ...]], rewards: list[float], width: int
) -> dict[str, Tensor]:
    """Completions, their behaviour log-probs and claimed rewards as the reply's tensors."""
    N = len(completions)
    ids = torch.zeros(N, width, dtype=torch.int64)  # (N, M)
    lps = torch.zeros(N, width, dtype=torch.float32)  # (N, M)
    for i, (c, lp) in enumerate(zip(completions, logprobs, strict=True)):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.int64)
        lps[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return {
        "completions": ids,
        "lengths": torch.tensor([len(c) for c in completions], dtype=torch.int64),
        "logprobs": lps,
        "rewards": torch.tensor(rewards, dtype=torch.float32),
    }


@dataclass(frozen=True)
class Completions:
    """A checked reply: per completion row its tokens, behaviour log-probs and claimed reward."""

    version: int
    tokens: list[tuple[int, ...]]
    logprobs: list[tuple[float, ...]]
    rewards: list[float]


def decode_reply(
    meta: dict,
    tensors: dict[str, Tensor],
    *,
    rows: int,
    max_new_tokens: int,
    vocab_size: int,
    newest_version: int,
) -> Completions:
    """A rollout reply for `rows` completions, checked; BadFrameError naming what is wrong."""
    version = RolloutReply.from_meta(meta).version
    if version > newest_version:
        raise BadFrameError(
            f"rollout reply claims policy version {version}, but the swarm has served only up to {newest_version}"
        )
    _names(tensors, {"completions", "lengths", "logprobs", "rewards"}, "rollout reply")
    ids, lengths, lps, rewards = (tensors[k] for k in ("completions", "lengths", "logprobs", "rewards"))
    M = ids.size(1) if ids.dim() == 2 else -1
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.size(0) != rows or not 0 < M <= max_new_tokens:
        raise BadFrameError(f"rollout reply: completions must be ({rows}, <= {max_new_tokens}) int64")
    if lps.dtype != torch.float32 or tuple(lps.shape) != tuple(ids.shape):
        raise BadFrameError(
            f"rollout reply: logprobs must be float32 shaped like completions {tuple(ids.shape)}"
        )
    for name, t, dtype in (("lengths", lengths, torch.int64), ("rewards", rewards, torch.float32)):
        if t.dtype != dtype or tuple(t.shape) != (rows,):
            raise BadFrameError(
                f"rollout reply: {name} must be ({rows},) {str(dtype).removeprefix('torch.')}"
            )
    if bool(((lengths < 1) | (lengths > M)).any()):
        raise BadFrameError(f"rollout reply: lengths must be in 1..{M} (the tokens of each completion)")
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise BadFrameError(f"rollout reply: completions must hold token ids in [0, {vocab_size})")
    if not bool(torch.isfinite(lps).all()) or bool((lps > 1e-4).any()):
        raise BadFrameError(
            "rollout reply: logprobs must be finite and <= 0 (behaviour log-probs: logs of probabilities)"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise BadFrameError("rollout reply: rewards must be finite")
    n = lengths.tolist()
    return Completions(
        version=version,
        tokens=[tuple(ids[i, : n[i]].tolist()) for i in range(rows)],
        logprobs=[tuple(lps[i, : n[i]].tolist()) for i in range(rows)],
        rewards=[float(r) for r in rewards.tolist()],
    )


def _names(tensors: dict[str, Tensor], want: set[str], what: str) -> None:
    if set(tensors) != want:
        raise BadFrameError(f"{what}: tensors must be exactly {sorted(want)}, got {sorted(tensors)}")
