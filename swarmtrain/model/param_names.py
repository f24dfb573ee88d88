"""Parameter names across the swarm: a stage's trained parameters, and the whole model's names.

A stage replica names each parameter '<part key>.<name in the part>' ('embed.tok.weight',
'block.3.attn.qkv.weight', 'head.proj.weight': its swarm name), in the order its
`StageRunner.named_params` holds them. The whole `SwarmModel` names the same tensor
'blocks.3.attn.qkv.weight' (its `state_dict` key).
"""

from __future__ import annotations

import torch

from swarmtrain.errors import SwarmError
from swarmtrain.model.registry import NO_IMPORTS, ModelSources, build_model
from swarmtrain.model.swarm_model import EMBED_KEY, HEAD_KEY, SwarmModel, block_key
from swarmtrain.wire.records import RunManifest

ParamSpec = tuple[str, torch.Size, torch.dtype]
"""(swarm name, shape, dtype) of one trained parameter."""


def span_param_specs(model: SwarmModel, start: int, end: int) -> list[ParamSpec]:
    """The trained parameters of blocks [start, end) (with the embedding for start 0 and the
    head for the last block), in the order a stage replica holds them."""
    parts = [(EMBED_KEY, model.embed)] if start == 0 else []
    parts += [(block_key(i), model.blocks[i]) for i in range(start, end)]
    if end == model.num_blocks:
        parts.append((HEAD_KEY, model.head))
    return [
        (f"{key}.{name}", p.shape, p.dtype)
        for key, part in parts
        for name, p in part.named_parameters()
        if p.requires_grad
    ]


def run_param_specs(manifest: RunManifest, sources: ModelSources = NO_IMPORTS) -> list[list[ParamSpec]]:
    """`span_param_specs` of every stage of the run, from its model built on the meta device."""
    model = build_model(manifest.model, manifest.model_config, device="meta", sources=sources)
    return [span_param_specs(model, *manifest.stage_span(k)) for k in range(manifest.num_stages)]


def stage_param_names(manifest: RunManifest, stage: int, sources: ModelSources = NO_IMPORTS) -> list[str]:
    """The swarm names of `stage`'s trained parameters in the order its replicas hold them."""
    model = build_model(manifest.model, manifest.model_config, device="meta", sources=sources)
    return [name for name, _, _ in span_param_specs(model, *manifest.stage_span(stage))]


def model_param_name(swarm_name: str) -> str:
    """'block.3.attn.w' -> 'blocks.3.attn.w' (the whole SwarmModel's own parameter name)."""
    return "blocks." + swarm_name.removeprefix("block.") if swarm_name.startswith("block.") else swarm_name


def model_from_states(
    manifest: RunManifest, states: list[dict[str, torch.Tensor]], sources: ModelSources = NO_IMPORTS
) -> SwarmModel:
    """The run's whole model built in this process on the CPU, holding the stages' parameters:
    `states[k]` is stage k's, by swarm name (as `Trainer.fetch_states` gives them). Raises
    SwarmError naming what is missing when the states do not hold every trained parameter."""
    model = build_model(manifest.model, manifest.model_config, device="cpu", sources=sources)
    merged = {model_param_name(k): v for state in states for k, v in state.items()}
    wanted = [model_param_name(name) for name, _, _ in span_param_specs(model, 0, model.num_blocks)]
    missing = [name for name in wanted if name not in merged]
    if missing:
        raise SwarmError(
            f"run {manifest.run_id!r}: the stages' states lack {len(missing)} of the model's "
            f"{len(wanted)} trained parameters, e.g. {missing[:3]}"
        )
    model.load_state_dict(merged, strict=False)  # buffers (not trained) keep the builder's values
    return model
