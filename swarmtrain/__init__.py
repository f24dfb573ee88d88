"""swarmtrain: elastic, decentralized pipeline training over unreliable, unequal GPUs.

The public API, importable from the top level (loaded on first use, so `import swarmtrain`
stays cheap):

- models: `SwarmModel`, `register_builder`, `register_loss`, `build_model`, `build_stage`, `GPTConfig`,
  `ModelSources` (the import paths a peer allows a run to name as its model), `save_model` /
  `load_exported` (a whole model in a directory a run can start from)
- roles: `Coordinator` / `CoordinatorConfig`, `StagePeer` / `StageConfig`,
  `Trainer` / `TrainerConfig`, `RolloutPeer` / `RolloutConfig`, and `LocalSwarm` /
  `LocalSwarmConfig` for a whole swarm on this machine
- settings: `NodeConfig`, `OptimizerConfig`, `BatchConfig`, `CompressionConfig`, `RunManifest`
- data: `TokenBatches`, `load_text`, `loss_inputs_of`
- RL: `RLConfig` (a run's task, G, staleness: `CoordinatorConfig.rl`, `LocalSwarmConfig.rl`),
  `RolloutFeed` (an RL run's data for `Trainer.train`), `Task` / `register_task` (your own
  task); the rest (warm-up, sampling, accuracy) in `swarmtrain.rl`
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "SwarmModel": "swarmtrain.model",
    "register_builder": "swarmtrain.model",
    "register_loss": "swarmtrain.model",
    "build_model": "swarmtrain.model",
    "build_stage": "swarmtrain.model",
    "GPTConfig": "swarmtrain.model",
    "ModelSources": "swarmtrain.model",
    "save_model": "swarmtrain.train.archive",
    "load_exported": "swarmtrain.peers.export",
    "Coordinator": "swarmtrain.peers.coordinator",
    "CoordinatorConfig": "swarmtrain.peers.coordinator",
    "FirstLayoutConfig": "swarmtrain.train.layout",
    "StagePeer": "swarmtrain.peers.stage",
    "StageConfig": "swarmtrain.peers.stage",
    "Trainer": "swarmtrain.peers.trainer",
    "TrainerConfig": "swarmtrain.peers.trainer",
    "StepResult": "swarmtrain.train.step_result",
    "RolloutPeer": "swarmtrain.peers.rollout",
    "RolloutConfig": "swarmtrain.peers.rollout",
    "LocalSwarm": "swarmtrain.peers.launcher",
    "LocalSwarmConfig": "swarmtrain.peers.launcher",
    "NodeConfig": "swarmtrain.swarm",
    "OptimizerConfig": "swarmtrain.wire.records",
    "BatchConfig": "swarmtrain.wire.records",
    "CompressionConfig": "swarmtrain.wire.records",
    "RunManifest": "swarmtrain.wire.records",
    "TokenBatches": "swarmtrain.train.data",
    "load_text": "swarmtrain.train.data",
    "loss_inputs_of": "swarmtrain.train.data",
    "RLConfig": "swarmtrain.wire.rl_config",
    "RolloutFeed": "swarmtrain.rl.feed",
    "Task": "swarmtrain.rl.tasks",
    "register_task": "swarmtrain.rl.registry",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'swarmtrain' has no attribute {name!r}")
