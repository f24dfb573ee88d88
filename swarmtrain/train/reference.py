"""Single-process training of a swarm model: the reference the swarm's loss-parity tests compare against.

Both sides key parameters the same way, part key + parameter name ('embed.wte.weight',
'block.3.attn.c_attn.weight', 'head.lm_head.weight'), so a swarm's stage states can be
checked against the reference state part by part.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from swarmtrain.model import StageModule, build_model
from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.optim import lr_at, make_optimizer, set_lr
from swarmtrain.wire.records import OptimizerConfig


@dataclass(frozen=True, kw_only=True)
class ReferenceResult:
    """What a reference run ends with."""

    losses: list[float]
    """Mean microbatch loss of each step, before that step's update."""
    state: dict[str, Tensor]
    """Final parameters and buffers, keyed by part key + name, e.g. 'block.3.attn.c_attn.weight'."""
    lrs: list[float] = field(default_factory=list)
    """The learning rate of each step."""
    grad_norms: list[float] = field(default_factory=list)
    """The L2 norm of the whole model's gradient at each step, before clipping."""


def _parts_state(parts: list[tuple[str, nn.Module]]) -> dict[str, Tensor]:
    return {
        f"{key}.{name}": tensor.detach().cpu().clone()
        for key, part in parts
        for name, tensor in part.state_dict().items()
    }


def stage_state_dict(stage: StageModule) -> dict[str, Tensor]:
    """A CPU copy of the stage's parameters and buffers, keyed like `ReferenceResult.state`."""
    return _parts_state(stage.parts())


def train_reference(
    *,
    model: str,
    model_config: Mapping[str, Any],
    seed: int,
    optimizer: OptimizerConfig,
    batches: Iterator[tuple[Tensor, Tensor] | tuple[Tensor, Mapping[str, Tensor]]],
    steps: int,
    microbatches_per_step: int,
    loss: str | None = None,
    max_steps: int = 0,
) -> ReferenceResult:
    """Train `model` for `steps` optimizer steps of `microbatches_per_step` microbatches from `batches`.

    Each microbatch is (inputs, targets) or (inputs, {name: tensor}), the named inputs of
    `loss` (a registered name, as a run manifest gives it; None: the model's own loss).
    The model is initialised exactly as stages initialise their parts (meta build, CPU float32,
    per-part seeds from `seed`, then the model's native checkpoint if it names one), and each
    step zeroes the grads, backpropagates loss / microbatches_per_step for every microbatch,
    clips the gradient norm to the optimizer's max_grad_norm (torch.nn.utils.clip_grad_norm_,
    when it is > 0), then steps the optimizer once at the schedule's learning rate for that step
    of a run of `max_steps`.
    """
    if steps < 1 or microbatches_per_step < 1:
        raise ValueError(
            f"steps and microbatches_per_step must be >= 1, got {steps} and {microbatches_per_step}"
        )
    net = build_model(model, model_config, device="meta")
    run_loss = net.resolve_loss(loss)
    net.materialise(seed)
    net.train()
    opt = make_optimizer(net.parameters(), optimizer)
    M = microbatches_per_step
    params = [p for p in net.parameters() if p.requires_grad]
    losses, lrs, grad_norms = [], [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(M):
            x, inputs = loss_inputs_of(next(batches))
            value = run_loss(net(x), inputs)
            (value / M).backward()
            total += value.item()
        if optimizer.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, optimizer.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        lrs.append(lr_at(optimizer, step, max_steps))
        set_lr(opt, lrs[-1])
        opt.step()
        losses.append(total / M)
        grad_norms.append(float(norm))
    return ReferenceResult(losses=losses, state=_parts_state(net.parts()), lrs=lrs, grad_norms=grad_norms)
