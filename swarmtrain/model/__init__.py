"""Models a swarm can train: `SwarmModel` parts, the builder registry, and pipeline stages."""

from swarmtrain.model.gpt import GPTConfig
from swarmtrain.model.registry import build_model, register_builder, registered_models, resolve_builder
from swarmtrain.model.stage import StageModule, build_stage
from swarmtrain.model.swarm_model import SwarmModel, block_key, init_part, part_seed

__all__ = [
    "GPTConfig",
    "StageModule",
    "SwarmModel",
    "block_key",
    "build_model",
    "build_stage",
    "init_part",
    "part_seed",
    "register_builder",
    "registered_models",
    "resolve_builder",
]
