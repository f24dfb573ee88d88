"""A private swarm of real peer processes (`--swarm-key`): it trains, and a peer without the
key sees no run, opens no stream, and is told why."""

import asyncio
import subprocess

import pytest

from swarmtrain.errors import Cause, RemoteError
from swarmtrain.peers.launcher import cli_command
from swarmtrain.swarm import NodeConfig, SwarmNode
from swarmtrain.train.data import TokenBatches, stdlib_text
from swarmtrain.transport import TensorTransport, handler_name
from swarmtrain.trust import generate_swarm_key
from swarmtrain.wire.frames import Frame
from swarmtrain.wire.records import BatchConfig, OptimizerConfig
from tests.conftest import TINY_GPT, assert_losses_match_reference, reference_losses

pytestmark = pytest.mark.swarm

SEED = 3
OPTIMIZER = OptimizerConfig(name="adamw", lr=1e-2)
BATCH = BatchConfig(microbatch_size=4, microbatches_per_step=2, max_in_flight=2)


def batches():
    return TokenBatches(stdlib_text(2**20), seq_len=TINY_GPT["seq_len"], microbatch_size=4, seed=SEED)


def test_a_private_swarm_trains_and_shuts_keyless_peers_out(local_swarm, tmp_path):
    key = tmp_path / "swarm.key"
    generate_swarm_key(key)
    swarm = local_swarm(
        run_id="private", model_config=TINY_GPT, num_stages=2, seed=SEED, optimizer=OPTIMIZER,
        batch=BATCH, swarm_key=str(key),
    )  # fmt: skip
    stage0 = swarm.wait_ready("stage0-1")

    with swarm.trainer() as trainer:
        results = list(trainer.train(batches(), steps=3))
    reference = reference_losses(
        seed=SEED, optimizer=OPTIMIZER, batches=batches(), steps=3, microbatches_per_step=2
    )
    assert_losses_match_reference(results, reference)

    async def knock(node):
        transport = TensorTransport(await node.p2p())
        try:
            with pytest.raises(
                RemoteError, match="belongs to a private swarm: start with --swarm-key"
            ) as info:
                await transport.call(
                    stage0, handler_name("private"), Frame(kind="ping", run_id="private"), timeout_s=30
                )
            return info.value
        finally:
            await node.close_p2p()

    outsider = SwarmNode(NodeConfig(initial_peers=(swarm.address,)))
    try:
        assert outsider.known_runs() == [] and outsider.peers("private") == []
        assert asyncio.run(knock(outsider)).cause == Cause.UNAUTHORIZED
    finally:
        outsider.shutdown()

    joined = subprocess.run(
        cli_command("join", "--initial-peers", swarm.address, "--run-id", "private", "--gpu", "cpu"),
        capture_output=True, text=True, timeout=120, env=swarm._env(),
    )  # fmt: skip
    assert joined.returncode == 2
    assert "no run 'private'" in joined.stderr and "pass --swarm-key FILE" in joined.stderr, joined.stderr
