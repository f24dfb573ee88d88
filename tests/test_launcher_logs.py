"""LocalSwarm's log folder: a temporary one is removed when the swarm closes cleanly and kept
(and named) when it does not; a folder an earlier swarm used never points this one at that
swarm's processes."""

from __future__ import annotations

import pytest

from swarmtrain.peers.launcher import LocalSwarm, LocalSwarmConfig
from swarmtrain.trust.identity import Identity
from tests.conftest import TINY_GPT

pytestmark = pytest.mark.swarm


def config(**kw) -> LocalSwarmConfig:
    return LocalSwarmConfig(model_config=TINY_GPT | {"n_layer": 2}, num_stages=1, num_trainers=0, **kw)


def test_a_temporary_log_folder_goes_on_a_clean_close_and_stays_on_a_failure():
    with LocalSwarm(config()) as swarm:
        folder = swarm.log_dir
        assert (folder / "coordinator.log").exists()
    assert not folder.exists()

    with pytest.raises(RuntimeError, match="the caller failed"), LocalSwarm(config()) as swarm:
        folder = swarm.log_dir
        raise RuntimeError("the caller failed")
    assert (folder / "coordinator.log").exists()  # what to read after a failure
    kept = LocalSwarm(config(keep_logs=True))
    kept.close(clean=True)
    assert kept.log_dir.exists()


def test_a_reused_log_folder_does_not_lead_to_the_earlier_swarms_peers(tmp_path):
    # what an earlier swarm that died left: its coordinator's address and a stage peer's ready
    # file, naming processes that are gone
    logs = tmp_path / "logs"
    logs.mkdir()
    gone = "/ip4/127.0.0.1/tcp/9/p2p/QmaGAVLdmc6Sy9iu3x5Pc7hgYKescyReqxbZ6HSAdyRhqi"
    (logs / "coordinator.address").write_text(gone + "\n")
    (logs / "stage0-1.ready").write_text("QmaGAVLdmc6Sy9iu3x5Pc7hgYKescyReqxbZ6HSAdyRhqi\n")
    with LocalSwarm(config(log_dir=str(logs))) as swarm:
        coordinator = Identity.load(swarm.identity("coordinator")).peer_id
        assert swarm.address.endswith(f"/p2p/{coordinator}") and swarm.address != gone
        assert swarm.wait_ready("stage0-1") == Identity.load(swarm.identity("stage0-1")).peer_id
