from swarmtrain.swarm.node import NodeConfig, SwarmNode, check_initial_peers, stage_replicas

__all__ = ["NodeConfig", "SwarmNode", "check_initial_peers", "stage_replicas"]
