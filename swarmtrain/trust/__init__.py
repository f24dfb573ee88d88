"""Who may do what in a swarm: peer identities, signed DHT records, the run's owner and the
peers it authorizes, and the shared key of a private swarm.

- `swarmkey`: `SwarmKey`, the secret every peer of a private swarm holds (`--swarm-key`).
"""

from swarmtrain.trust.swarmkey import SwarmKey, generate_swarm_key, load_swarm_key

__all__ = ["SwarmKey", "generate_swarm_key", "load_swarm_key"]
