import os

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TINY_GPT = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab_size": 256}


@pytest.fixture
def local_swarm(tmp_path):
    """Factory for LocalSwarms that are closed (every process reaped) at teardown."""
    from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig

    swarms = []

    def make(**overrides) -> LocalSwarm:
        overrides.setdefault("log_dir", str(tmp_path / f"swarm{len(swarms)}"))
        swarm = LocalSwarm(LocalSwarmConfig(**overrides))
        swarms.append(swarm)
        swarm.start()
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()
