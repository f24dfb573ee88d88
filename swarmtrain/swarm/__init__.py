from swarmtrain.swarm.node import NodeConfig, SwarmNode, check_initial_peers, fresher_view, stage_replicas

__all__ = ["NodeConfig", "SwarmNode", "check_initial_peers", "fresher_view", "stage_replicas"]
