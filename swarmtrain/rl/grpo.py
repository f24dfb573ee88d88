"""GRPO: group-normalised advantages and the clipped policy-gradient loss, as a named loss.

Advantages. Each prompt's G completions form a group; a completion's advantage is its
reward's distance from the group mean in units of the group's (population) standard
deviation: A = (r - mean) / (std + eps). A group whose rewards are all equal (all right, all
wrong) has zero advantages: it carries no policy-gradient signal at all, and costs only the
compute of its tokens.

Loss. Per completion token t, with logp_t = log_softmax(logits / temperature)[token] from the
trainer's forward and b_t the behaviour log-prob the sampler recorded (swarmtrain.rl.generate,
the same definition):

    r_t    = exp(logp_t - b_t)                          the importance ratio
    c_t    = min(r_t, delta)                            capped at delta (INTELLECT-2)
    pg_t   = max(-c_t A, -clip(c_t, 1 - eps, 1 + eps) A)  PPO's clip, as a loss

For A >= 0 this is PPO's clipped objective. For A < 0 PPO alone is unbounded as the ratio
grows; the cap makes pg_t constant (no gradient) once r_t > delta, INTELLECT-2's two-sided
clipping (prime-rl's grpo_loss_clip). Optionally plus kl_coef times the k3 estimate of
KL(policy || reference), exp(ref_t - logp_t) - (ref_t - logp_t) - 1, and minus entropy_coef
times the entropy of the temperature-scaled distribution.

Normalisation. The swarm backpropagates each microbatch's loss and sums the gradients, and a
step's samples may fall into microbatches anyhow, so the loss must be linear over samples:
it is the sum over masked tokens divided by the number of ALL positions of the microbatch
(B * T, a constant of the run's shapes), never by the microbatch's own count of completion
tokens (which would weight a token by who shared its microbatch). This is the constant
normaliser of Dr. GRPO / prime-rl's max_tokens. 'mask' may hold any non-negative weights: to
weight each completion by 1 / its length instead, scale its mask (the loss stays linear).

Hyper-parameters. A loss function sees only (output, inputs), so each set of
hyper-parameters is a loss registered under its own name (`register_grpo_loss(name,
GRPOConfig(...))`; built in: 'grpo' and 'grpo_kl'). The alternative, per-sample scalar inputs
('clip', 'temperature'), would let each trainer change them without registering anything,
but would cost every microbatch extra tensors, let one step mix objectives silently, and
leave the run manifest (which names the loss) blind to the objective. With a name the
objective is fixed for the run and recorded, and rollout peers read the sampling temperature
from it (`grpo_config(name).temperature`), so sampler and loss cannot disagree;
`grpo_microbatch` refuses trajectories sampled at another temperature. The cost: a new
variant must be registered (in the model builder's module) on every peer.

Loss inputs, per sample, aligned with 'targets' (position t predicts token t + 1), T the
model's seq_len: targets (T,) int64, behaviour_logprobs (T,) float32, advantages (T,)
float32 (0 outside the completion), mask (T,) float32 (1 on completion tokens); 'grpo_kl'
also ref_logprobs (T,) float32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from swarmtrain.errors import ConfigError
from swarmtrain.model.losses import LossFn, SampleSpec, class_targets, register_loss
from swarmtrain.rl.generate import Trajectory
from swarmtrain.rl.tasks import PAD_ID


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """The hyper-parameters of one GRPO loss variant."""

    clip_eps: float = 0.2
    """eps: the ratio is clipped to [1 - eps, 1 + eps] (PPO)."""
    ratio_cap: float = 4.0
    """delta: the ratio is capped here, bounding the loss of tokens with negative advantages
    (INTELLECT-2 uses 4); must exceed 1 + clip_eps."""
    temperature: float = 1.0
    """The sampling temperature: logits are divided by it before the log-softmax, as the
    sampler did when it recorded the behaviour log-probs."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to a reference policy; > 0 adds the input 'ref_logprobs'."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""

    def __post_init__(self):
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"GRPO clip_eps must be in (0, 1), got {self.clip_eps}")
        if not self.ratio_cap > 1 + self.clip_eps:
            raise ConfigError(
                f"GRPO ratio_cap must exceed 1 + clip_eps = {1 + self.clip_eps}, got {self.ratio_cap}"
            )
        if not self.temperature > 0:
            raise ConfigError(
                f"GRPO temperature must be > 0 (greedy samples cannot be trained on), got {self.temperature}"
            )
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ConfigError(
                f"GRPO kl_coef and entropy_coef must be >= 0, got {self.kl_coef} and {self.entropy_coef}"
            )


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps) for rewards (N,) in consecutive groups of `group_size`.

    The std is the population one (divisor G), so a group of 0/1 rewards gets advantages of
    unit variance. A group of equal rewards gets zeros. Raises ValueError if N is not a
    multiple of the group size.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{tuple(rewards.shape)} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (N/G, G)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, correction=0, keepdim=True) + eps)  # (N/G, G)
    return a.view(-1)  # (N,)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) at the targets: logits (B, T, V), targets (B, T) -> (B, T)."""
    lsm = F.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return lsm.gather(-1, targets[..., None])[..., 0]  # (B, T)


def grpo_token_loss(logits: Tensor, inputs: Mapping[str, Tensor], cfg: GRPOConfig) -> Tensor:
    """The per-position loss (B, T) before masking and normalising (see the module docstring)."""
    logp = token_logprobs(logits, inputs["targets"], cfg.temperature)  # (B, T)
    A = inputs["advantages"]  # (B, T)
    ratio = torch.exp(logp - inputs["behaviour_logprobs"]).clamp(max=cfg.ratio_cap)  # (B, T)
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)  # (B, T)
    loss = torch.maximum(-ratio * A, -clipped * A)  # (B, T)
    if cfg.kl_coef > 0:
        d = inputs["ref_logprobs"] - logp  # (B, T)
        loss = loss + cfg.kl_coef * (torch.exp(d) - d - 1)
    if cfg.entropy_coef > 0:
        lsm = F.log_softmax(logits.float() / cfg.temperature, dim=-1)  # (B, T, V)
        entropy = -(lsm.exp() * lsm).sum(dim=-1)  # (B, T)
        loss = loss - cfg.entropy_coef * entropy
    return loss


def grpo_loss_fn(cfg: GRPOConfig) -> LossFn:
    """The loss fn(logits (B, T, V), inputs) -> scalar of GRPO variant `cfg`: the masked
    per-token loss summed and divided by B * T."""

    def grpo_loss(output: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
        per_token = grpo_token_loss(output, inputs, cfg)  # (B, T)
        return (per_token * inputs["mask"]).sum() / inputs["mask"].numel()

    return grpo_loss


_CONFIGS: dict[str, GRPOConfig] = {}
_FNS: dict[str, LossFn] = {}


def register_grpo_loss(name: str, cfg: GRPOConfig) -> LossFn:
    """Register GRPO variant `cfg` as loss `name` (swarmtrain.model.losses.register_loss).

    Its inputs are targets, behaviour_logprobs, advantages and mask, plus ref_logprobs when
    cfg.kl_coef > 0, each (T,) for (T, V) logits. Registering the same config under the same
    name again is a no-op; another config under a taken name raises ConfigError.
    """
    known = _CONFIGS.get(name)
    if known is not None:
        if known != cfg:
            raise ConfigError(f"GRPO loss {name!r} is already registered with {known}")
        return _FNS[name]

    def inputs(out: SampleSpec) -> dict[str, SampleSpec]:
        targets = class_targets(out, name)
        per_token = (targets[0], torch.float32)
        specs = {
            "targets": targets,
            "behaviour_logprobs": per_token,
            "advantages": per_token,
            "mask": per_token,
        }
        return {**specs, "ref_logprobs": per_token} if cfg.kl_coef > 0 else specs

    def score(output: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
        """Per-token log-probs of the targets at the loss's temperature, (B, T) float32: what a
        rollout peer claims as behaviour log-probs, recomputed by the stages (the feed's check)."""
        return token_logprobs(output, inputs["targets"], cfg.temperature)  # (B, T)

    fn = grpo_loss_fn(cfg)
    register_loss(name, inputs=inputs, score=score)(fn)
    _CONFIGS[name], _FNS[name] = cfg, fn
    return fn


def grpo_config(name: str) -> GRPOConfig:
    """The config of GRPO loss `name`; ConfigError naming the registered GRPO losses."""
    if name not in _CONFIGS:
        raise ConfigError(
            f"{name!r} is not a GRPO loss: registered GRPO losses are {', '.join(sorted(_CONFIGS))}"
        )
    return _CONFIGS[name]


register_grpo_loss("grpo", GRPOConfig())
register_grpo_loss("grpo_kl", GRPOConfig(kl_coef=0.04))


def grpo_microbatch(
    trajectories: Sequence[Trajectory], advantages: Sequence[float], *, seq_len: int, temperature: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scored trajectories as one microbatch (x, {name: tensor}) for a 'grpo' loss.

    x (B, seq_len) int64 is prompt + completion (without its last token, which is only a
    target), right-padded with PAD_ID from position 0, as generation positioned it; targets
    (B, seq_len) int64 are the next tokens; behaviour_logprobs, advantages (the trajectory's
    advantage on each of its completion tokens) and mask (1 on completion tokens) are (B,
    seq_len) float32, zero elsewhere. Raises ConfigError if a trajectory was sampled at
    another temperature than the loss's, or does not fit `seq_len`.
    """
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    B = len(trajectories)
    x = torch.full((B, seq_len), PAD_ID, dtype=torch.int64)  # (B, T)
    targets = torch.full((B, seq_len), PAD_ID, dtype=torch.int64)  # (B, T)
    blp, adv, mask = (torch.zeros(B, seq_len) for _ in range(3))  # 3 x (B, T)
    for b, (t, a) in enumerate(zip(trajectories, advantages, strict=True)):
        if t.temperature != temperature:
            raise ConfigError(
                f"a trajectory sampled at temperature {t.temperature} cannot train a GRPO loss at "
                f"temperature {temperature}: sample with the loss's temperature"
            )
        seq = [*t.prompt_ids, *t.completion_ids]
        n, P = len(seq) - 1, len(t.prompt_ids)  # n: positions the sequence fills
        if n > seq_len:
            raise ConfigError(f"a trajectory of {len(seq)} tokens does not fit seq_len={seq_len} (+1)")
        x[b, :n] = torch.tensor(seq[:-1])
        targets[b, :n] = torch.tensor(seq[1:])
        blp[b, P - 1 : n] = torch.tensor(t.behaviour_logprobs)
        adv[b, P - 1 : n] = float(a)
        mask[b, P - 1 : n] = 1.0
    return x, {"targets": targets, "behaviour_logprobs": blp, "advantages": adv, "mask": mask}
