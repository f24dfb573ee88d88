"""Models a swarm can train: `SwarmModel` parts, the builder and loss registries, and pipeline stages."""

from swarmtrain.model.gpt import GPTConfig
from swarmtrain.model.losses import Loss, get_loss, register_loss, registered_losses
from swarmtrain.model.native import load_native_weights, save_native_tensors
from swarmtrain.model.registry import (
    ModelSources,
    build_model,
    installed_models,
    register_builder,
    registered_models,
    resolve_builder,
)
from swarmtrain.model.stage import StageModule, build_stage
from swarmtrain.model.swarm_model import SwarmModel, block_key, init_part, materialise_parts, part_seed

__all__ = [
    "GPTConfig",
    "Loss",
    "ModelSources",
    "StageModule",
    "SwarmModel",
    "block_key",
    "build_model",
    "build_stage",
    "get_loss",
    "init_part",
    "installed_models",
    "load_native_weights",
    "materialise_parts",
    "part_seed",
    "register_builder",
    "register_loss",
    "registered_losses",
    "registered_models",
    "resolve_builder",
    "save_native_tensors",
]
