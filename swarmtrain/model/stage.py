"""`StageModule`: the parts of a SwarmModel that one pipeline stage holds.

`build_stage` builds the whole model on the meta device (no memory, no compute), learns the
shapes crossing each stage boundary by running meta tensors through it, and materialises
only the parts the stage holds, each initialised from its own per-part seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from swarmtrain.errors import ConfigError
from swarmtrain.model.losses import Loss, SampleSpec
from swarmtrain.model.native import load_native_weights
from swarmtrain.model.registry import NO_IMPORTS, ModelSources, build_model
from swarmtrain.model.swarm_model import (
    EMBED_KEY,
    HEAD_KEY,
    PROBE_BATCH,
    SwarmModel,
    block_key,
    materialise_parts,
    sample_spec,
)


class StageModule(nn.Module):
    """Blocks [start, end) of a model, with the embedding if start == 0 and the head if end == num_blocks.

    `forward` maps this stage's input to its output: token ids to activations on the first
    stage, activations to activations in the middle, activations to head outputs on the last
    (a one-stage pipeline maps tokens to logits). Build it with `build_stage`.

    Every stage knows the run's loss and the named inputs it takes, so each can check a
    microbatch's inputs; only the last computes it.
    """

    def __init__(
        self,
        *,
        embed: nn.Module | None,
        blocks: list[nn.Module],
        head: nn.Module | None,
        loss: Loss,
        start: int,
        end: int,
        num_blocks: int,
        input_spec: SampleSpec,
        output_spec: SampleSpec,
        loss_input_specs: Mapping[str, SampleSpec],
        native_names: Mapping[str, str] | None = None,
    ):
        super().__init__()
        assert (embed is not None) == (start == 0) and (head is not None) == (end == num_blocks)
        assert len(blocks) == end - start
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.loss_fn = loss
        self.start = start
        self.end = end
        self.num_blocks = num_blocks
        self._input_spec = input_spec
        self._output_spec = output_spec
        self._loss_input_specs = dict(loss_input_specs)
        self.native_names = native_names
        """The model's `SwarmModel.native_names` (all parts, not only this stage's), or None."""

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_blocks

    def parts(self) -> list[tuple[str, nn.Module]]:
        """(key, module) for each part held, in pipeline order; block keys use global indices."""
        held = [(block_key(self.start + i), block) for i, block in enumerate(self.blocks)]
        if self.embed is not None:
            held.insert(0, (EMBED_KEY, self.embed))
        if self.head is not None:
            held.append((HEAD_KEY, self.head))
        return held

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def loss(self, output: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
        """The run's loss on this stage's output against the named `inputs` {name: tensor}; only
        the last stage has the head's output to score (ValueError on any other, or for inputs
        other than the loss takes)."""
        if not self.is_last:
            raise ValueError(
                f"stage [{self.start}, {self.end}) is not the last of {self.num_blocks} blocks: it computes no loss"
            )
        return self.loss_fn(output, inputs)

    def input_spec(self, microbatch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of the input `forward` expects for a microbatch of `microbatch_size` samples."""
        return _batched(self._input_spec, microbatch_size)

    def output_spec(self, microbatch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of what `forward` returns for a microbatch of `microbatch_size` samples."""
        return _batched(self._output_spec, microbatch_size)

    def loss_input_specs(self, microbatch_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of each named input the run's loss takes, for `microbatch_size` samples."""
        return {name: _batched(spec, microbatch_size) for name, spec in self._loss_input_specs.items()}


def _batched(spec: SampleSpec, microbatch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
    if not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ConfigError(f"microbatch_size must be a positive integer, got {microbatch_size!r}")
    shape, dtype = spec
    return (microbatch_size, *shape), dtype


@torch.no_grad()
def _boundary_specs(model: SwarmModel, start: int, end: int) -> tuple[SampleSpec, SampleSpec]:
    """Per-sample (input, output) specs of stage [start, end), by running meta tensors through the parts before it."""
    x = torch.empty((PROBE_BATCH, *model.input_shape), dtype=model.input_dtype, device="meta")
    input_spec = sample_spec(x, "the model input")
    x = model.embed(x)
    for block in model.blocks[:start]:
        x = block(x)
    if start > 0:
        input_spec = sample_spec(x, block_key(start - 1))
    for block in model.blocks[start:end]:
        x = block(x)
    if end == model.num_blocks:
        x = model.head(x)
    return input_spec, sample_spec(x, f"the part ending stage [{start}, {end})")


def build_stage(
    model_ref: str,
    model_config: Mapping[str, Any],
    start: int,
    end: int,
    *,
    num_blocks: int | None = None,
    seed: int,
    loss: str | None = None,
    device: str | torch.device = "cpu",
    sources: ModelSources = NO_IMPORTS,
) -> StageModule:
    """The stage holding blocks [start, end) of model `model_ref`, initialised from run `seed`, on `device`.

    Only the held parts are materialised: on the CPU in float32, each from its per-part seed
    (so they are bit-identical to the same parts in any other stage or the full model), then
    read from the model's `native_weights` checkpoint if it has one (this stage's tensors
    only), then moved to `device`. `loss` is the run's loss by registered name (None: the
    model's own); `model_ref` resolves under `sources` (`resolve_builder`). Raises ConfigError if the model
    has other than `num_blocks` blocks (when given), [start, end) is not a non-empty range
    within them, the loss is unknown or does not fit the model, a parameter is set by no
    initialiser (`materialise_parts`), or the checkpoint lacks or misshapes a held tensor.
    """
    model = build_model(model_ref, model_config, device="meta", sources=sources)
    n = model.num_blocks
    if num_blocks is not None and num_blocks != n:
        raise ConfigError(
            f"model {model_ref!r} with options {dict(model_config)} has {n} blocks, but the run expects {num_blocks}: "
            "every peer must use the run's model options"
        )
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= n):
        raise ConfigError(f"stage blocks [{start}, {end}) must satisfy 0 <= start < end <= {n}")
    input_spec, output_spec = _boundary_specs(model, start, end)
    run_loss = model.resolve_loss(loss)
    loss_input_specs = run_loss.input_specs(model.output_spec())

    embed = model.embed if start == 0 else None
    head = model.head if end == n else None
    held = [(block_key(i), model.blocks[i]) for i in range(start, end)]
    if embed is not None:
        held.insert(0, (EMBED_KEY, embed))
    if head is not None:
        held.append((HEAD_KEY, head))
    materialise_parts(held, seed, init_weights=model.init_weights)

    stage = StageModule(
        embed=embed,
        blocks=list(model.blocks[start:end]),
        head=head,
        loss=run_loss,
        start=start,
        end=end,
        num_blocks=n,
        input_spec=input_spec,
        output_spec=output_spec,
        loss_input_specs=loss_input_specs,
        native_names=model.native_names,
    )
    if model.native_weights is not None:
        load_native_weights(stage, model.native_weights)
    return stage.to(device)
