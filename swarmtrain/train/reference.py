"""Single-process training of a swarm model: the reference the swarm's loss-parity tests compare against.

Both sides key parameters the same way, part key + parameter name ('embed.wte.weight',
'block.3.attn.c_attn.weight', 'head.lm_head.weight'), so a swarm's stage states can be
checked against the reference state part by part.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from swarmtrain.model import StageModule, build_model
from swarmtrain.train.data import loss_inputs_of
from swarmtrain.train.optim import make_optimizer
from swarmtrain.wire.records import OptimizerConfig


@dataclass(frozen=True, kw_only=True)
class ReferenceResult:
    """What a reference run ends with."""

    losses: list[float]
    """Mean microbatch loss of each step, before that step's update."""
    state: dict[str, Tensor]
    """Final parameters and buffers, keyed by part key + name, e.g. 'block.3.attn.c_attn.weight'."""


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
) -> ReferenceResult:
    """Train `model` for `steps` optimizer steps of `microbatches_per_step` microbatches from `batches`.

    Each microbatch is (inputs, targets) or (inputs, {name: tensor}), the named inputs of
    `loss` (a registered name, as a run manifest gives it; None: the model's own loss).
    The model is initialised exactly as stages initialise their parts (meta build, CPU float32,
    per-part seeds from `seed`, then the model's native checkpoint if it names one), and each step zeroes the grads, backpropagates
    loss / microbatches_per_step for every microbatch, then steps the optimizer once.
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
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(M):
            x, inputs = loss_inputs_of(next(batches))
            value = run_loss(net(x), inputs)
            (value / M).backward()
            total += value.item()
        opt.step()
        losses.append(total / M)
    return ReferenceResult(losses=losses, state=_parts_state(net.parts()))
